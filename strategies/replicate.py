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
from strategies.layout import Traffic, submesh
from strategies.piece import Context, HooksTheStep, Piece, Plan, Theory


@dataclass
class Flags:
    dp_replicate: int = flag(0, "replicated data-parallel degree: ranks that each hold what the other dimensions "
                             "leave them whole, read their own data and all-reduce gradients (0, 1: off)")  # fmt: skip


def apply(model: torch.nn.Module, mesh, accelerator, whole_world: bool, claimed=()) -> torch.nn.Module:
    """Accelerate's DDP when every rank is a replica of the whole model; else PyTorch's replicate on `mesh`.
    `claimed`: parameters another piece splits (ep's experts), which DDP must leave alone."""
    if whole_world:
        ignore_for_ddp(model, claimed)
        return accelerator.prepare(model)
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(model, mesh=mesh, ignored_params=set(claimed) or None)
    return model


def replicates_whole_model(layout) -> bool:
    """Every rank a replica of the whole model, no other dimension splitting it: what a launch of that many ranks
    runs as Accelerate's DDP (a fake world of experiments/at_scale.py as PyTorch's replicate)."""
    return not layout.shard_dims and layout.size(layout.replicate_dims) == layout.world_size > 1


def runs_ddp(layout, accelerator) -> bool:
    """Every rank of an Accelerate launch a replica of the whole model: Accelerate's DDP (a fake world of
    experiments/at_scale.py, which Accelerate did not launch, runs PyTorch's replicate on the mesh)."""
    return replicates_whole_model(layout) and layout.world_size == accelerator.num_processes


def ignore_for_ddp(model: torch.nn.Module, claimed) -> None:
    """DDP's list of what to leave alone (its private hook, `_set_params_and_buffers_to_ignore_for_model`'s
    attribute): the parameters another piece claimed, and the buffers a module says are its rank's own
    (`rank_local_buffers`: a mixture of experts' token counts), which DDP would broadcast from rank 0 in every
    forward."""
    names = [name for name, p in model.named_parameters() if p in claimed] + rank_local_buffers(model)
    if names:
        model._ddp_params_and_buffers_to_ignore = names


def rank_local_buffers(model: torch.nn.Module) -> list[str]:
    """The buffers a module says are its rank's own (`rank_local_buffers`: a mixture of experts' token counts)."""
    return [f"{prefix}.{buffer}" for prefix, module in model.named_modules()
            for buffer in getattr(module, "rank_local_buffers", ())]  # fmt: skip


def sent(t: Theory) -> list[Traffic]:
    """One step's all-reduce of the gradients of the parameters this rank holds (those no piece splits itself);
    under Accelerate's DDP also its broadcast of the model's buffers from rank 0 (DDP's broadcast_buffers, on by
    default: a transformers model's rotary frequencies; the project's GPT has none but a rank's own, which DDP is
    told to leave alone), once a step: DDP syncs them in a forward that follows one whose gradients it reduced,
    so under accumulation (no_sync) only in a step's first (measured: 64 bytes a step at 1 and 2 micro-batches)."""
    layout, ranks = t.layout, t.layout.size(t.layout.replicate_dims)
    size = sum(math.prod(shape) * 4 for _, shape in t.unclaimed)
    traffic = [Traffic("all_reduce", size, ranks, "dp_replicate")]
    # (a world Accelerate did not launch, at_scale's fake one, replicates by PyTorch's replicate: no buffer sent)
    if not (replicates_whole_model(layout) and getattr(t.args, "replicas_are_ddp", True)):
        return traffic
    own = rank_local_buffers(t.model)
    size = sum(b.numel() * b.element_size() for name, b in t.model.named_buffers() if name not in own)
    return traffic + ([Traffic("broadcast", size, ranks, "dp_replicate", calls=1)] if size else [])


class Replicate(Piece, HooksTheStep):
    """Applied last: around each stage as every other piece left it."""

    name = dim = "dp_replicate"
    any_model = True
    Flags = Flags

    def is_on(self, plan: Plan) -> bool:
        # the replicas of what no sharding covers (under dp_shard, FSDP2's HSDP holds the replicas)
        return not plan.layout.shard_dims and bool(plan.layout.replicate_dims)

    def traits(self, plan: Plan) -> set[str]:
        # every rank a replica of the whole model: a launch runs Accelerate's DDP, its gradient reducer in C++ (the
        # planner prices a fake replica's FSDP2 hooks as that, not as themselves)
        return {"whole_model_replicas"} if replicates_whole_model(plan.layout) else set()

    def apply(self, stages: list, ctx: Context) -> list:
        layout, whole_world = ctx.layout, runs_ddp(ctx.layout, ctx.accelerator)
        return [apply(stage, submesh(ctx.mesh, layout.replicate_dims), ctx.accelerator, whole_world, ctx.claimed(stage))
                for stage in stages]  # fmt: skip

    def steady_step(self, job) -> int:
        # DDP learns its gradients' order in its first backward and rebuilds its buckets in the second step (two
        # broadcasts): from the third, its buckets are the steady ones (measured on the calibration's GPT: one 4.25
        # MB all-reduce in step 1, two from step 2 on, 1.06 and 3.20 MB: DDP's first bucket is 1 MB)
        return 3 if runs_ddp(job.layout, job.accelerator) else 1

    def sent(self, t: Theory) -> list[Traffic]:
        return sent(t)


PIECE = Replicate()
