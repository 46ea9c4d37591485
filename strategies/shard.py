"""dp_shard: fully sharded data parallelism with PyTorch's FSDP2 (`fully_shard`), ZeRO-3 or ZeRO-2 by one
flag. Every parameter, its gradient and its AdamW state are split over the sharding ranks (dim 0,
torch.chunk's split; under tensor parallelism, dim 0 of each rank's TP piece): each holds 1/N at rest and
each rank's AdamW updates only its shard. Gradients are reduce-scattered: each rank keeps the mean of its
own shard. The sharding ranks are --dp_shard x --cp (the context-parallel ranks saw their own tokens of the
same samples: their gradients are averaged too, as torchtitan's "dp_shard_cp"); with --dp_replicate as well,
each shard is also all-reduced over the replicas (HSDP: FSDP2 on a 2-D mesh).

--reshard_after_forward (torchtitan's fsdp_reshard_after_forward):
  default  ZeRO-3: each block is a unit, all-gathered just before its forward, freed right after, gathered
           again for its backward; the root (embeddings, final norm, head) is gathered once and kept for the
           backward that starts at once (FSDP2's default for the root). Under a pipeline: as never (else every
           micro-batch would gather every block twice, in an order the schedule decides; torchtitan's rule).
  never    ZeRO-2: the whole model (or stage) is ONE unit, gathered once per micro-batch and kept until its
           backward ends; its gradients reduce-scattered once. Per-block units would free nothing (every
           block stays gathered until backward ends) and would buy only overlap, which FSDP2 gets from CUDA
           streams: on CPU each collective runs where it is issued, so each unit adds one to the step's
           critical path (measured: per-block units 0.55-0.59 of ddp's tokens/s, one unit 0.74-0.81;
           benchmarks/sharding_step.py, docs/performance.md). DeepSpeed's ZeRO-2 does the same for a model
           this size: its gradient buckets hold the whole model.
  always   as default, and the root resharded after forward too (gathered again for backward).

Why PyTorch's API and not Accelerate's plugin: Accelerate 1.16 silently runs DDP instead of FSDP on CPU (measured:
tests/test_runtime.py records it); `fully_shard` on a DeviceMesh of the accelerator's device type runs over gloo on
CPU and NCCL on GPU, inside the process group Accelerate made: one code path.

Theory per rank, N = dp_shard x cp sharding ranks: at rest each parameter's dim-0 chunk (of its TP piece),
its gradient the same, AdamW's two moments the same plus a step per tensor; between forward and backward the
units not resharded are held gathered (bf16: 2-byte copies). Per step, k micro-batches: every parameter
all-gathered k times (ZeRO-3's blocks 2k), every gradient reduce-scattered once (float32), each into FSDP2's
buffer whose dim 0 is padded to a multiple of N; HSDP all-reduces each rank's gradient shard once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from common.config import flag, require
from strategies.layout import Layout, Mistake, Traffic, Workload, chunk_rows, padded_numel, submesh
from strategies.piece import Context, HooksTheStep, Piece, Plan, SplitsParameters, Theory

RESHARD = ("default", "never", "always")


def _is_on(plan) -> bool:
    """Wherever FSDP runs (dp_shard, or cp sharded with it), DeepSpeed's engine aside."""
    return plan.engine_stage is None and bool(plan.layout.shard_dims)


MISTAKES = {  # each: what it is, and the runs under which it is one
    "unwrapped_root": Mistake(
        "fully_shard on the blocks only: the root's embeddings and head neither sharded nor synchronized",
        _is_on,
    ),
}


@dataclass
class Flags:
    dp_shard: int = flag(0, "fully sharded data-parallel degree (FSDP2): ranks that each hold 1/N of parameters, "
                         "gradients and AdamW state and read their own data (0, 1: off)")  # fmt: skip
    reshard_after_forward: str = flag("default", "with --dp_shard: default = ZeRO-3 (blocks gathered for forward, freed, "
                                      "gathered again for backward; under --pp as never), never = ZeRO-2 (the "
                                      "model one unit, gathered once), always = ZeRO-3 with the root resharded "
                                      "too", choices=RESHARD)  # fmt: skip


def refuse(plan: Plan) -> None:
    args, layout = plan.args, plan.layout
    require(layout.dp_shard > 1 or args.reshard_after_forward == "default",
            f"--reshard_after_forward {args.reshard_after_forward} is for sharded data parallelism: add "
            "--dp_shard N")  # fmt: skip
    require(not (layout.pp > 1 and args.reshard_after_forward == "always"),
            "--reshard_after_forward always with --pp: not built (each micro-batch would gather the stage again, "
            "in the schedule's order); use default or never")  # fmt: skip


def zero3(args, layout: Layout) -> bool:
    """Whether the blocks are units of their own, resharded after their forward."""
    return args.reshard_after_forward == "always" or (
        args.reshard_after_forward == "default" and layout.pp == 1
    )


def apply(
    model: torch.nn.Module,
    mesh,
    args,
    layout: Layout,
    work: Workload,
    ignored: set | None = None,
    exact: bool = False,
) -> None:
    """fully_shard each block (ZeRO-3), then the root, over `mesh` (1-D: FSDP; 2-D replicate x shard: HSDP).
    bf16: parameters gathered as bf16 copies, gradients reduced in float32. unwrapped_root is the classic
    mistake of sharding the blocks only. `ignored`: parameters another piece splits (ep's experts). `exact`
    (the Job's exact accumulation): gradients reduce-scattered in float64 and summed, not averaged (the loss is
    already divided by the whole batch), so each shard is float32(the float64 sum of the ranks' gradients)."""
    param_dtype = torch.bfloat16 if work.mixed_precision == "bf16" else None
    reduce_dtype = torch.float64 if exact else (torch.float32 if param_dtype else None)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks_apart, wrap_root = zero3(args, layout), args.wrong_variant != "unwrapped_root"
    # ZeRO-2 as one unit is a CPU choice (nothing overlaps there, and one all-gather pays gloo's latency once);
    # on a GPU each block is a unit of its own, gathered once and kept, so its all-gather overlaps the block
    # before it on FSDP2's streams: the same bytes either way
    zero2_per_block = args.reshard_after_forward == "never" and mesh.device_type != "cpu"
    if blocks_apart or not wrap_root or zero2_per_block:
        for block in model.blocks.values():
            fully_shard(
                block, mesh=mesh, reshard_after_forward=blocks_apart, mp_policy=policy, ignored_params=ignored
            )
    if wrap_root:
        # None: FSDP2's default for the root, which keeps its parameters for the backward that starts at once
        root_reshards = True if args.reshard_after_forward == "always" else (None if blocks_apart else False)
        fully_shard(
            model, mesh=mesh, reshard_after_forward=root_reshards, mp_policy=policy, ignored_params=ignored
        )
    if exact:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2's no_sync (also its replicate's): reduce gradients only on the last micro-batch of a step (DDP's
    no_sync comes with Accelerate's accumulate()). A no-op for a model without FSDP modules."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered copy. After an evaluation (forwards, no backward) FSDP2 keeps the root gathered (it
    reshards the root only after backward), so the next step would skip the root's all-gather its theory counts
    and hold a whole root between evaluation and training. A no-op for a model without FSDP modules."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# ------------------------------------------------------------------------------------------------ theory
def shard_index(layout: Layout, rank: int) -> int:
    """The rank's place among the sharding ranks (dp_shard outer, cp inner: the flattened mesh's order)."""
    index = 0
    for dim in layout.shard_dims:
        index = index * getattr(layout, dim) + layout.coordinate(rank, dim)
    return index


def local_shape(shape, layout: Layout, rank: int) -> list[int]:
    """The shard of a tensor of `shape` (a rank's TP piece) this rank holds at rest."""
    shape = list(shape)
    if layout.shard_dims:
        shape[0] = chunk_rows(shape[0], layout.size(layout.shard_dims), shard_index(layout, rank))
    return shape


def gathered_between_forward_and_backward(name: str, args, layout: Layout) -> bool:
    """Whether parameter `name` is held gathered between forward and backward."""
    if not layout.shard_dims:
        return True
    if name.startswith("blocks."):
        return not zero3(args, layout)
    return args.reshard_after_forward != "always"


def sent(t: Theory) -> list[Traffic]:
    """One step's bytes for the parameters this rank holds but those a piece splits itself (ep's experts)."""
    layout, args, work, pieces = t.layout, t.args, t.work, t.unclaimed
    n, k = layout.size(layout.shard_dims), work.micro_batches
    gathered_bytes = 2 if work.mixed_precision == "bf16" else 4
    # exact accumulation: each micro-batch's gradient reduce-scattered on its own, in float64
    reductions, reduced_bytes = (k, 8) if "exact_accumulation" in t.plan.traits else (1, 4)
    gathered = reduced = shard = 0
    for name, shape in pieces:
        padded = padded_numel(shape, n)
        gathers = 1 + (not gathered_between_forward_and_backward(name, args, layout))
        gathered += k * gathers * padded * gathered_bytes
        reduced += reductions * padded * reduced_bytes
        shard += padded // n * 4  # what HSDP all-reduces over the replicas: this rank's (padded) shard
    traffic = [
        Traffic("all_gather", gathered, n, "dp_shard"),
        Traffic("reduce_scatter", reduced, n, "dp_shard"),
    ]
    if layout.dp_replicate > 1:
        traffic.append(Traffic("all_reduce", shard, layout.dp_replicate, "dp_replicate"))
    return traffic


def fsdp_mesh(mesh, layout: Layout):
    """FSDP2's mesh: the sharding ranks (dp_shard x cp flattened), with the replicas as an outer dimension (HSDP)."""
    sharding = submesh(mesh, layout.shard_dims)
    if layout.dp_replicate == 1:
        return sharding
    return mesh[("dp_replicate", "_".join(layout.shard_dims))]


class Shard(Piece, SplitsParameters, HooksTheStep):
    """Applied last (with replicate, which it replaces under dp_shard): around each stage as the others left it."""

    name = dim = "dp_shard"
    any_model = True
    Flags = Flags
    MISTAKES = MISTAKES

    def is_on(self, plan: Plan) -> bool:
        return bool(plan.layout.shard_dims)

    def refuse(self, plan: Plan) -> None:
        refuse(plan)

    def apply(self, stages: list, ctx: Context) -> list:
        for stage in stages:
            apply(
                stage,
                fsdp_mesh(ctx.mesh, ctx.layout),
                ctx.args,
                ctx.layout,
                ctx.work,
                ignored=ctx.claimed(stage),
                exact="exact_accumulation" in ctx.plan.traits,
            )
        return stages

    def rest_shape(self, name: str, shape: list[int], t: Theory) -> list[int]:
        return shape if t.claimed(name) else local_shape(shape, t.layout, t.rank)

    def window_bytes(self, name: str, shape: list[int], t: Theory) -> int | None:
        """A gathered copy of what FSDP keeps gathered between forward and backward (bf16 copies under bf16)."""
        if t.claimed(name) or not gathered_between_forward_and_backward(name, t.args, t.layout):
            return None
        return math.prod(shape) * (2 if t.work.mixed_precision == "bf16" else 4)

    def sent(self, t: Theory) -> list[Traffic]:
        return sent(t)

    def before_micro_batch(self, job) -> None:
        set_gradient_sync(job.model, job.accelerator.sync_gradients)

    def after_evaluate(self, job) -> None:
        reshard(job.model)  # the next step all-gathers the root, as its theory says


PIECE = Shard()
