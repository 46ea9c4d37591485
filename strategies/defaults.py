"""The parts of the strategy interface most strategies share, in one place, imported by name into each
module that uses them (so a module still lists its whole interface): PyTorch's AdamW on whatever each
rank holds, stepped after our clipping by the GLOBAL gradient norm; checkpoints in PyTorch's distributed
format; bytes held read from the parameters and optimizer state (a DTensor's local shard). A strategy
whose engine owns the step and its state (deepspeed) defines its own."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from common.checkpoint import ShardedCheckpointer
from common.optim import clip_by_global_norm

quiet = contextlib.nullcontext  # nothing expected to silence
# The first step free of one-time work, whose collectives communication_volume counts: after the evaluation
# (a forward without backward) FSDP2 keeps the root gathered, so step 1 does not all-gather it; in step 2
# DDP rebuilds its buckets and broadcasts rank 0's order (144 bytes, measured).
STEADY_STEP = 3


def with_optimizer(model, accelerator, cfg):
    """(model, AdamW over what this rank holds, prepared by Accelerate: it steps on a step's last micro-batch)."""
    # DDP's wrapped module, or the model itself (not accelerator.unwrap_model: it imports torch._dynamo and
    # deepspeed to look for compiled and DeepSpeed models, 1.3 s of every rank's start-up, measured)
    optimizer = getattr(model, "module", model).configure_optimizers(cfg.lr, cfg.weight_decay)
    return model, accelerator.prepare(optimizer)


def forward(model, x, y):
    """One micro-batch's forward: the mean loss over its tokens."""
    return model(x, y)[1]


def backward(model, loss, accelerator) -> None:
    """Accelerate's backward: the loss divided by the accumulation steps; DeepSpeed's engine's own backward."""
    accelerator.backward(loss)


def report(session, model, cfg) -> None:
    """What a strategy measures beyond the common checks, at the end (every rank calls it): nothing."""


def clip(model, cfg) -> float:
    """Clip to --grad_clip by the global norm and return that norm; `local_grad_norm` is the mistake of
    each rank clipping by its own shard's norm."""
    return clip_by_global_norm(model, cfg.grad_clip, local_only=cfg.wrong_variant == "local_grad_norm")


def checkpointer(model, optimizer, accelerator, cfg) -> ShardedCheckpointer:
    """DCP: any strategy reads any other's, at any world size (common/checkpoint.py)."""
    return ShardedCheckpointer(
        model, optimizer, restore_optimizer=cfg.wrong_variant != "resume_without_optimizer_state"
    )


def local_bytes(tensor) -> int:
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return tensor.numel() * tensor.element_size()


def measure_held(model: torch.nn.Module, optimizer) -> dict:
    """Bytes this rank really holds at rest: parameters, gradients, optimizer state (local shards)."""
    unique = {id(p): p for p in model.parameters()}.values()
    state = getattr(optimizer, "optimizer", optimizer).state  # Accelerate's wrapper holds the real one
    return {
        "params": sum(local_bytes(p) for p in unique),
        "grads": sum(local_bytes(p.grad) for p in unique if p.grad is not None),
        "optimizer": sum(local_bytes(v) for s in state.values() for v in s.values() if torch.is_tensor(v)),
    }


def measure_window(model: torch.nn.Module) -> int:
    """Parameter bytes held between forward and backward (ZeRO-3 has freed the blocks' gathered copies)."""
    return sum(local_bytes(p) for p in {id(p): p for p in model.parameters()}.values())
