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

import math
import os

import torch

from common.checkpoint import FullState
from common.config import require
from strategies.job import Job
from strategies.layout import Layout, Mistake, Traffic, Workload, unique_parameters
from strategies.piece import Context, Plan

PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold (elements), its default
CONFIGS = "accelerate_configs/deepspeed_zero{stage}.yaml"
MISTAKES = {  # each: what it is, and the runs under which it is one (DeepSpeed's engine, textbook ZeRO-3 at stage 3)
    "clip_from_accelerate_default": Mistake(
        "gradient_clipping left to Accelerate's 'auto', which it fills with 1.0, whatever --grad_clip says",
        lambda plan: plan.engine_stage is not None,
    ),
    "textbook_zero3_theory": Mistake(
        "expecting textbook ZeRO-3 from DeepSpeed (every parameter sharded): it keeps every parameter of <= 100,000 "
        "elements whole on every rank",
        lambda plan: plan.engine_stage == 3,
    ),
}


def refuse(plan: Plan, max_norm: float) -> None:
    """What DeepSpeed's engine is not asked to do here, and an accelerate config that contradicts the flags."""
    layout, work, stage = plan.layout, plan.work, plan.engine_stage
    others = [f"--{dim} {n}" for dim, n in layout.degrees().items() if n > 1 and dim != "dp_shard"]
    require(not others, f"{', '.join(others)} under a DeepSpeed ZeRO-{stage} accelerate config: DeepSpeed's ZeRO "
            "is data parallelism over every rank here; compose dimensions without DeepSpeed (accelerate_configs/"
            "cpu_ddp.yaml)")  # fmt: skip
    require(work.mixed_precision == "no",
            f"--mixed_precision {work.mixed_precision} with DeepSpeed ZeRO-{stage}: not built; use no")  # fmt: skip
    configured = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    require(
        configured is None or int(configured) == work.micro_batches,
        f"the accelerate config sets gradient_accumulation_steps {configured}, --gradient_accumulation_steps is "
        f"{work.micro_batches}: leave the key out of the config (the flag fills it)",
    )
    clipping = os.environ.get("ACCELERATE_GRADIENT_CLIPPING", "auto")
    require(
        clipping == "auto" or float(clipping) == max_norm,
        f"the accelerate config sets gradient_clipping {clipping}, --grad_clip is {max_norm}: leave the key "
        "out of the config (the flag fills it)",
    )


def parallelize(gpt, plan: Plan, accelerator, make_optimizer, max_norm: float):
    """DeepSpeed's engine and its ZeRO optimizer around our AdamW (prepare() needs both at once)."""
    args, work = plan.args, plan.work
    optimizer = make_optimizer(gpt.parameters())
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = work.rows  # no DataLoader to infer it from
    # our torch AdamW: DeepSpeed's own Adam optimizers are compiled ops, which this project does not build
    config["zero_allow_untested_optimizer"] = True
    if args.wrong_variant != "clip_from_accelerate_default":  # the mistake: Accelerate fills "auto" with 1.0
        config["gradient_clipping"] = max_norm
    engine, optimizer = accelerator.prepare(gpt, optimizer)
    ctx = Context(plan, accelerator.process_index, None, accelerator.device, accelerator, stages=[engine])
    return DeepSpeedJob(ctx, engine, optimizer, max_norm)


class DeepSpeedJob(Job):
    """A rank's part of the GPT under DeepSpeed's ZeRO: `accelerator.backward(loss)` runs the engine's backward
    AND its optimizer step (the update, the clipping at the config's `gradient_clipping`, the all-gather of the
    updated parameters), so clipping and the gradient norm are DeepSpeed's (`clip` reads the norm the engine
    used)."""

    def __init__(self, ctx: Context, engine, optimizer, max_norm: float):
        super().__init__(ctx, engine, optimizer, max_norm)
        self.stage = ctx.plan.engine_stage

    @property
    def steady_step(self) -> int:
        """ZeRO-3 traces the order modules run in over the first iterations (the evaluation's forwards count)
        and settles it with broadcasts in step 3 (measured): steady from step 4."""
        return 4 if self.stage == 3 else 3

    def clip(self, local_only: bool = False) -> float:
        """The engine clipped inside accelerator.backward (its optimizer step): the global norm it used."""
        return float(self.model.get_global_grad_norm())

    def checkpointer(self, restore_optimizer: bool = True):
        return DeepSpeedCheckpointer(self.model, self.optimizer, self.accelerator, restore_optimizer)

    def held_bytes(self, model, rank: int) -> dict:
        return held_bytes(model, self.layout, self.stage, self.args.wrong_variant)

    def sent_bytes(self, model, rank: int, counted: dict | None = None) -> dict:
        return sent_bytes(model, self.layout, self.stage, self.work, self.args.wrong_variant)

    # ------------------------------------------------------------------------------ measured: held
    def measure_held(self) -> dict:
        """What this rank really holds, read from the engine and its ZeRO optimizer at rest (after a step)."""
        zero = self.model.optimizer
        parameters = [p for _, p in unique_parameters(self.model.module)]
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

    def measure_window(self) -> int:
        """Parameter bytes held between forward and backward (ZeRO-3: resident + partitions + gathered)."""
        parameters = [p for _, p in unique_parameters(self.model.module)]
        return sum(
            nbytes(p.data) + (nbytes(p.ds_tensor) if hasattr(p, "ds_tensor") else 0) for p in parameters
        )


# ----------------------------------------------------------------------------------------- theory
def partitions(model, layout: Layout, stage: int) -> int:
    """Elements of the partition each rank owns: ZeRO-1/2 split each flat parameter group, padded to a multiple
    of 2N (DeepSpeed's alignment of 2 elements per rank); ZeRO-3 splits each parameter."""
    if stage == 3:
        return sum(math.ceil(p.numel() / layout.dp) for _, p in unique_parameters(model))
    return sum(math.ceil(numel / (2 * layout.dp)) * 2 for numel in group_sizes(model))


def held_bytes(model, layout: Layout, stage: int, variant: str = "") -> dict:
    """What each rank holds at rest, by the module docstring (`model`: the undistributed GPT)."""
    parameters = unique_parameters(model)
    partition = 4 * partitions(model, layout, stage)
    optimizer = 3 * partition + 4 * len(group_sizes(model))  # master + 2 moments; a step count per group
    if stage < 3:  # every parameter whole; gradients only during backward
        full = sum(4 * p.numel() for _, p in parameters)
        return {
            "params": full,
            "grads": 0,
            "optimizer": optimizer,
            "params_between_forward_and_backward": full,
        }
    threshold = 0 if variant == "textbook_zero3_theory" else PERSISTENCE_THRESHOLD
    resident = sum(4 * p.numel() for _, p in parameters if p.numel() <= threshold)
    # the gathered copies of the others are freed after each use, in forward and again in backward
    params = partition + resident
    return {
        "params": params,
        "grads": partition,
        "optimizer": optimizer,
        "params_between_forward_and_backward": params,
    }


def sent_bytes(model, layout: Layout, stage: int, work: Workload, variant: str = "") -> dict:
    """One step's bytes by kind, by the module docstring."""
    parameters = unique_parameters(model)
    n, k, full = layout.dp, work.micro_batches, sum(4 * p.numel() for _, p in parameters)
    if stage < 3:
        reductions = 1 if stage == 1 else k  # ZeRO-2 reduces every micro-batch
        sizes = {"all_reduce": reductions * full + 2 * 4, "all_gather": full}
    else:
        threshold = 0 if variant == "textbook_zero3_theory" else PERSISTENCE_THRESHOLD
        padded = {name: 4 * math.ceil(p.numel() / n) * n for name, p in parameters}
        resident = sum(4 * p.numel() for _, p in parameters if p.numel() <= threshold)
        gathered = sum(
            padded[name] for name, p in parameters if p.numel() > threshold
        )  # forward and backward
        sizes = {"reduce_scatter": k * sum(padded.values()), "all_gather": 2 * k * gathered + resident,
                 "all_reduce": 2 * 8}  # fmt: skip
    traffic = [Traffic(kind, size, n, "dp_shard") for kind, size in sizes.items()]
    return {
        "by_kind": sizes,
        "by_dimension": {"dp_shard": sizes},
        "wire_bytes": sum(t.wire_bytes for t in traffic),
    }


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def group_sizes(model) -> list[int]:
    """Elements of each parameter group GPT.configure_optimizers makes (matrices, then the rest)."""
    parameters = unique_parameters(model)
    return [
        sum(p.numel() for _, p in parameters if p.dim() >= 2),
        sum(p.numel() for _, p in parameters if p.dim() < 2),
    ]


class Engine:
    """DeepSpeed's ZeRO as an engine: under a DeepSpeed accelerate config it replaces every piece."""

    name = "deepspeed"
    MISTAKES = MISTAKES

    def is_on(self, plan: Plan) -> bool:
        return bool(plan.engine_stage)

    def refuse(self, plan: Plan, max_norm: float) -> None:
        refuse(plan, max_norm)

    def parallelize(self, gpt, plan: Plan, accelerator, make_optimizer, max_norm: float):
        return parallelize(gpt, plan, accelerator, make_optimizer, max_norm)


ENGINE = Engine()


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
