"""fsdp_tp: 2-D parallelism on a (dp x tp) mesh (--dp_size x --tp_size): tensor parallelism inside each
group of tp ranks (strategies/tp.py), then FSDP2 (ZeRO-3, strategies/fsdp.py) across the dp groups on
each rank's TP piece. Each TP group reads its own share of the data. On 2 cores the 4 ranks of 2 x 2
oversubscribe the cores: slow, but every check runs.

Theory: each rank holds the dim-0 chunk (over dp) of its TP piece of every parameter; one step sends
tp's activation traffic on each TP group's batch plus fsdp's all-gathers and reduce-scatters of each
rank's TP piece.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

from common.config import require
from strategies import fsdp, tp
from strategies.defaults import (  # noqa: F401  # fmt: skip (the interface)
    STEADY_STEP,
    backward,
    checkpointer,
    clip,
    forward,
    measure_held,
    measure_window,
    report,
    with_optimizer,
)
from strategies.layout import Layout, communication, require_ranks

NAME = "fsdp_tp"
SUMMARY = "2-D: TP inside each group, FSDP2 (ZeRO-3) across groups"
RANKS = 4
CHECKPOINT_FORMAT = "dcp"  # PyTorch's distributed checkpoint: any layout reads it
AUTOCAST = False
WRONG_VARIANTS = (
    "same_data_on_every_rank",
    "local_grad_norm",
    "seed_per_rank",
    "unwrapped_root",
    "row_parallel_without_all_reduce",
    "resume_without_optimizer_state",
    "resume_without_data_position",
)


def layout(world_size: int, dp_size: int = 0, tp_size: int = 0) -> Layout:
    require_ranks(NAME, world_size)
    tp_size = tp_size or (max(1, world_size // dp_size) if dp_size else 2)  # 2 ranks per TP group by default
    dp_size = dp_size or max(1, world_size // tp_size)
    shape = Layout(world_size, dp_size, tp_size)
    require(
        dp_size >= 2 and tp_size >= 2,
        f"--strategy fsdp_tp needs --dp_size >= 2 and --tp_size >= 2, got {dp_size} x {tp_size} (e.g. 4 ranks: 2 x 2)",
    )
    return shape


refuse = tp.refuse


def apply(model, layout: Layout, accelerator, cfg):
    mesh = layout.mesh(accelerator.device.type)
    model = tp.parallelize(
        model.to(accelerator.device), mesh["tp"], cfg.wrong_variant != "row_parallel_without_all_reduce"
    )
    return with_optimizer(fsdp.shard(model, mesh["dp"], zero3=True, cfg=cfg), accelerator, cfg)


@contextlib.contextmanager
def quiet():
    """What this layout says that is expected, silenced for the run only (restored after): FSDP2 warns that
    the root returns a view (the logits, cut out of TP's padded all-gather; only an in-place change of it
    would be wrong, and nothing changes logits in place), and DTensor logs that gathering a 2-D-sharded
    parameter takes two all-gathers."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def held_bytes(model, layout: Layout, rank: int, cfg) -> dict:
    return fsdp.sharded_held_bytes(model, layout, rank, cfg, zero3=True, tp_split=tp.split_dim)


def sent_bytes(model, layout: Layout, cfg) -> dict:
    tensor_parallel = tp.activation_traffic(model, layout, cfg)
    data_parallel = fsdp.sharded_sent_bytes(model, layout, cfg, zero3=True, tp_split=tp.split_dim)
    return communication(data_parallel, tensor_parallel, layout)
