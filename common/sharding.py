"""Sharded data parallelism (ZeRO-2 / ZeRO-3) for the GPT with PyTorch's FSDP2, shared by the
experiments that train it. Accelerate 1.16 cannot shard on CPU (it silently runs DDP instead), so
`fully_shard` is called directly, on a DeviceMesh of the accelerator's device type (gloo on CPU, NCCL
on GPU), inside the process group Accelerate made: one code path for both.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import init_device_mesh


def shard_gpt(model, accelerator, zero3: bool, bf16: bool = False, wrap_root: bool = True):
    """fully_shard each block, then the root (which holds the embeddings, final norm and head), on a
    1-D mesh over every rank. zero3: each block's gathered parameters are freed after its forward and
    gathered again for backward; otherwise (ZeRO-2) they are kept from forward to backward. bf16:
    parameters gathered as bf16 copies, gradients reduced in float32. `wrap_root=False` is the classic
    mistake of sharding the blocks only (train_gpt's `unwrapped_root`)."""
    model.to(accelerator.device)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=zero3, mp_policy=policy)
    if wrap_root:
        # None: FSDP2's default for the root, which keeps its parameters for the backward that starts at once
        fully_shard(model, mesh=mesh, reshard_after_forward=None if zero3 else False, mp_policy=policy)
    return model


def sync_gradients_this_micro_batch(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2's no_sync: reduce-scatter gradients only on the last micro-batch of a step (DDP's no_sync
    comes with Accelerate's accumulate()). A no-op for a model without FSDP modules."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)
