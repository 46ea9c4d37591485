"""The optimizer step's pieces that train_gpt, its one-process reference and benchmarks/bare_gpt.py share:
the learning-rate schedule and clipping by the GLOBAL gradient norm, for any layout of the gradients.
(The AdamW groups live on the model: GPT.configure_optimizers, as in nanoGPT.)"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def cosine_lr(step: int, lr: float, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to `lr` over warmup_steps, then cosine down to lr x min_lr_ratio at decay_steps, then
    flat (nanoGPT's get_lr; step counts from 1)."""
    if step <= warmup_steps:
        return lr * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_by_global_norm(
    parameters,
    max_norm: float,
    local_only: bool = False,
    across=None,
    counted_elsewhere=(),
    exact: bool = False,
) -> torch.Tensor:
    """Clip to the norm of the WHOLE gradient; return that norm. A DTensor gradient's squared sum is
    summed over the mesh dimensions it is split on (Shard) and counted once over those it is copied on
    (Replicate): under FSDP x TP a LayerNorm's gradient is split across the sharding ranks but the same on
    every tensor-parallel rank. Gradients are grouped by (mesh, which dimensions are split) so that each
    group costs one all-reduce per split dimension, not one per tensor. Plain tensors (DDP, one process) are
    the same on every rank and count once. `across`: a process group whose ranks hold different parameters
    (a pipeline's stage-ranks): their sums are summed over it; `counted_elsewhere`: parameters whose gradient
    another rank counts (the tied embedding's copy on the last stage). `local_only` is the classic mistake:
    each rank clips by the norm of its own piece. `exact`: the squares summed in float64 (each a float32's square,
    exact there), so the norm of a sharded gradient is the whole one's to the last float32 bit of the scale."""
    parameters = list({id(p): p for p in parameters}.values())
    sum_partial_gradients(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    skipped = {id(p.grad) for p in counted_elsewhere if p.grad is not None}
    device = (grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]).device
    locals_by_key: dict = {}  # (mesh, split dims) -> this rank's local gradients
    for grad in grads:
        if id(grad) in skipped:
            continue
        # not is_replicate(), not is_shard(): FSDP2 over TP splits with _StridedShard, for which is_shard() is False
        split = tuple(not p.is_replicate() for p in grad.placements) if isinstance(grad, DTensor) else ()
        key = (grad.device_mesh, split) if isinstance(grad, DTensor) else None
        locals_by_key.setdefault(key, []).append(grad.to_local() if isinstance(grad, DTensor) else grad)
    total = torch.zeros((), device=device, dtype=torch.float64 if exact else torch.float32)
    for key, locals_ in locals_by_key.items():
        if exact:
            squared_sum = torch.stack([local.double().pow(2).sum() for local in locals_]).sum()
        else:
            # one multi-tensor kernel for every gradient's norm (on a GPU one launch, not two a tensor), in float32
            squared_sum = torch.stack(torch._foreach_norm(locals_, 2, dtype=torch.float32)).pow(2).sum()
        if key is not None and not local_only:
            mesh, split = key
            for dim in (dim for dim, is_split in enumerate(split) if is_split):
                dist.all_reduce(squared_sum, group=mesh.get_group(dim))
        total += squared_sum
    if across is not None and not local_only:
        dist.all_reduce(total, group=across)
    return clip_to(grads, total.sqrt(), max_norm)


def sum_partial_gradients(parameters) -> None:
    """Partial-sum gradients (sequence parallelism's norms: each rank's over its own tokens) summed, as Replicate:
    those alike (mesh, placements) flattened into one buffer and all-reduced once over each partial dimension,
    not one redistribute a tensor (18 all-reduces a step on tp 2 with SP of the default GPT, each ~1 ms on gloo).
    Elementwise the same sums."""
    alike: dict = {}
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            alike.setdefault((grad.device_mesh, tuple(grad.placements)), []).append(param)
    for (mesh, placements), params in alike.items():
        summed = [Replicate() if p.is_partial() else p for p in placements]
        if any(p.is_partial() and p.reduce_op != "sum" for p in placements):  # not sums: DTensor's own way
            for param in params:
                param.grad = param.grad.redistribute(mesh, summed)
            continue
        locals_ = [param.grad.to_local() for param in params]
        buffer = torch.cat([local.reshape(-1) for local in locals_])
        for dim in (dim for dim, p in enumerate(placements) if p.is_partial()):
            dist.all_reduce(buffer, group=mesh.get_group(dim))
        for param, local, piece in zip(
            params, locals_, buffer.split([t.numel() for t in locals_]), strict=True
        ):
            param.grad = DTensor.from_local(piece.view_as(local), mesh, summed, run_check=False,
                                            shape=param.grad.shape, stride=param.grad.stride())  # fmt: skip


def clip_to(grads: list, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale `grads` so that the gradient whose norm is `norm` has norm at most max_norm (0: off); the norm, a
    tensor on the gradients' device (read it where it is logged: .item() waits for the device)."""
    if max_norm > 0:
        # torch.nn.utils.clip_grad_norm_'s formula, in the gradients' float32 (a float64 norm's scale rounded once)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0).float()
        locals_ = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
        by_dtype: dict = {}  # a multi-tensor kernel takes one dtype
        for local in locals_:
            by_dtype.setdefault(local.dtype, []).append(local)
        for same in by_dtype.values():
            torch._foreach_mul_(same, scale)
    return norm
