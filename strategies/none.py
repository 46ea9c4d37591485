"""none: one process, no parallelism. The reference every other strategy is compared with, and the
baseline of the throughput tables."""

from __future__ import annotations

from common.config import require
from strategies import ddp
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
from strategies.layout import Layout, require_ranks

NAME = "none"
SUMMARY = "one process: the reference"
RANKS = 1
CHECKPOINT_FORMAT = "dcp"  # PyTorch's distributed checkpoint: any layout reads it
AUTOCAST = True
WRONG_VARIANTS = ("resume_without_optimizer_state", "resume_without_data_position")


def layout(world_size: int, dp_size: int = 0, tp_size: int = 0) -> Layout:
    require_ranks(NAME, world_size)
    require(not (dp_size or tp_size), "--dp_size / --tp_size are for --strategy tp and fsdp_tp, not none")
    return Layout(1, 1)


def refuse(cfg, layout: Layout) -> None:
    pass


def apply(model, layout: Layout, accelerator, cfg):
    return with_optimizer(model.to(accelerator.device), accelerator, cfg)


# One process holds and computes what a DDP rank does; it sends nothing.
held_bytes = ddp.held_bytes


def sent_bytes(model, layout: Layout, cfg) -> dict:
    return {"by_kind": {}, "data_parallel": {}, "tensor_parallel": {}, "wire_bytes": 0.0}
