"""ddp: data parallelism. Every rank holds the whole model and optimizer and trains on its own share of
each global batch; in backward, DDP all-reduces the gradients (in buckets, while backward still runs)
and divides by the ranks: every rank then holds the mean gradient, the one a single process computes
on the whole global batch. Accelerate's prepare() wraps the model (DistributedDataParallel, gloo on
CPU, NCCL on GPU); with accumulation, Accelerate's accumulate() skips the all-reduce (no_sync) on all
but the last micro-batch of a step.

Theory: each rank holds 4 bytes per parameter, again for its gradient, and AdamW's two moments plus a
step count per tensor; one step all-reduces every gradient once (4 bytes per parameter), whatever the
accumulation, of which each rank puts 2(N-1)/N on the wire (ring all-reduce).
"""

from __future__ import annotations

from strategies.defaults import (  # noqa: F401  # fmt: skip (the interface)
    STEADY_STEP,
    backward,
    checkpointer,
    clip,
    forward,
    measure_held,
    measure_window,
    quiet,
    report,
    with_optimizer,
)
from strategies.layout import Layout, communication, data_parallel_only, held, unique_parameters

NAME = "ddp"
SUMMARY = "every rank holds everything; gradients all-reduced (averaged) once per step"
RANKS = 2
CHECKPOINT_FORMAT = "dcp"  # PyTorch's distributed checkpoint: any layout reads it
AUTOCAST = True
# seed_per_rank is harmless here, so not a mistake: prepare() broadcasts rank 0's weights to every rank
WRONG_VARIANTS = (
    "same_data_on_every_rank",
    "local_grad_norm",
    "resume_without_optimizer_state",
    "resume_without_data_position",
)


def layout(world_size: int, dp_size: int = 0, tp_size: int = 0) -> Layout:
    return data_parallel_only(NAME, world_size, dp_size, tp_size)


def refuse(cfg, layout: Layout) -> None:
    pass


def apply(model, layout: Layout, accelerator, cfg):
    return with_optimizer(accelerator.prepare(model), accelerator, cfg)


def held_bytes(model, layout: Layout, rank: int, cfg) -> dict:
    """Everything, on every rank; autocast keeps float32 parameters (it casts per operation)."""
    parameters = unique_parameters(model)
    return held(sum(p.numel() * p.element_size() for _, p in parameters), len(parameters))


def sent_bytes(model, layout: Layout, cfg) -> dict:
    data_parallel = {"all_reduce": sum(p.numel() * 4 for _, p in unique_parameters(model))}
    return communication(data_parallel, {}, layout)
