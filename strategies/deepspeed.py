"""deepspeed_zero1 / deepspeed_zero2 / deepspeed_zero3: DeepSpeed's ZeRO through Accelerate, chosen by the
accelerate config, not by a flag: `accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml
experiments/train_gpt.py` (its `--strategy` is then `auto`, or must name that stage). Accelerate's
`prepare(model, optimizer)` returns DeepSpeed's engine; `accelerator.backward(loss)` runs the engine's
backward AND its optimizer step (the update, the clipping at the config's `gradient_clipping`, the
all-gather of the updated parameters), so clipping and the gradient norm are DeepSpeed's (`clip` reads
the norm the engine used). Unlike FSDP, Accelerate can run this on CPU (strategies need no own
sharding code): see common/runtime.deepspeed_on_cpu for the two settings that takes.

What each rank holds (N ranks, P parameters; measured from the engine's own buffers, `measure_held`):
  all stages   the optimizer state of 1/N of the parameters: a float32 MASTER copy of that partition
               (DeepSpeed keeps one even when the model is float32: it is built for fp16/bf16 training)
               plus AdamW's two moments of it, 12 bytes per partitioned parameter, and a step count per
               parameter group. FSDP2 in float32 keeps no master copy: 8 bytes per parameter.
  ZeRO-1, -2   every parameter whole (4 bytes each); gradients live only during backward.
  ZeRO-3       each parameter's 1/N partition (`ds_tensor`), a flat buffer of 1/N of the gradients, and,
               unlike FSDP2, every parameter of at most 100,000 elements WHOLE as well (DeepSpeed's
               `stage3_param_persistence_threshold`: small parameters stay resident, refreshed after each
               step) - on the default GPT every weight but the embedding. The others are gathered for their
               forward and again for their backward, and freed after each use, as FSDP2's blocks are.
What one step sends (k micro-batches; counted by common/comm_counter.py, like every strategy):
  ZeRO-1       all-reduce every gradient once per step (at the accumulation boundary), then all-gather
               every updated parameter once;
  ZeRO-2       the same, except that the gradients are all-reduced after EVERY micro-batch (each rank
               keeps only its partition of them). DeepSpeed's "reduce_scatter" is an all-reduce here:
               `use_multi_rank_bucket_allreduce` (on by default) all-reduces each bucket and each rank
               keeps its slice, so ZeRO-2 puts 2(N-1)/N of the gradients on the wire, not (N-1)/N;
  ZeRO-3       reduce-scatter every gradient per micro-batch, all-gather the non-resident parameters
               twice per micro-batch (forward, backward), and all-gather the resident ones after each step;
  all stages   two scalar all-reduces per step: the global gradient norm and the overflow check
               (4 bytes each under ZeRO-1/2, 8 under ZeRO-3).
Checkpoints: Accelerate's save_state, DeepSpeed's own format (per-rank partitions): a resume needs the
same stage and world size (refused otherwise, in one line); its full state (every parameter and AdamW
moment, by name) is read through DeepSpeed's safe_get_full_* for the digest and the one-process
reference. Refused: bf16 (not built here); an accelerate config whose gradient_accumulation_steps or
gradient_clipping contradicts the flags (leave those keys out: the flags fill them).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings

import torch

from common.checkpoint import FullState
from common.config import require
from common.runtime import deepspeed_stage
from strategies import defaults
from strategies.layout import Layout, communication, data_parallel_only, unique_parameters

PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold (elements), its default
CONFIGS = "accelerate_configs/deepspeed_zero{stage}.yaml"
OWN_WRONG_VARIANTS = {
    "clip_from_accelerate_default": "gradient_clipping left to Accelerate's 'auto', which it fills with 1.0, "
    "whatever --grad_clip says",
    "textbook_zero3_theory": "expecting textbook ZeRO-3 from DeepSpeed (every parameter sharded): it keeps "
    "every parameter of <= 100,000 elements whole on every rank",
}


class ZeRO:
    """One ZeRO stage of DeepSpeed: the strategy interface of strategies/__init__.py, for that stage."""

    RANKS = 2
    AUTOCAST = False
    CHECKPOINT_FORMAT = "deepspeed"
    # the engine's own forward and backward (Accelerate's backward calls it), nothing more to report
    forward, backward, report = (
        staticmethod(f) for f in (defaults.forward, defaults.backward, defaults.report)
    )

    def __init__(self, stage: int):
        self.stage = stage
        self.NAME = f"deepspeed_zero{stage}"
        # ZeRO-3 traces the order modules run in over the first iterations (the evaluation's forwards count)
        # and settles it with broadcasts in step 3 (measured): steady from step 4
        self.STEADY_STEP = 4 if stage == 3 else 3
        self.LAUNCH_CONFIG = CONFIGS.format(stage=stage)
        self.SUMMARY = {
            1: "DeepSpeed ZeRO-1: optimizer state (a float32 master copy + AdamW's moments) 1/N per rank",
            2: "DeepSpeed ZeRO-2: + gradients partitioned (all-reduced every micro-batch)",
            3: "DeepSpeed ZeRO-3: + parameters partitioned, those of <= 100k elements kept whole",
        }[stage]
        self.WRONG_VARIANTS = (
            "same_data_on_every_rank",
            "clip_from_accelerate_default",
            *(("textbook_zero3_theory",) if stage == 3 else ()),
            "resume_without_optimizer_state",
            "resume_without_data_position",
        )
        self.__doc__ = __doc__

    # ---------------------------------------------------------------------------- shape and refusals
    def layout(self, world_size: int, dp_size: int = 0, tp_size: int = 0) -> Layout:
        return data_parallel_only(self.NAME, world_size, dp_size, tp_size)

    def refuse(self, cfg, layout: Layout) -> None:
        stage = deepspeed_stage()
        require(
            stage == self.stage,
            f"--strategy {self.NAME} runs under a DeepSpeed accelerate config of ZeRO stage {self.stage}: launch with "
            f"--config_file {self.LAUNCH_CONFIG}"
            + (
                f" (this launch's config is ZeRO-{stage})"
                if stage
                else " (this launch has no DeepSpeed config)"
            ),
        )
        require(
            cfg.mixed_precision == "no",
            f"--mixed_precision {cfg.mixed_precision} with --strategy {self.NAME}: not built; use no",
        )
        configured = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
        require(
            configured is None or int(configured) == cfg.gradient_accumulation_steps,
            f"the accelerate config sets gradient_accumulation_steps {configured}, --gradient_accumulation_steps is "
            f"{cfg.gradient_accumulation_steps}: leave the key out of the config (the flag fills it)",
        )
        clipping = os.environ.get("ACCELERATE_GRADIENT_CLIPPING", "auto")
        require(
            clipping == "auto" or float(clipping) == cfg.grad_clip,
            f"the accelerate config sets gradient_clipping {clipping}, --grad_clip is {cfg.grad_clip}: leave the key "
            "out of the config (the flag fills it)",
        )

    # --------------------------------------------------------------------------------------- apply
    def apply(self, model, layout: Layout, accelerator, cfg):
        """DeepSpeed's engine and its ZeRO optimizer around our AdamW (prepare() needs both at once)."""
        optimizer = model.configure_optimizers(cfg.lr, cfg.weight_decay)
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = cfg.per_rank_batch_size  # no DataLoader to infer it from
        # our torch AdamW: DeepSpeed's own Adam optimizers are compiled ops, which this project does not build
        config["zero_allow_untested_optimizer"] = True
        if (
            cfg.wrong_variant != "clip_from_accelerate_default"
        ):  # the mistake: Accelerate fills "auto" with 1.0
            config["gradient_clipping"] = cfg.grad_clip
        return accelerator.prepare(model, optimizer)

    @contextlib.contextmanager
    def quiet(self):
        """DeepSpeed calls torch.distributed's deprecated all_gather_into_tensor name (FutureWarning on every
        step): expected, silenced for the run, restored after."""
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*all_gather_into_tensor. is deprecated", category=FutureWarning
            )
            warnings.filterwarnings(
                "ignore", message=".*reduce_scatter_tensor. is deprecated", category=FutureWarning
            )
            yield

    def clip(self, model, cfg) -> float:
        """The engine clipped inside accelerator.backward (its optimizer step): the global norm it used."""
        return float(model.get_global_grad_norm())

    def checkpointer(self, model, optimizer, accelerator, cfg):
        return DeepSpeedCheckpointer(
            model, optimizer, accelerator, cfg.wrong_variant != "resume_without_optimizer_state"
        )

    # --------------------------------------------------------------------------------- theory: held
    def partitions(self, model, layout: Layout) -> int:
        """Elements of the partition each rank owns: ZeRO-1/2 split each flat parameter group, padded to a
        multiple of 2N (DeepSpeed's alignment of 2 elements per rank); ZeRO-3 splits each parameter."""
        if self.stage == 3:
            return sum(math.ceil(p.numel() / layout.dp) for _, p in unique_parameters(model))
        groups = group_sizes(model)
        return sum(math.ceil(numel / (2 * layout.dp)) * 2 for numel in groups)

    def held_bytes(self, model, layout: Layout, rank: int, cfg) -> dict:
        parameters = unique_parameters(model)
        partition = 4 * self.partitions(model, layout)
        optimizer = 3 * partition + 4 * len(group_sizes(model))  # master + 2 moments; a step count per group
        if self.stage < 3:  # every parameter whole; gradients only during backward
            full = sum(4 * p.numel() for _, p in parameters)
            return {
                "params": full,
                "grads": 0,
                "optimizer": optimizer,
                "params_between_forward_and_backward": full,
            }
        threshold = 0 if cfg.wrong_variant == "textbook_zero3_theory" else PERSISTENCE_THRESHOLD
        resident = sum(4 * p.numel() for _, p in parameters if p.numel() <= threshold)
        # the gathered copies of the others are freed after each use, in forward and again in backward
        params = partition + resident
        return {
            "params": params,
            "grads": partition,
            "optimizer": optimizer,
            "params_between_forward_and_backward": params,
        }

    # --------------------------------------------------------------------------------- theory: sent
    def sent_bytes(self, model, layout: Layout, cfg) -> dict:
        parameters = unique_parameters(model)
        k, full = cfg.gradient_accumulation_steps, sum(4 * p.numel() for _, p in parameters)
        if self.stage < 3:
            reductions = 1 if self.stage == 1 else k  # ZeRO-2 reduces every micro-batch
            return communication({"all_reduce": reductions * full + 2 * 4, "all_gather": full}, {}, layout)
        threshold = 0 if cfg.wrong_variant == "textbook_zero3_theory" else PERSISTENCE_THRESHOLD
        padded = {name: 4 * math.ceil(p.numel() / layout.dp) * layout.dp for name, p in parameters}
        resident = sum(4 * p.numel() for _, p in parameters if p.numel() <= threshold)
        gathered = sum(
            padded[name] for name, p in parameters if p.numel() > threshold
        )  # for forward and backward
        sent = {
            "reduce_scatter": k * sum(padded.values()),
            "all_gather": 2 * k * gathered + resident,
            "all_reduce": 2 * 8,
        }
        return communication(sent, {}, layout)

    # ------------------------------------------------------------------------------ measured: held
    def measure_held(self, model, optimizer) -> dict:
        """What this rank really holds, read from the engine and its ZeRO optimizer at rest (after a step)."""
        zero = model.optimizer
        parameters = [p for _, p in unique_parameters(model.module)]
        master = flat_partitions(zero)
        if self.stage < 3:
            params = sum(nbytes(p.data) for p in parameters)
            grads = sum(nbytes(p.grad) for p in parameters if p.grad is not None)
        else:
            params = sum(nbytes(p.data) + nbytes(p.ds_tensor) for p in parameters)
            grads = nbytes(zero.grad_partitions_flat_buffer)
        moments = sum(
            nbytes(v) for state in zero.optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )
        return {"params": params, "grads": grads, "optimizer": sum(nbytes(t) for t in master) + moments}

    def measure_window(self, model) -> int:
        """Parameter bytes held between forward and backward (ZeRO-3: resident + partitions + gathered)."""
        parameters = [p for _, p in unique_parameters(model.module)]
        return sum(
            nbytes(p.data) + (nbytes(p.ds_tensor) if hasattr(p, "ds_tensor") else 0) for p in parameters
        )


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def group_sizes(model) -> list[int]:
    """Elements of each parameter group GPT.configure_optimizers makes (matrices, then the rest)."""
    parameters = unique_parameters(model)
    return [
        sum(p.numel() for _, p in parameters if p.dim() >= 2),
        sum(p.numel() for _, p in parameters if p.dim() < 2),
    ]


class DeepSpeedCheckpointer(FullState):
    """Accelerate's save_state / load_state under DeepSpeed (the engine's own checkpoint: each rank's
    partitions, every rank's RNG state), and the FULL state read through DeepSpeed's safe_get_full_*
    (a collective: every rank calls it) in the name-keyed form the other checkpointers digest:
    {name: parameter}, {"state": {name: {"exp_avg", "exp_avg_sq", "step"}}, "param_groups": [...]}."""

    def __init__(self, model, optimizer, accelerator, restore_optimizer: bool = True):
        self.model, self.optimizer, self.accelerator = model, optimizer, accelerator
        self.restore_optimizer = restore_optimizer

    def save(self, folder: str) -> None:
        self.accelerator.save_state(folder)

    def load(self, folder: str, same_layout: bool) -> None:
        # the classic half-resume (resume_without_optimizer_state): DeepSpeed's load_optimizer_states=False
        self.accelerator.load_state(folder, load_optimizer_states=self.restore_optimizer)

    def full_state(self) -> tuple[dict, dict]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        link_every_group(self.model.optimizer)
        module, base = self.model.module, self.model.optimizer.optimizer
        every_name = dict(module.named_parameters(remove_duplicate=False))  # the tied head under both names
        unique = dict(module.named_parameters())
        full = {name: safe_get_full_fp32_param(p).detach().cpu().clone() for name, p in unique.items()}
        fresh = not any(
            base.state.values()
        )  # no step taken, or a resume that did not load the optimizer state
        moments = {
            name: {
                key: torch.zeros_like(full[name])
                if fresh
                else safe_get_full_optimizer_state(p, key).detach().cpu().clone()
                for key in ("exp_avg", "exp_avg_sq")
            }
            for name, p in unique.items()
        }
        # GPT.configure_optimizers' groups: matrices, then the rest (a ZeRO-3 parameter's own shape is ds_shape)
        matrix = {n: len(getattr(p, "ds_shape", p.shape)) >= 2 for n, p in unique.items()}
        groups = [[n for n in unique if matrix[n]], [n for n in unique if not matrix[n]]]
        state, param_groups = {}, []
        flat = flat_partitions(self.model.optimizer)
        for names, group, partition in zip(groups, base.param_groups, flat, strict=True):
            step = torch.zeros(()) if fresh else base.state[partition]["step"].detach().cpu().clone().float()
            for name in names:
                state[name] = {"step": step.clone(), **moments[name]}
            param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        if torch.distributed.get_rank() != 0:
            return {}, {}
        model_state = {
            name: full[next(n for n, q in unique.items() if q is p)] for name, p in every_name.items()
        }
        return model_state, {"state": state, "param_groups": param_groups}


def flat_partitions(zero) -> list:
    """This rank's float32 master partition of each parameter group, the tensors AdamW's state is keyed by."""
    return list(getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat)


def link_every_group(zero) -> None:
    """ZeRO-1/2 map each parameter to its slice of the optimizer state (what safe_get_full_optimizer_state
    reads) lazily, once, right after the FIRST group's first step, before the other groups have any state:
    with two parameter groups (GPT.configure_optimizers: matrices, then the rest) every parameter of the
    second group is left unmapped ("exp_avg not found in optimizer state fragment"; DeepSpeed 0.19.8,
    measured; tests/test_deepspeed.py records it). Mapping every group again with DeepSpeed's own
    lazy_init_hp_params_optimizer_state, once all have state, completes it. ZeRO-3 reads the state directly."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for lp_params, hp_partition in zip(
        getattr(zero, "bit16_groups", []), getattr(zero, "single_partition_of_fp32_groups", []), strict=False
    ):
        if hp_partition in zero.optimizer.state:
            lazy_init_hp_params_optimizer_state(lp_params, hp_partition, zero.optimizer.state)


def unmapped_parameters(zero) -> int:
    """Parameters of this rank's partition that DeepSpeed left without their optimizer-state slice (see
    link_every_group): the upstream behaviour tests/test_deepspeed.py records."""
    return sum(
        1
        for group in getattr(zero, "bit16_groups", [])
        for p in group
        if getattr(p, "_hp_mapping", None) is not None and not p._hp_mapping.optim_fragment
    )


ZERO1, ZERO2, ZERO3 = ZeRO(1), ZeRO(2), ZeRO(3)
