"""dp_replicate: data parallelism by replicas. Every rank of the group holds the same piece of the model whole
(the whole model, or what the other dimensions leave it) and trains on its own share of each global batch;
in backward the gradients are all-reduced and divided by the ranks: every rank then holds the mean gradient,
the one a single process computes on the whole global batch. The group is --dp_replicate x --cp (context-
parallel ranks saw their own tokens of the same samples); under --dp_shard the replicas are FSDP2's (HSDP,
strategies/shard.py) and this piece is not applied.

Two engines, one piece:
- every rank a replica of the whole model (no other dimension): Accelerate's prepare() wraps it in
  DistributedDataParallel (gloo on CPU, NCCL on GPU), gradients all-reduced in buckets while backward still
  runs; with accumulation Accelerate's accumulate() skips the all-reduce (no_sync) on all but the last
  micro-batch of a step. The front door: what `accelerate launch` users get.
- replicas of a piece (a pipeline stage, a tensor-parallel shard), or of a world Accelerate did not launch (the
  fake process group of experiments/at_scale.py): PyTorch's `replicate` (FSDP2's machinery
  without sharding): DDP takes neither DTensor parameters nor a group inside a larger mesh, which torchtitan
  refuses ("DDP has not supported > 1D parallelism"); replicate does both, and pipelining's schedules
  reduce its gradients once per step. The whole piece is one unit: one all-reduce per step.

Theory: each rank holds 4 bytes per parameter of its piece, again for its gradient, AdamW's two moments plus
a step count per tensor; one step all-reduces every gradient once (4 bytes per parameter), whatever the
accumulation, of which each rank puts 2(N-1)/N on the wire (ring all-reduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.config import flag
from strategies.layout import Layout, Traffic


@dataclass
class Flags:
    dp_replicate: int = flag(0, "replicated data-parallel degree: ranks that each hold what the other dimensions "
                             "leave them whole, read their own data and all-reduce gradients (0, 1: off)")  # fmt: skip


def apply(model: torch.nn.Module, mesh, accelerator, whole_world: bool) -> torch.nn.Module:
    """Accelerate's DDP when every rank is a replica of the whole model; else PyTorch's replicate on `mesh`."""
    if whole_world:
        return accelerator.prepare(model)
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(model, mesh=mesh)
    return model


def sent(layout: Layout, pieces: list[tuple[str, list[int]]]) -> list[Traffic]:
    """One step's all-reduce of the gradients of the parameters this rank holds, `pieces`: (name, local shape)."""
    if layout.shard_dims or not layout.replicate_dims:
        return []
    size = sum(math.prod(shape) * 4 for _, shape in pieces)
    return [Traffic("all_reduce", size, layout.size(layout.replicate_dims), "dp_replicate")]
