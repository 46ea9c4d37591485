"""The single-process reference that distributed runs are compared with.

One step = the micro-batches of every rank for that step, concatenated (rank order), one mean loss over
all of those rows, one optimizer step. When every rank's shard has the same size, that is exactly
what DDP's averaged gradients compute, so parameters must agree up to float rounding.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F


def train_single_process(model: torch.nn.Module, global_batches, steps: int, micro_batches_per_step: int, lr: float,
                         device, autocast=nullcontext) -> torch.nn.Module:
    """SGD on `model` in place over `steps` steps of `micro_batches_per_step` global batches each."""
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        micro_batches = [next(global_batches) for _ in range(micro_batches_per_step)]
        x = torch.cat([b[0] for b in micro_batches]).to(device)
        y = torch.cat([b[1] for b in micro_batches]).to(device)
        optimizer.zero_grad()
        with autocast():  # the same autocast the distributed model runs under, if any
            loss = F.mse_loss(model(x).float(), y)
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
