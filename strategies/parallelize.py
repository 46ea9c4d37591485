"""One parallelize: a layout applied to the GPT, each dimension's piece in the canonical order.

    job = parallelize(gpt, layout, args, work, accelerator, make_optimizer, max_norm)
    result = job.train_step(micro_batches, lr)   # one optimizer step: each micro-batch's forward and backward (a
                                                 # pipeline: the schedule's whole step), the clipping by the GLOBAL
                                                 # norm, AdamW on what each rank holds

The order is the registry's (strategies/registry.py), torchtitan's: the pipeline split first (each rank keeps
its stages, each a GPT holding None for what it does not run), then on each stage tensor parallelism -> context
parallelism -> expert parallelism (a mixture of experts: its counts summed over the data-parallel ranks, its
experts split over ep) -> activation checkpointing -> torch.compile per block (--compile) -> FSDP (dp_shard;
HSDP with dp_replicate) or replicate, each applied when it runs under the plan (its `is_on`). Under a DeepSpeed
accelerate config, DeepSpeed's engine does it all (strategies/deepspeed.py). Each piece is one module that
knows its own flags and nothing of the others: this file loops over them and names none.

What the job does at run time is strategies/job.py; what every rank holds and sends by theory, composed from the
pieces' closed forms, is strategies/theory.py.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch.distributed as dist

from strategies import registry
from strategies.job import Job
from strategies.layout import Layout, Workload
from strategies.piece import Context, RunsTheStep, having


def parallelize(
    gpt, layout: Layout, args, work: Workload, accelerator, make_optimizer, max_norm: float
) -> Job:
    """Apply `layout` to `gpt` (the same initial weights on every rank): every registered piece that runs under
    it, in the registry's order, each on the stages the pieces before it left; AdamW (`make_optimizer(
    parameters)`) over what this rank holds, prepared by Accelerate; clipping at `max_norm`. Under an engine
    (a DeepSpeed accelerate config) the engine does it all (strategies/deepspeed.py)."""
    plan = args.plan(layout, work)
    engine = next((engine for engine in registry.ENGINES if engine.is_on(plan)), None)
    if engine:
        return engine.parallelize(gpt, plan, accelerator, make_optimizer, max_norm)
    # the rank in the process group the mesh is made of: Accelerate's process_index in a launch, the rank a fake
    # process group impersonates in experiments/at_scale.py
    rank, device = dist.get_rank() if dist.is_initialized() else 0, accelerator.device
    if next(gpt.parameters()).device.type != "meta":  # meta: made real later (at_scale.py)
        gpt.to(device)  # a no-op where it is already there (the CPU), unconditional so a rehearsal sees it
    mesh = layout.mesh(device.type) if layout.world_size > 1 else None
    ctx = Context(plan, rank, mesh, device, accelerator, stages=[gpt])
    for piece in plan.on:
        ctx.stages = piece.apply(ctx.stages, ctx)
    for piece in having(plan.on, RunsTheStep):
        piece.connect(ctx)
    model = ctx.model or ctx.stages[0]
    unwrapped = getattr(model, "module", model)  # DDP's wrapped module
    optimizer = accelerator.prepare(make_optimizer(unwrapped.parameters()))
    return Job(ctx, model, optimizer, max_norm)


@contextlib.contextmanager
def quiet():
    """What the pieces say that is expected, silenced for the run only (restored after): FSDP2 warns that a root
    returns a view (the logits, cut out of tensor parallelism's padded all-gather; only an in-place change of it
    would be wrong, and nothing changes logits in place), DeviceMesh that slicing a flattened dimension will be
    deprecated, DTensor logs that gathering a 2-D-sharded parameter
    takes two all-gathers, and DeepSpeed calls torch.distributed's deprecated collective names every step."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        # torch 2.13 warns that slicing a flattened dimension (dp_shard_ep, dp_shard_cp) from the root mesh "will be
        # deprecated in PT 2.11" (it still works here); layout.submesh slices it by name after its first flatten
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor). is deprecated",
                                category=FutureWarning)  # fmt: skip
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)
