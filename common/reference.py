"""The single-process reference that distributed runs are compared with.

One step = the micro-batches of every rank for that step, concatenated (rank order), one mean loss over
all of those rows, one optimizer step. When every rank's shard has the same size, that is exactly
what DDP's averaged gradients compute, so parameters must agree up to float rounding.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F


def train_single_process(
    model: torch.nn.Module,
    global_batches,
    steps: int,
    micro_batches_per_step: int,
    device,
    make_optimizer,
    loss_fn=F.mse_loss,
    autocast=nullcontext,
) -> torch.nn.Module:
    """Train `model` in place: each step concatenates `micro_batches_per_step` global batches (tuples of
    tensors: inputs first, target last) into ONE batch, one loss over all of it, one optimizer step.
    `make_optimizer(parameters)` builds the optimizer the distributed run uses (SGD, AdamW, ...);
    `loss_fn(output, target)` must be a mean over the batch, as the distributed run's is."""
    model.to(device)
    optimizer = make_optimizer(model.parameters())
    for _ in range(steps):
        micro_batches = [next(global_batches) for _ in range(micro_batches_per_step)]
        *inputs, target = (torch.cat(parts).to(device) for parts in zip(*micro_batches, strict=True))
        optimizer.zero_grad()
        with autocast():  # the same autocast the distributed model runs under, if any
            loss = loss_fn(model(*inputs).float(), target)
        loss.backward()
        optimizer.step()
    return model


def max_abs_difference(model_a: torch.nn.Module, model_b: torch.nn.Module) -> float:
    """Largest |a - b| over all parameters, compared on the CPU in float32 (inf if either diverged)."""
    for param in (*model_a.parameters(), *model_b.parameters()):
        if not torch.isfinite(param).all():
            return float("inf")  # NaN would compare as "not <= tolerance" too, but inf says what happened
    return max(
        (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )
