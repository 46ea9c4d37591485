"""One parallelize: a layout applied to the GPT, each dimension's piece in the canonical order.

    job = parallelize(gpt, layout, args, work, accelerator, make_optimizer, max_norm)
    loss = job.forward_backward(x, y)        # one micro-batch (a pipeline: the schedule's whole step)
    norm = job.clip()                        # the GLOBAL gradient norm, on a step's last micro-batch
    job.step(norm)                           # AdamW on what each rank holds

The order is torchtitan's: the pipeline split first (each rank keeps its stages, each a GPT holding None for
what it does not run), then on each stage tensor parallelism -> context parallelism -> expert parallelism (a
mixture of experts: its counts summed over the data-parallel ranks, its experts split over ep) -> activation
checkpointing -> torch.compile per block (--compile) -> FSDP (dp_shard; HSDP with dp_replicate) or replicate,
each applied when its degree is > 1. Under a DeepSpeed accelerate config, DeepSpeed's engine does it all
(strategies/deepspeed.py). Each piece is one module that knows its own flags and nothing of the others: this
file is the only place that puts them together, and it asks the layout's degrees, never which preset ran.

What the job does at run time is strategies/job.py; what every rank holds and sends by theory, composed from the
pieces' closed forms, is strategies/theory.py.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch.distributed as dist

from common import moe
from common.runtime import deepspeed_stage
from strategies import activation_checkpointing, compile, cp, deepspeed, ep, pp, replicate, shard, tp
from strategies.job import Job
from strategies.layout import Layout, Workload, submesh


def parallelize(
    gpt, layout: Layout, args, work: Workload, accelerator, make_optimizer, max_norm: float
) -> Job:
    """Apply `layout` to `gpt` (the same initial weights on every rank), in the canonical order; AdamW
    (`make_optimizer(parameters)`) over what this rank holds, prepared by Accelerate; clipping at `max_norm`.
    Under a DeepSpeed accelerate config, DeepSpeed's engine does it all (strategies/deepspeed.py)."""
    if deepspeed_stage():
        return deepspeed.parallelize(gpt, layout, args, work, accelerator, make_optimizer, max_norm)
    # the rank in the process group the mesh is made of: Accelerate's process_index in a launch, the rank a fake
    # process group impersonates in experiments/at_scale.py
    rank, device = dist.get_rank() if dist.is_initialized() else 0, accelerator.device
    if next(gpt.parameters()).device.type not in (device.type, "meta"):  # meta: made real later (at_scale.py)
        gpt.to(device)
    mesh = layout.mesh(device.type) if layout.world_size > 1 else None
    pipeline = (
        pp.Pipeline(gpt, layout, rank, args, pp.activation_dtype(layout, work)) if layout.pp > 1 else None
    )
    stages = list(pipeline.stages) if pipeline else [gpt]
    attentions, exchanges = [], []
    data_dims = tuple(d for d in ("dp_replicate", "dp_shard", "ep") if getattr(layout, d) > 1)
    for index, stage in enumerate(stages):
        if layout.tp > 1:
            tp.apply(stage, mesh["tp"], args)
        if layout.cp > 1:
            attentions += cp.apply(stage, mesh["cp"], layout, rank, args)
        if moe.moe_layers(stage) and data_dims:
            ep_mesh = mesh["ep"] if layout.ep > 1 else None
            exchanges += ep.apply(stage, ep_mesh, submesh(mesh, data_dims).get_group(), layout, rank, args)
        activation_checkpointing.apply(stage, args.activation_checkpointing)
        if args.compile:
            compile.apply(stage)
        if layout.shard_dims:
            shard.apply(
                stage, fsdp_mesh(mesh, layout), args, layout, work, ignored=set(ep.expert_parameters(stage))
            )
        elif layout.replicate_dims:
            # every rank of an Accelerate launch a replica: Accelerate's DDP (a fake world of experiments/at_scale.py,
            # which Accelerate did not launch: PyTorch's replicate on the mesh)
            whole_world = layout.size(layout.replicate_dims) == layout.world_size == accelerator.num_processes
            if whole_world:
                ep.ignore_for_ddp(stage)
            stages[index] = replicate.apply(
                stage, submesh(mesh, layout.replicate_dims), accelerator, whole_world
            )
    if pipeline:
        pipeline.connect(layout, rank, mesh["pp"], device, args.wrong_variant)
    model = pipeline.model if pipeline else stages[0]
    unwrapped = getattr(model, "module", model)  # DDP's wrapped module
    optimizer = accelerator.prepare(make_optimizer(unwrapped.parameters()))
    # the ranks that hold the same experts (the data-parallel ranks of other ep coordinates' peers: not ep)
    replica_dims = tuple(d for d in data_dims if d != "ep")
    expert_replicas = submesh(mesh, replica_dims).get_group() if exchanges and replica_dims else None
    return Job(layout, rank, model, stages, optimizer, accelerator, args, work, max_norm, pipeline, attentions,
               exchanges, expert_replicas)  # fmt: skip


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


def fsdp_mesh(mesh, layout: Layout):
    """FSDP2's mesh: the sharding ranks (dp_shard x cp flattened), with the replicas as an outer dimension (HSDP)."""
    sharding = submesh(mesh, layout.shard_dims)
    if layout.dp_replicate == 1:
        return sharding
    return mesh[("dp_replicate", "_".join(layout.shard_dims))]
