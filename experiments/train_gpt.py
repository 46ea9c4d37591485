"""train_gpt: a small GPT on real text, by DDP, sharded data parallelism (ZeRO-2 / ZeRO-3 with FSDP2),
tensor parallelism, or both (2-D). Does each train exactly what one process would, hold what the theory
says it holds, and send what the theory says it sends?

The model is common/gpt.py (nanoGPT-style, 4 layers of d_model 128 by default, ~1M parameters); the
text is CPython's own reference prose (pydoc topics) or --text_files, tokenized by a BPE trained here
(common/text.py). AdamW, warmup + cosine learning rate (stepped once per optimizer step), gradient
clipping by the GLOBAL norm, optional bf16. --strategy:
  none   one process: the reference, and the baseline;
  ddp    Accelerate's prepare: every rank holds everything, gradients all-reduced (averaged);
  zero2  FSDP2 `fully_shard(reshard_after_forward=False)`: gradients reduce-scattered, optimizer
         state and parameters sharded at rest, each block's full parameters kept from forward to
         backward (ZeRO-2's memory: full parameters while computing, sharded gradients + optimizer);
  fsdp   FSDP2 `fully_shard` (ZeRO-3): each block's parameters all-gathered just before use and
         freed right after, in forward and again in backward;
  tp     tensor parallelism (Megatron-style, DTensor's parallelize_module, common/sharding.py): each
         rank holds 1/N of every block's heads and MLP units and of the vocabulary; activations are
         all-reduced twice per block in forward and twice in backward. Every rank sees the SAME data;
  fsdp_tp  2-D: a (--dp_size x --tp_size) mesh, TP inside each group of tp_size ranks, FSDP2 (ZeRO-3)
         across the groups; each group sees its own share of the data.
Why PyTorch's APIs and not Accelerate's plugins: Accelerate 1.16 cannot do FSDP on CPU (it silently
falls back to DDP, measured) and its TP needs a transformers model. fully_shard and parallelize_module
on a DeviceMesh of the accelerator's device type (gloo on CPU, NCCL on GPU) run inside the process
group Accelerate made: one code path.

Checks (each with a wrong variant, --wrong_variant, that fails it):
- matches_single_process  over the first --parity_steps steps (bf16: --parity_steps_bf16), the loss at every step and every
                          parameter after them equal a one-process run on the same global batches
                          (--loss_atol, --param_atol); same_data_on_every_rank (the forgotten
                          sampler) fails it. Why not over all steps: AdamW at this learning rate
                          amplifies float rounding (sums in another order) about 10x every few
                          steps (measured, README); equality is judged where it still means something;
- grad_norm_is_global     the norm clipping uses equals the one-process gradient norm at each of
                          those steps; local_grad_norm (each rank clips by its own shard) fails it;
- memory_per_rank         bytes of parameters, gradients and optimizer state each rank holds at rest,
                          and of parameters between forward and backward, equal the theory within
                          --memory_rtol; unwrapped_root (fully_shard on the blocks only) fails it;
- communication_volume    bytes all-reduced / all-gathered / reduce-scattered in one step's forward
                          and backward (the third: the first two carry one-time work), counted as
                          they pass the dispatcher (common/comm_counter.py),
                          equal the closed form of the strategy (expected_communication);
                          row_parallel_without_all_reduce (tp) fails it and parity; seed_per_rank
                          (every rank builds its own weights) fails parity under tp and fsdp_tp;
- loss_decreased          validation loss falls by at least --min_loss_drop;
- resume_restored_state   (resumed runs) the full state right after loading equals, by digest, the
                          state the checkpoint was saved from; resume_without_optimizer_state fails it,
                          and resume_without_data_position fails matches_single_process.
Checkpoints (--checkpoint_every N, --resume_from_checkpoint latest|PATH) are torch.distributed.checkpoint
(common/sharded_checkpoint.py) and the data position is in samples, so a checkpoint of any strategy on
N ranks continues under any strategy on M (the global batch follows M); the resumed run is compared with
one process started from the loaded state. python -m tools.convert_checkpoint makes one safetensors file.
At the end the main process prints a short sample of generated text (also in summary.json).

Run it (2 CPU ranks; the same commands on GPUs with accelerate_configs/multi_gpu_ddp.yaml):
    python experiments/train_gpt.py                                     # --strategy none, 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy ddp
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy zero2
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy fsdp
    torchrun --nproc_per_node 3 experiments/train_gpt.py --strategy fsdp --d_model 96   # 3 uneven shards
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy tp
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 4 experiments/train_gpt.py \
        --strategy fsdp_tp --dp_size 2 --tp_size 2      # 4 ranks on 2 cores: slow, but every check runs
Every strategy side by side (table + PNG): python -m benchmarks.compare_strategies
Where a step's time goes: --profile_steps 5 (torch.profiler traces per rank, common/profiling.py); against
this machine's peak, a cost model and bare PyTorch: python -m benchmarks.performance
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, init_device_mesh

from common.checkpoint import ResumableArgs, ShardedCheckpointer, load_full_optimizer_state
from common.comm_counter import WIRE_FACTOR, CollectiveCounter
from common.config import flag, parse_config, require, require_positive, run_cli
from common.data import iterate_sample_stream, require_memory
from common.gpt import GPT, GPTConfig, build_gpt, count_parameters, parameter_count, training_bytes
from common.profiling import StepProfiler, mean_breakdown, median_step, plot_timeline
from common.run import start_run
from common.runtime import launched_world_size
from common.sharding import shard_gpt, sync_gradients_this_micro_batch, tensor_parallelize_gpt, tp_split_dim
from common.text import load_corpus, shard_rows
from common.training import TrainLoop

EXPERIMENT = "train_gpt"
STRATEGIES = ("none", "ddp", "zero2", "fsdp", "tp", "fsdp_tp")
SHARDED = ("zero2", "fsdp", "fsdp_tp")  # FSDP2 shards the parameters across the data-parallel ranks
TENSOR_PARALLEL = ("tp", "fsdp_tp")
# Each deliberate mistake, and the strategies where it is a mistake (under tp every rank SHOULD see
# the same data; under ddp, prepare() broadcasts rank 0's weights, so seeding per rank is harmless).
WRONG_VARIANTS = {
    "": STRATEGIES,
    "same_data_on_every_rank": ("ddp", "zero2", "fsdp", "fsdp_tp"),
    "local_grad_norm": ("ddp", "zero2", "fsdp", "tp", "fsdp_tp"),
    "unwrapped_root": SHARDED,
    "row_parallel_without_all_reduce": TENSOR_PARALLEL,
    "seed_per_rank": ("zero2", "fsdp", "tp", "fsdp_tp"),
    # resuming (needs --resume_from_checkpoint): the parameters loaded but not AdamW's state; the data
    # stream restarted from its first sample instead of the checkpoint's position
    "resume_without_optimizer_state": STRATEGIES,
    "resume_without_data_position": STRATEGIES,
}


@dataclass
class Config(ResumableArgs):
    sweep_metrics = ("loss", "tokens_per_s", "val_loss")
    # Checkpoints are DCP (any strategy reads any other's) and the data position is in samples: a resume
    # may change the strategy and the world size (common/config.py RunArgs).
    reshardable = True
    layout_flags = ("strategy", "dp_size", "tp_size")
    # How close a check wants its figures; they change no result, so a resume may change them.
    tolerances = ("loss_atol", "param_atol", "grad_norm_rtol", "loss_atol_bf16", "param_atol_bf16", "grad_norm_rtol_bf16",
                  "memory_rtol")  # fmt: skip
    # --text_files is known by its content (the corpus's sha256 and its tokenizer's, in every checkpoint),
    # not by how its path is spelled
    result_neutral = (*ResumableArgs.result_neutral, *tolerances, "parity_steps", "parity_steps_bf16", "min_loss_drop",
                      "sample_tokens", "profile_steps", "text_files")  # fmt: skip

    strategy: str = flag(
        "none", "none (one process), ddp, zero2, fsdp, tp or fsdp_tp (see the docstring)", choices=STRATEGIES
    )
    dp_size: int = flag(0, "fsdp_tp: data-parallel groups (0: world size / --tp_size)")
    tp_size: int = flag(0, "tp, fsdp_tp: ranks per tensor-parallel group (0: tp every rank, fsdp_tp 2)")
    text_files: str = flag(
        "", "comma-separated text files to train on (default: CPython's pydoc topics, ~465k characters)"
    )
    vocab_size: int = flag(2048, "BPE vocabulary trained on the corpus")
    block_size: int = flag(64, "context length in tokens")
    n_layer: int = flag(4, "transformer blocks")
    n_head: int = flag(4, "attention heads (must divide d_model)")
    d_model: int = flag(128, "model width")
    tie_weights: bool = flag(True, "share the token embedding with the output head")
    val_fraction: float = flag(0.1, "share of the token stream held out for validation")
    per_rank_batch_size: int = flag(
        4, "blocks per rank per micro-batch; global batch = this x ranks x accumulation"
    )
    gradient_accumulation_steps: int = flag(1, "micro-batches per optimizer step (Accelerate's accumulate())")
    max_steps: int = flag(300, "optimizer steps")
    log_every: int = flag(25, "steps between console lines / metrics.jsonl records")
    lr: float = flag(3e-3, "peak AdamW learning rate")
    min_lr_ratio: float = flag(0.1, "the cosine schedule ends at lr x this")
    warmup_steps: int = flag(20, "linear warm-up steps")
    lr_decay_steps: int = flag(
        0,
        "steps over which the cosine decays to lr x min_lr_ratio, then stays there (nanoGPT's lr_decay_iters; "
        "0: --max_steps). A checkpoint records it: to train a resumed run longer, keep its value",
    )
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices (not on biases, norms)")
    grad_clip: float = flag(1.0, "clip gradients to this global norm (0: off)")
    mixed_precision: str = flag(
        "no",
        "no or bf16 (autocast for none/ddp; FSDP2's MixedPrecisionPolicy for zero2/fsdp)",
        choices=("no", "bf16"),
    )
    # Parity with one process, float32: measured ~1e-6 (loss) and ~1e-5 (parameters) over 15 steps. Why 15:
    # fsdp_tp rounds differently in every forward (split matmuls, partial sums all-reduced) and AdamW
    # amplifies it: its loss difference was <= 9.5e-07 up to step 18, then 4.3e-06 and 9.1e-06 at 19-20.
    parity_steps: int = flag(15, "float32: steps compared with the one-process run (0: none)")
    loss_atol: float = flag(1e-5, "float32: largest |distributed - one process| loss in those steps")
    param_atol: float = flag(1e-4, "float32: largest |distributed - one process| parameter after them")
    grad_norm_rtol: float = flag(
        1e-3, "float32: largest relative |clipping norm - one-process gradient norm|"
    )
    # bf16 rounds to ~3 digits, and the differences grow faster: measured ~1e-3 over 12 steps, 0.1 at step 19.
    parity_steps_bf16: int = flag(10, "bf16: steps compared with the one-process run (0: none)")
    loss_atol_bf16: float = flag(5e-3, "bf16: largest |distributed - one process| loss in those steps")
    param_atol_bf16: float = flag(1e-2, "bf16: largest |distributed - one process| parameter after them")
    grad_norm_rtol_bf16: float = flag(
        1e-2, "bf16: largest relative |clipping norm - one-process gradient norm|"
    )
    memory_rtol: float = flag(0.01, "allowed relative difference of bytes held per rank from the theory")
    min_loss_drop: float = flag(
        0.3,
        "validation loss must fall by more than this (nats) from the initialisation; a resumed run's must fall",
    )
    sample_tokens: int = flag(40, "tokens of text generated at the end (0: none)")
    profile_steps: int = flag(
        0,
        "torch.profiler traces this many steps (0: off) after the one-time work (the first 3 steps and the "
        "--parity_steps snapshot) and one warm-up step: <output_dir>/profile/rank<r>.json (open in "
        "ui.perfetto.dev), each step split into compute / communication / overlapped / idle, and "
        "profile/timeline.png",
    )
    wrong_variant: str = flag(
        "",
        "a deliberate mistake that a check must catch: " + ", ".join(list(WRONG_VARIANTS)[1:]),
        choices=tuple(WRONG_VARIANTS),
    )

    def validate(self) -> None:
        super().validate()
        require_positive(
            self,
            "vocab_size",
            "block_size",
            "n_layer",
            "n_head",
            "d_model",
            "per_rank_batch_size",
            "gradient_accumulation_steps",
            "lr",
            *self.tolerances,
        )
        require(
            self.d_model % self.n_head == 0, f"--n_head {self.n_head} must divide --d_model {self.d_model}"
        )
        require(0 < self.val_fraction < 0.5, f"--val_fraction must be in (0, 0.5), got {self.val_fraction}")
        require(
            0 <= self.min_lr_ratio <= 1
            and self.warmup_steps >= 0
            and self.grad_clip >= 0
            and self.weight_decay >= 0,
            "--min_lr_ratio must be in [0, 1]; --warmup_steps, --grad_clip, --weight_decay >= 0",
        )
        require(
            self.vocab_size >= 260, f"--vocab_size must be >= 260 (256 bytes + merges), got {self.vocab_size}"
        )
        require(self.lr_decay_steps >= 0, f"--lr_decay_steps must be >= 0, got {self.lr_decay_steps}")
        # every process of this machine trains its own copy (or piece): refuse a model that cannot fit
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        model = GPTConfig(
            self.vocab_size, self.block_size, self.n_layer, self.n_head, self.d_model, self.tie_weights
        )
        require_memory(
            f"d_model {self.d_model} --n_layer {self.n_layer} --vocab_size {self.vocab_size} --block_size "
            f"{self.block_size} --per_rank_batch_size {self.per_rank_batch_size}",
            local_ranks * training_bytes(model, self.per_rank_batch_size),
            what=f"{local_ranks} process(es) training a {parameter_count(model):,}-parameter model",
        )
        world_size = launched_world_size(self)
        require(
            (self.strategy == "none") == (world_size == 1),
            f"--strategy {self.strategy} with {world_size} rank(s): 'none' is one process, the others need >= 2 ranks "
            "(accelerate_configs/cpu_ddp.yaml)",
        )
        dp_size, tp_size = self.mesh_shape(world_size)
        if self.strategy in TENSOR_PARALLEL:
            require(
                self.strategy == "fsdp_tp" or self.dp_size in (0, 1),
                f"--strategy tp puts all {world_size} ranks in one tensor-parallel group, got --dp_size {self.dp_size}; "
                "for data parallelism across groups use --strategy fsdp_tp",
            )
            require(
                dp_size * tp_size == world_size,
                f"--dp_size {dp_size} x --tp_size {tp_size} must equal the {world_size} ranks launched",
            )
            require(
                self.strategy == "tp" or (dp_size >= 2 and tp_size >= 2),
                f"--strategy fsdp_tp needs --dp_size >= 2 and --tp_size >= 2, got {dp_size} x {tp_size} "
                "(e.g. 4 ranks: 2 x 2)",
            )
            require(
                self.n_head % tp_size == 0,
                f"--n_head {self.n_head} is not divisible by the tensor-parallel degree {tp_size}: "
                "each rank must hold whole heads",
            )
            require(
                self.mixed_precision == "no",
                f"--mixed_precision {self.mixed_precision} with --strategy {self.strategy}: not built; use no",
            )
        else:
            require(
                not (self.dp_size or self.tp_size),
                f"--dp_size / --tp_size are for --strategy tp and fsdp_tp, not {self.strategy}",
            )
        require(
            not self.wrong_variant.startswith("resume_") or self.resume_from_checkpoint,
            f"--wrong_variant {self.wrong_variant} is a mistake made when resuming: add --resume_from_checkpoint",
        )
        require(
            self.strategy in WRONG_VARIANTS[self.wrong_variant],
            f"--wrong_variant {self.wrong_variant} is a mistake only under --strategy "
            f"{', '.join(WRONG_VARIANTS[self.wrong_variant])}, not {self.strategy}",
        )
        most = self.max_steps - self.steps_before_profiling() - 1
        require(
            self.profile_steps == 0 or 0 < self.profile_steps <= most,
            f"--profile_steps {self.profile_steps}: must be 0 (off) or 1..{most} with --max_steps {self.max_steps}: "
            f"profiling starts after {self.steps_before_profiling()} steps of one-time work (the first 3, the "
            "--parity_steps snapshot) and one warm-up step",
        )
        require(
            0 <= self.parity()["steps"] <= self.max_steps,
            f"--parity_steps{'_bf16' * (self.mixed_precision == 'bf16')} must be in [0, --max_steps], "
            f"got {self.parity()['steps']}",
        )

    def trajectory(self, world_size: int) -> dict:
        """As RunArgs', except that a mistake made only while resuming (resume_*) is not the checkpoint's,
        and the learning-rate schedule's length is the one it runs with (--lr_decay_steps 0 follows
        --max_steps: a resume that grows --max_steps would stretch the schedule mid-run, so it differs)."""
        trajectory = super().trajectory(world_size)
        if self.wrong_variant.startswith("resume_"):
            trajectory["wrong_variant"] = ""
        trajectory["lr_decay_steps"] = self.lr_decay_steps or self.max_steps
        return trajectory

    def resume_hint(self, difference: str) -> str:
        """Said after a refused resume's difference, where the fix is not obvious."""
        if difference.startswith("--lr_decay_steps"):
            return (" (the cosine schedule's length, which --max_steps sets while --lr_decay_steps is 0; to train "
                    f"longer on the checkpoint's schedule pass --lr_decay_steps {difference.split()[1]})")  # fmt: skip
        return ""

    def steps_before_profiling(self) -> int:
        """Steps with one-time work, left out of --profile_steps: the first 3 (after the evaluation FSDP2's
        root stays gathered; DDP rebuilds its buckets in the 2nd; the 3rd is counted) and the snapshot at
        --parity_steps, which gathers every parameter."""
        return max(3, self.parity()["steps"])

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(data-parallel size, tensor-parallel size). Data-parallel ranks see different data."""
        if self.strategy not in TENSOR_PARALLEL:
            return world_size, 1
        if self.strategy == "tp":
            tp_size = self.tp_size or world_size
        else:  # fsdp_tp: 2 ranks per TP group unless told otherwise
            tp_size = self.tp_size or (max(1, world_size // self.dp_size) if self.dp_size else 2)
        return self.dp_size or max(1, world_size // tp_size), tp_size

    def parity(self) -> dict:
        """How many steps are compared with one process, and within what, for this run's precision."""
        suffix = "_bf16" if self.mixed_precision == "bf16" else ""
        return {
            name: getattr(self, f"{flag_name}{suffix}")
            for name, flag_name in (
                ("steps", "parity_steps"),
                ("loss_atol", "loss_atol"),
                ("param_atol", "param_atol"),
                ("grad_norm_rtol", "grad_norm_rtol"),
            )
        }


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to --lr, then cosine down to lr x min_lr_ratio at --lr_decay_steps (default
    --max_steps), then flat (step counts from 1)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW as nanoGPT sets it up: weight decay on matrices and embeddings, none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def distribute(model: GPT, cfg: Config, accelerator) -> torch.nn.Module:
    """The strategy. none: one process. ddp: Accelerate's prepare. zero2/fsdp: FSDP2. tp: DTensor's
    tensor parallelism. fsdp_tp: TP on the mesh's "tp" dimension, then FSDP2 on its "dp" dimension
    (common/sharding.py)."""
    if cfg.strategy in ("none", "ddp"):
        return model.to(accelerator.device) if cfg.strategy == "none" else accelerator.prepare(model)
    dp_size, tp_size = cfg.mesh_shape(accelerator.num_processes)
    mesh = init_device_mesh(accelerator.device.type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    if cfg.strategy == "fsdp_tp":
        # FSDP2 warns that the root returns a view (the logits, cut out of TP's padded all-gather): only an
        # in-place change of that view would be wrong, and nothing here changes logits in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        # ...and DTensor logs that gathering a 2-D-sharded parameter (a full state) takes two all-gathers
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if cfg.strategy in TENSOR_PARALLEL:
        model = tensor_parallelize_gpt(
            model.to(accelerator.device),
            mesh["tp"],
            row_all_reduce=cfg.wrong_variant != "row_parallel_without_all_reduce",
        )
    if cfg.strategy not in SHARDED:
        return model
    return shard_gpt(
        model,
        accelerator,
        zero3=cfg.strategy != "zero2",
        bf16=cfg.mixed_precision == "bf16",
        wrap_root=cfg.wrong_variant != "unwrapped_root",
        mesh=mesh["dp"],
    )


def clip_by_global_norm(model: torch.nn.Module, max_norm: float, local_only: bool = False) -> float:
    """Clip to the norm of the WHOLE gradient. A DTensor gradient's squared sum is summed over the mesh
    dimensions it is split on (Shard) and counted once over those it is copied on (Replicate): under
    fsdp_tp a LayerNorm's gradient is split across "dp" but the same on every "tp" rank. Gradients are
    grouped by (mesh, which dimensions are split) so that each group costs one all-reduce per split
    dimension, not one per tensor. Plain tensors (DDP, one process) are the same on every rank and count once.
    `local_only` is the classic mistake: each rank clips by the norm of its own shard."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = (grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]).device
    squared_sums: dict = {}  # (mesh, split dims) -> this rank's sum of squares
    for grad in grads:
        # not is_replicate(), not is_shard(): FSDP2 over TP splits with _StridedShard, for which is_shard() is False
        split = tuple(not p.is_replicate() for p in grad.placements) if isinstance(grad, DTensor) else ()
        key = (grad.device_mesh, split) if isinstance(grad, DTensor) else None
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        squared_sums[key] = squared_sums.get(key, torch.zeros((), device=device)) + local.float().pow(2).sum()
    total = torch.zeros((), device=device)
    for key, squared_sum in squared_sums.items():
        if key is not None and not local_only:
            mesh, split = key
            for dim in (dim for dim, is_split in enumerate(split) if is_split):
                dist.all_reduce(squared_sum, group=mesh.get_group(dim))
        total += squared_sum
    norm = total.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
    return norm.item()


def bytes_held(model: torch.nn.Module, optimizer=None) -> dict:
    """Bytes this rank really holds (a DTensor's local shard, not its global size)."""

    def local(tensor) -> int:
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return tensor.numel() * tensor.element_size()

    unique = {id(p): p for p in model.parameters()}.values()
    held = {
        "params": sum(local(p) for p in unique),
        "grads": sum(local(p.grad) for p in unique if p.grad is not None),
    }
    if optimizer is not None:
        held["optimizer"] = sum(
            local(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )
    return held


def chunk_rows(rows: int, parts: int, index: int) -> int:
    """How many of `rows` rows torch.chunk gives part `index` of `parts` (DTensor and FSDP2 split so)."""
    chunks = torch.chunk(torch.empty(rows, device="meta"), parts)
    return chunks[index].shape[0] if index < len(chunks) else 0


def local_shape(name: str, shape, cfg: Config, rank: int, world_size: int, fsdp: bool) -> list[int]:
    """The shape of the piece of parameter `name` that rank `rank` holds: first TP's split
    (tensor_parallelize_gpt's plan; ranks tp-major within a group), then, if `fsdp`, FSDP2's split of
    dim 0 across the data-parallel ranks (on top of TP's piece: torch.chunk of a chunk)."""
    dp_size, tp_size = cfg.mesh_shape(world_size)
    dp_rank, tp_rank = divmod(rank, tp_size)
    shape = list(shape)
    split = tp_split_dim(name) if cfg.strategy in TENSOR_PARALLEL else None
    if split is not None:
        shape[split] = chunk_rows(shape[split], tp_size, tp_rank)
    if fsdp:
        shape[0] = chunk_rows(shape[0], dp_size, dp_rank)
    return shape


def expected_bytes(reference: GPT, cfg: Config, rank: int, world_size: int) -> dict:
    """The theory, per rank: each parameter's piece (local_shape) at rest; gradients the same.
    AdamW keeps exp_avg and exp_avg_sq shaped like the parameter, plus a 4-byte step count per tensor.
    Between forward and backward: DDP, TP and ZeRO-2 hold every parameter of their (TP) piece; ZeRO-3
    (fsdp, fsdp_tp) holds the blocks' shards and the root's parameters gathered (FSDP2 does not reshard
    the root after forward: its backward comes at once). Under bf16, FSDP2 gathers parameters as bf16
    copies (2 bytes); DDP's autocast keeps float32 parameters and casts per operation."""
    unique = {id(p): (name, p) for name, p in reference.named_parameters()}.values()
    sharded = cfg.strategy in SHARDED
    gathered_bytes = 2 if sharded and cfg.mixed_precision == "bf16" else 4
    params = window = 0
    for name, param in unique:
        at_rest = math.prod(local_shape(name, param.shape, cfg, rank, world_size, fsdp=sharded))
        gathered = math.prod(local_shape(name, param.shape, cfg, rank, world_size, fsdp=False))
        params += at_rest * param.element_size()
        stays_sharded = cfg.strategy in ("fsdp", "fsdp_tp") and name.startswith("blocks.")
        window += at_rest * param.element_size() if stays_sharded else gathered * gathered_bytes
    return {
        "params": params,
        "grads": params,
        "optimizer": 2 * params + 4 * len(unique),
        "params_between_forward_and_backward": window,
    }


def expected_communication(reference: GPT, cfg: Config, world_size: int) -> dict:
    """Bytes per rank in one optimizer step's forwards and backwards, by the group that sends them and
    by collective, as common/comm_counter.py measures them (the full tensor's size).
    k = --gradient_accumulation_steps:
      ddp      all_reduce      every gradient once per step (no_sync on the first k-1 micro-batches);
      zero2    all_gather      every parameter, per micro-batch, before forward (kept for backward);
               reduce_scatter  every gradient once per step, in float32;
      fsdp     all_gather      every parameter before forward + the blocks' again before backward
                               (the root is not resharded in between), per micro-batch;
               reduce_scatter  every gradient once per step;
      tp       all_reduce      activations (batch x context x d_model), per micro-batch: the embedding's
                               output, 2 per block in forward and 2 in backward, the head's input
                               gradient: 4 x n_layer + 2 of them;
               all_gather      the logits (batch x context x vocab), per micro-batch;
      fsdp_tp  tp's, on each TP group's batch, plus fsdp's, on each TP rank's piece of the parameters.
    FSDP2 gathers into one buffer padded so that dim 0 divides the data-parallel size (uneven shards);
    DTensor pads the vocabulary to a multiple of the TP size to all-gather it."""
    dp_size, tp_size = cfg.mesh_shape(world_size)
    k = cfg.gradient_accumulation_steps
    unique = {id(p): (name, p) for name, p in reference.named_parameters()}.values()
    data_parallel = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    tensor_parallel = {"all_reduce": 0, "all_gather": 0}
    if cfg.strategy == "ddp":
        data_parallel["all_reduce"] = sum(p.numel() * 4 for _, p in unique)
    if cfg.strategy in SHARDED:
        gathered_bytes = 2 if cfg.mixed_precision == "bf16" else 4
        for name, param in unique:
            shape = local_shape(name, param.shape, cfg, 0, world_size, fsdp=False)  # rank 0's TP piece
            padded = math.ceil(shape[0] / dp_size) * dp_size * math.prod(shape[1:])
            gathers = 2 if cfg.strategy != "zero2" and name.startswith("blocks.") else 1
            data_parallel["all_gather"] += k * gathers * padded * gathered_bytes
            data_parallel["reduce_scatter"] += padded * 4
    if cfg.strategy in TENSOR_PARALLEL:
        tokens = cfg.per_rank_batch_size * cfg.block_size
        padded_vocab = math.ceil(reference.cfg.vocab_size / tp_size) * tp_size
        tensor_parallel["all_reduce"] = k * (4 * cfg.n_layer + 2) * tokens * cfg.d_model * 4
        tensor_parallel["all_gather"] = k * tokens * padded_vocab * 4
    by_kind = {kind: data_parallel[kind] + tensor_parallel.get(kind, 0) for kind in data_parallel}
    wire = sum(WIRE_FACTOR[kind](dp_size) * size for kind, size in data_parallel.items() if dp_size > 1)
    wire += sum(WIRE_FACTOR[kind](tp_size) * size for kind, size in tensor_parallel.items() if tp_size > 1)
    return {
        "by_kind": by_kind,
        "data_parallel": data_parallel,
        "tensor_parallel": tensor_parallel,
        "wire_bytes": wire,
    }


def evaluate(
    model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor], batch_size: int, accelerator
) -> float:
    """Mean validation loss over every rank's shard (the shards are equal, so every rank runs the same
    number of forwards: FSDP all-gathers in each)."""
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for start in range(0, len(shard[0]), batch_size):
            x, y = (t[start : start + batch_size].to(accelerator.device) for t in shard)
            _, loss = model(x, y)
            total += torch.stack(
                [loss.double() * y.numel(), torch.tensor(float(y.numel()), dtype=torch.float64)]
            )
    total = accelerator.reduce(total, "sum")
    return (total[0] / total[1]).item()


def train_reference(
    cfg: Config,
    gpt_cfg: GPTConfig,
    start_state: tuple,
    start_step: int,
    steps: int,
    global_batches,
    accelerator,
) -> dict:
    """The same training in ONE process, for `steps` steps after `start_step`: each step one batch holding
    every rank's micro-batches (the global batch), one mean loss over all its tokens, the same AdamW,
    schedule and clipping. `start_state`: (model state, optimizer state by parameter name or None)."""
    model_state, optimizer_state = start_state
    model = GPT(gpt_cfg).to(accelerator.device)
    model.load_state_dict(model_state)
    optimizer = make_optimizer(model, cfg)
    if optimizer_state:  # a resumed run: AdamW's moments and step counts as loaded
        load_full_optimizer_state(optimizer, model, optimizer_state)
    losses, norms = [], []
    for step in range(start_step + 1, start_step + steps + 1):
        micro_batches = [next(global_batches) for _ in range(cfg.gradient_accumulation_steps)]
        x, y = (torch.cat(parts).to(accelerator.device) for parts in zip(*micro_batches, strict=True))
        with torch.autocast(
            accelerator.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16"
        ):
            _, loss = model(x, y)
        loss.backward()
        norms.append(clip_by_global_norm(model, cfg.grad_clip))
        set_lr(optimizer, lr_at(step, cfg))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {"losses": losses, "grad_norms": norms, "state": state}


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def run(cfg: Config) -> int:
    precision = cfg.mixed_precision if cfg.strategy in ("none", "ddp") else "no"  # zero2/fsdp: FSDP2's policy
    # The corpus first, before the run starts: its content hashes tie every checkpoint to this data (a
    # resume on other text is refused before anything is written). The token cache is built once, under
    # a file lock, while other ranks wait.
    corpus = load_corpus(cfg.text_files, cfg.vocab_size, cfg.block_size, cfg.val_fraction, cfg.dist_timeout_s)
    with start_run(
        cfg,
        EXPERIMENT,
        data_identity=corpus["identity"],
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=precision,
    ) as run:
        accelerator = run.accelerator
        rank, world_size = accelerator.process_index, accelerator.num_processes
        dp_size, tp_size = cfg.mesh_shape(world_size)
        dp_rank = rank // tp_size  # the ranks of one tensor-parallel group see the same data
        gpt_cfg = GPTConfig(
            corpus["vocab_size"], cfg.block_size, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.tie_weights
        )
        # One stream of samples for the whole run; each data-parallel rank takes its rows of every global
        # micro-batch. The position is in samples (checkpointed as samples_seen): a resume at another world
        # size, whose global batch differs, continues at the same place in the data.
        start_sample = run.samples_seen
        if cfg.wrong_variant == "resume_without_data_position":
            start_sample = 0  # the mistake: the resumed run sees the first samples again
        data_rank = 0 if cfg.wrong_variant == "same_data_on_every_rank" else dp_rank  # the forgotten sampler
        global_rows = cfg.per_rank_batch_size * dp_size
        stream = iterate_sample_stream(*corpus["train"], global_rows, cfg.seed, start_sample)
        batches = (shard_rows(batch, data_rank, dp_size) for batch in stream)
        val_shard = shard_rows(corpus["val"], dp_rank, dp_size)

        # The same initial weights on every rank and in the reference (unless seed_per_rank: the mistake)
        model = build_gpt(gpt_cfg, cfg.seed + rank * (cfg.wrong_variant == "seed_per_rank"))
        initial_state = copy.deepcopy(model.state_dict())
        n_parameters = count_parameters(model)
        model = distribute(model, cfg, accelerator)
        optimizer = accelerator.prepare(make_optimizer(model, cfg))  # steps only on a step's last micro-batch

        # The idea: each data-parallel rank trains on its own shard of the data; the strategy decides who
        # holds what. 4 blocks per rank x 2 data-parallel ranks = 8 samples (of 64 tokens) per micro-batch.
        # Checkpoints (--checkpoint_every) in torch.distributed.checkpoint's sharded format, readable by any
        # strategy at any world size (common/checkpoint.py); resuming loads one here, and proves it.
        checkpointer = ShardedCheckpointer(
            model, optimizer, restore_optimizer=cfg.wrong_variant != "resume_without_optimizer_state"
        )
        loop = TrainLoop(
            run,
            model,
            optimizer,
            samples_per_micro_batch=global_rows,
            checkpointer=checkpointer,
            tokens_per_sample=cfg.block_size,
        )
        # the one-process reference starts from the state just loaded (gathered whole to verify it)
        resumed_state = loop.resumed_full_state
        val_loss_before = evaluate(model, val_shard, cfg.per_rank_batch_size, accelerator)  # after any load
        run.print(
            f"{n_parameters:,} parameters, {corpus['tokens']:,} tokens of {corpus['name']}, {cfg.strategy} "
            f"on {world_size} rank(s) ({dp_size} data-parallel x {tp_size} tensor-parallel), "
            f"validation loss {val_loss_before:.3f}"
        )
        if run.checkpoint:
            saved = run.checkpoint_meta
            run.print(
                f"continuing from {saved['layout'].get('strategy', '?')} on {saved['world_size']} "
                f"rank(s) at step {run.start_step}, sample {start_sample:,} of the stream, with {cfg.strategy} on "
                f"{world_size} rank(s): {global_rows} blocks per global micro-batch"
            )
        # bytes held, per-step loss and grad norm, the state at --parity_steps, time per phase, and the
        # collectives of one step
        # (the third step, in steady state: the first follows the evaluation, whose forward without backward
        # leaves FSDP2's root gathered; in the second DDP rebuilds its buckets, broadcasting rank 0's order)
        probe = Probe(
            cfg, accelerator, checkpointer, run.start_step, count_step=min(run.start_step + 3, cfg.max_steps)
        )
        # --profile_steps: a trace per rank of steady-state steps (common/profiling.py)
        profiler = StepProfiler(
            cfg.profile_steps,
            os.path.join(run.output_dir, "profile"),
            rank,
            accelerator.device.type,
            skip=cfg.steps_before_profiling(),
        )
        with profiler:
            for x, y in loop.micro_batches(batches):
                step = loop.step + 1
                # Accelerate's accumulate(): DDP's no_sync and loss / k on all but the last micro-batch of a step
                with accelerator.accumulate(model):
                    sync_gradients_this_micro_batch(model, accelerator.sync_gradients)  # FSDP2's no_sync
                    with probe.watch("forward", step):
                        _, loss = model(x, y)
                    probe.after_forward(model)
                    with probe.watch("backward", step):
                        accelerator.backward(loss)
                    with probe.watch("optimizer", step):
                        if accelerator.sync_gradients:
                            probe.grad_norms.append(
                                clip_by_global_norm(
                                    model, cfg.grad_clip, cfg.wrong_variant == "local_grad_norm"
                                )
                            )
                            set_lr(optimizer, lr_at(step, cfg))
                        optimizer.step()
                    probe.after_step(model, optimizer, loss, step)
                    optimizer.zero_grad()
                loop.record(loss, **probe.latest(optimizer))
                if accelerator.sync_gradients:
                    profiler.step()
        if cfg.profile_steps:
            report_profile(run, cfg, profiler.breakdown(), steps_trained=loop.step - run.start_step)

        val_loss = evaluate(model, val_shard, cfg.per_rank_batch_size, accelerator)
        step_losses = accelerator.reduce(
            torch.stack(probe.step_losses), "mean"
        ).tolist()  # each step's global loss
        # the final state digest gathers every tensor whole (a collective); the sample reuses those weights
        final_state = checkpointer.full_state()  # every tensor whole, on the main process (a collective)
        loop_metrics = loop.metrics(final_state)
        trained = final_state[0]
        every_rank = accelerator.gather_for_metrics(
            [probe.held | {"peak_rss_bytes": peak_rss_bytes()}], use_gather_object=True
        )
        corpus_facts = {
            k: corpus[k]
            for k in ("name", "sha256", "characters", "tokens", "characters_per_token", "vocab_size")
        }
        run.metrics.update(
            loop_metrics,
            val_loss_before=val_loss_before,
            val_loss=val_loss,
            step_losses=step_losses,
            grad_norms=probe.grad_norms,
            bytes_per_rank=every_rank,
            step_time_ms=probe.median_step_time_ms(),
            dp_size=dp_size,
            tp_size=tp_size,
            parameters=n_parameters,
            corpus=corpus_facts,
        )
        # from where THIS run started: the random initialisation, or the state it resumed (which has
        # learned already, so a resumed run need only keep learning)
        min_drop = cfg.min_loss_drop if not run.checkpoint else 0.0
        run.check(
            "loss_decreased",
            val_loss < val_loss_before - min_drop,
            f"validation loss {val_loss_before:.3f} -> {val_loss:.3f} (from "
            f"{'the loaded checkpoint' if run.checkpoint else 'the initialisation'}), must fall by more than {min_drop}",
        )
        if run.is_main:
            check_memory(run, cfg, build_gpt(gpt_cfg, cfg.seed), every_rank)
            check_communication(run, cfg, build_gpt(gpt_cfg, cfg.seed), probe.collectives)
            if cfg.strategy != "none" and probe.at_parity_step is not None:
                # the reference replays the same global batches, from where the data stream really was
                global_batches = iterate_sample_stream(
                    *corpus["train"], global_rows, cfg.seed, run.samples_seen
                )
                start_state = resumed_state or (initial_state, None)
                compare_with_one_process(run, cfg, gpt_cfg, start_state, global_batches, probe, step_losses)
            run.metrics["sample"] = generate_sample(cfg, gpt_cfg, trained, corpus, accelerator.device)
            run.print(f"sample: {run.metrics['sample']!r}")
        run.log(loop.step, {**loop.last_interval, "val_loss": val_loss})
    return run.exit_code


def report_profile(run, cfg: Config, rows: list[dict], steps_trained: int) -> None:
    """Every rank's profiled steps: the mean breakdown per rank in the metrics, a timeline PNG."""
    every_rank = run.accelerator.gather_for_metrics([rows], use_gather_object=True)
    if not all(every_rank):  # a resumed run may train fewer steps than profiling starts after
        run.print(f"--profile_steps {cfg.profile_steps}: nothing profiled, this run trained {steps_trained} "
                  f"steps; profiling starts after {cfg.steps_before_profiling()} + 1 warm-up")  # fmt: skip
        return
    if not run.is_main:
        return
    means = [mean_breakdown(rows) for rows in every_rank]
    run.metrics["step_breakdown_ms"] = means
    timeline = os.path.join(run.output_dir, "profile", "timeline.png")
    ranks_steps = [(f"rank {rank}", median_step(rows)) for rank, rows in enumerate(every_rank)]
    plot_timeline(
        ranks_steps,
        f"{cfg.strategy} on {len(every_rank)} rank(s): each rank's median profiled step",
        timeline,
    )
    run.log_table("step_breakdown", [{"rank": r, **m} for r, m in enumerate(means)], timeline)
    run.print(
        f"profiled steps, rank 0, mean of {len(every_rank[0])} (ms): "
        + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in means[0].items())
        + f"; traces and timeline.png in {os.path.dirname(timeline)}"
    )


class Probe:
    """What the checks need from inside the loop, one call per place: the bytes this rank holds between
    forward and backward and at rest (first step), each step's loss and gradient norm, and the full
    state right after step --parity_steps (a collective for sharded models: every rank takes it), the
    seconds spent in forward / backward / optimizer per step, and the collectives (common/comm_counter.py)
    of step `count_step`'s forwards and backwards."""

    def __init__(self, cfg: Config, accelerator, checkpointer, start_step: int, count_step: int):
        self.cfg, self.accelerator, self.count_step = cfg, accelerator, count_step
        self.checkpointer = checkpointer  # its full_state() gathers every parameter whole
        self.parity_steps = min(cfg.parity()["steps"], cfg.max_steps - start_step)  # a resume may have fewer
        self.parity_step = start_step + self.parity_steps
        self.held: dict = {}
        self.step_losses, self.grad_norms, self.at_parity_step = [], [], None
        self.step_loss = torch.zeros((), device=accelerator.device)
        self.collectives = {"calls": {}, "bytes": {}}
        self.phase_s: dict[str, float] = {}  # this step's seconds per phase, over its micro-batches
        self.step_times: list[dict] = []

    @contextlib.contextmanager
    def watch(self, phase: str, step: int):
        """Time a phase; in forward and backward of step count_step, also count its collectives."""
        counter = CollectiveCounter() if step == self.count_step and phase != "optimizer" else None
        started = time.perf_counter()
        with counter or contextlib.nullcontext():
            yield
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - started
        if counter:
            for kind in counter.calls:
                self.collectives["calls"][kind] = self.collectives["calls"].get(kind, 0) + counter.calls[kind]
                self.collectives["bytes"][kind] = self.collectives["bytes"].get(kind, 0) + counter.bytes[kind]

    def median_step_time_ms(self) -> dict:
        """Median milliseconds per optimizer step in each phase, the first step (warm-up) left out."""
        steps = self.step_times[1:] or self.step_times
        return {
            phase: 1000 * statistics.median(t[phase] for t in steps) for phase in (steps[0] if steps else {})
        }

    def latest(self, optimizer) -> dict:
        """The learning rate and gradient norm of the last optimizer step, for the logged interval."""
        return (
            {"lr": optimizer.param_groups[0]["lr"], "grad_norm": self.grad_norms[-1]}
            if self.grad_norms
            else {}
        )

    def after_forward(self, model) -> None:
        if not self.held:
            self.held["params_between_forward_and_backward"] = bytes_held(model)["params"]

    def after_step(self, model, optimizer, loss: torch.Tensor, step: int) -> None:
        self.step_loss += loss.detach() / self.cfg.gradient_accumulation_steps
        if not self.accelerator.sync_gradients:
            return
        if "params" not in self.held:
            self.held.update(bytes_held(model, optimizer))
        self.step_losses.append(self.step_loss.clone())
        self.step_loss.zero_()
        self.step_times.append(self.phase_s)
        self.phase_s = {}
        if self.parity_steps and step == self.parity_step:
            self.at_parity_step = self.checkpointer.full_state()[0]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def check_memory(run, cfg: Config, reference: GPT, every_rank: list[dict]) -> None:
    """Each rank's held bytes against expected_bytes, within --memory_rtol."""
    theories = [expected_bytes(reference, cfg, rank, len(every_rank)) for rank in range(len(every_rank))]
    worst = max(
        abs(held[kind] - theory[kind]) / theory[kind]
        for held, theory in zip(every_rank, theories, strict=True)
        for kind in theory
    )
    lines = [
        f"rank {rank}: " + ", ".join(f"{kind} {held[kind]:,}/{theory[kind]:,}" for kind in theory)
        for rank, (held, theory) in enumerate(zip(every_rank, theories, strict=True))
    ]
    run.metrics["bytes_theory"] = theories
    run.check(
        "memory_per_rank",
        worst <= cfg.memory_rtol,
        f"held/theory bytes: {'; '.join(lines)}; worst relative "
        f"difference {worst:.4f}, tolerance {cfg.memory_rtol}",
    )


def check_communication(run, cfg: Config, reference: GPT, counted: dict) -> None:
    """The main process's counted collectives of one step against expected_communication, to the byte
    (the main process stands for every rank: each sends the same amount, in every strategy here)."""
    if cfg.strategy == "none":
        return
    world_size = run.accelerator.num_processes
    theory = expected_communication(reference, cfg, world_size)
    expected = theory["by_kind"]
    kinds = [
        kind for kind in {**expected, **counted["bytes"]} if expected.get(kind) or counted["bytes"].get(kind)
    ]
    run.metrics["communication"] = {"counted": counted, "theory": theory}
    run.check(
        "communication_volume",
        all(counted["bytes"].get(kind, 0) == expected.get(kind, 0) for kind in kinds),
        "bytes per step, counted/theory: "
        + ", ".join(
            f"{kind} {counted['bytes'].get(kind, 0):,}/{expected.get(kind, 0):,} "
            f"({counted['calls'].get(kind, 0)} calls)"
            for kind in kinds
        )
        + f"; {theory['wire_bytes']:,.0f} bytes on the wire per rank",
    )


def compare_with_one_process(run, cfg, gpt_cfg, start_state, global_batches, probe, step_losses) -> None:
    """This run's first --parity_steps steps (from its start, or from the checkpoint it resumed) against
    the same steps in one process, from the same state and on the same global batches."""
    budget = cfg.parity()
    n = probe.parity_steps
    reference = train_reference(cfg, gpt_cfg, start_state, run.start_step, n, global_batches, run.accelerator)
    grad_norms, at_parity_step = probe.grad_norms, probe.at_parity_step
    loss_diff = max(abs(a - b) for a, b in zip(step_losses[:n], reference["losses"], strict=True))
    norm_diff = max(
        abs(a - b) / max(b, 1e-12) for a, b in zip(grad_norms[:n], reference["grad_norms"], strict=True)
    )
    param_diff = max(
        (at_parity_step[k].float() - reference["state"][k].float()).abs().max().item()
        for k in reference["state"]
    )
    run.metrics.update(
        loss_max_abs_diff=loss_diff,
        grad_norm_max_rel_diff=norm_diff,
        param_max_abs_diff=param_diff,
        reference_losses=reference["losses"],
    )
    run.parity_check(
        "matches_single_process",
        max(loss_diff / budget["loss_atol"], param_diff / budget["param_atol"]),
        1.0,
        f"over the {n} steps after step {run.start_step}: max |loss - one process| {loss_diff:.2e} "
        f"(tolerance {budget['loss_atol']:.0e}), "
        f"max |parameter - one process| after them {param_diff:.2e} (tolerance {budget['param_atol']:.0e}); "
        "the larger share of its tolerance",
    )
    run.parity_check(
        "grad_norm_is_global",
        norm_diff,
        budget["grad_norm_rtol"],
        f"max relative |norm clipped by - one process's gradient norm| over the {n} steps after step {run.start_step}",
    )


def generate_sample(cfg: Config, gpt_cfg: GPTConfig, state: dict, corpus: dict, device) -> str:
    """A few tokens from the trained model, prompted with the start of the validation text."""
    if not cfg.sample_tokens:
        return ""
    model = GPT(gpt_cfg).to(device)
    model.load_state_dict(state)
    prompt = corpus["val"][0][0][:8].unsqueeze(0).to(device)
    tokens = model.generate(
        prompt, cfg.sample_tokens, generator=torch.Generator(device=device).manual_seed(cfg.seed)
    )
    return corpus["tokenizer"].decode(tokens[0].tolist())


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
