"""fsdp: ZeRO-3, fully sharded data parallelism with PyTorch's FSDP2 (`fully_shard`). Every parameter,
its gradient and its optimizer state are split across the data-parallel ranks (dim 0, torch.chunk's
split): each rank holds 1/N of everything at rest. Each block's parameters are all-gathered just before
its forward and freed right after, then gathered again for its backward; its gradients are
reduce-scattered (each rank keeps the mean of its own shard) and each rank's AdamW updates only its
shard. The root module (embeddings, final norm, head) is wrapped last and, as FSDP2 does by default
for the root, not resharded between forward and backward.

Why PyTorch's API and not Accelerate's plugin: Accelerate 1.16 silently runs DDP instead of FSDP on CPU
(measured, FIELD_NOTES); `fully_shard` on a DeviceMesh of the accelerator's device type runs over gloo
on CPU and NCCL on GPU, inside the process group Accelerate made: one code path.

Theory per rank, N data-parallel ranks: parameters, gradients and AdamW state at rest = each tensor's
dim-0 chunk; between forward and backward the blocks' shards plus the root gathered whole. Per step:
all-gather every block twice and the root once per micro-batch, reduce-scatter every gradient once,
each into a buffer whose dim 0 is padded to a multiple of N (uneven shards).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

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
from strategies.layout import (
    Layout,
    communication,
    data_parallel_only,
    held,
    padded_numel,
    piece_shape,
    unique_parameters,
)

NAME = "fsdp"
SUMMARY = "ZeRO-3 (FSDP2): parameters, gradients, optimizer state 1/N per rank; blocks gathered per use"
RANKS = 2
CHECKPOINT_FORMAT = "dcp"  # PyTorch's distributed checkpoint: any layout reads it
AUTOCAST = (
    False  # bf16: FSDP2's MixedPrecisionPolicy (parameters gathered as bf16, gradients reduced in float32)
)
WRONG_VARIANTS = (
    "same_data_on_every_rank",
    "local_grad_norm",
    "seed_per_rank",
    "unwrapped_root",
    "resume_without_optimizer_state",
    "resume_without_data_position",
)
OWN_WRONG_VARIANTS = {
    "unwrapped_root": "fully_shard on the blocks only: the root's embeddings and head neither sharded nor synchronized",
}


def layout(world_size: int, dp_size: int = 0, tp_size: int = 0) -> Layout:
    return data_parallel_only(NAME, world_size, dp_size, tp_size)


def refuse(cfg, layout: Layout) -> None:
    pass


def apply(model, layout: Layout, accelerator, cfg):
    mesh = layout.mesh(accelerator.device.type)["dp"]
    return with_optimizer(shard(model.to(accelerator.device), mesh, zero3=True, cfg=cfg), accelerator, cfg)


def shard(model, mesh, zero3: bool, cfg=None, bf16: bool | None = None, wrap_root: bool | None = None):
    """fully_shard each block, then the root, over the data-parallel `mesh`. zero3: each block's gathered
    parameters are freed after its forward and gathered again for backward. Otherwise (ZeRO-2) the blocks
    are not units of their own: the whole model is one unit, gathered once before forward and kept until
    backward ends, its gradients reduce-scattered once (see strategies/zero2.py for why). bf16: parameters
    gathered as bf16 copies, gradients reduced in float32. wrap_root=False is the classic mistake of
    sharding the blocks only (`unwrapped_root`)."""
    bf16 = cfg.mixed_precision == "bf16" if bf16 is None else bf16
    wrap_root = cfg.wrong_variant != "unwrapped_root" if wrap_root is None else wrap_root
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    if zero3 or not wrap_root:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=zero3, mp_policy=policy)
    if wrap_root:
        # None: FSDP2's default for the root, which keeps its parameters for the backward that starts at once
        fully_shard(model, mesh=mesh, reshard_after_forward=None if zero3 else False, mp_policy=policy)
    return model


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2's no_sync: reduce-scatter gradients only on the last micro-batch of a step (DDP's no_sync comes
    with Accelerate's accumulate()). A no-op for a model without FSDP modules, so any loop may call it."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)


def held_bytes(model, layout: Layout, rank: int, cfg) -> dict:
    return sharded_held_bytes(model, layout, rank, cfg, zero3=True)


def sent_bytes(model, layout: Layout, cfg) -> dict:
    return communication(sharded_sent_bytes(model, layout, cfg, zero3=True), {}, layout)


def sharded_held_bytes(
    model, layout: Layout, rank: int, cfg, zero3: bool, tp_split=lambda name: None
) -> dict:
    """Each parameter's piece at rest (dim-0 chunk of its TP piece, `tp_split(name)` the TP split dimension
    or None); gradients the same; AdamW's state. Between forward and backward: ZeRO-2 holds every parameter
    gathered, ZeRO-3 the blocks' shards and the root gathered (bf16: gathered copies are 2 bytes)."""
    gathered_bytes = 2 if cfg.mixed_precision == "bf16" else 4
    params = window = 0
    parameters = unique_parameters(model)
    for name, param in parameters:
        at_rest = math.prod(piece_shape(param.shape, layout, rank, tp_split(name), dp_sharded=True))
        gathered = math.prod(piece_shape(param.shape, layout, rank, tp_split(name), dp_sharded=False))
        params += at_rest * param.element_size()
        stays_sharded = zero3 and name.startswith("blocks.")
        window += at_rest * param.element_size() if stays_sharded else gathered * gathered_bytes
    return held(params, len(parameters), between_forward_and_backward=window)


def sharded_sent_bytes(model, layout: Layout, cfg, zero3: bool, tp_split=lambda name: None) -> dict:
    """The data-parallel group's bytes per step, k = --gradient_accumulation_steps: every parameter
    all-gathered per micro-batch before forward (ZeRO-3: the blocks again before backward), every gradient
    reduce-scattered once per step in float32; each into FSDP2's padded buffer (rank 0's TP piece)."""
    k = cfg.gradient_accumulation_steps
    gathered_bytes = 2 if cfg.mixed_precision == "bf16" else 4
    sent = {"all_gather": 0, "reduce_scatter": 0}
    for name, param in unique_parameters(model):
        padded = padded_numel(
            piece_shape(param.shape, layout, 0, tp_split(name), dp_sharded=False), layout.dp
        )
        gathers = 2 if zero3 and name.startswith("blocks.") else 1
        sent["all_gather"] += k * gathers * padded * gathered_bytes
        sent["reduce_scatter"] += padded * 4
    return sent
