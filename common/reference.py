"""The single-process reference that distributed runs are compared with, and the comparison.

One step = the micro-batches of every rank for that step, concatenated (rank order), one mean loss over
all of those rows, one optimizer step. When every rank's shard has the same size, that is exactly what
data parallelism's averaged gradients compute, so parameters must agree up to float rounding. Every
experiment that proves itself against one process uses this one: ddp_linear, manual_data_parallel,
train_gpt (AdamW, clipping, a schedule, bf16), loss_normalization (padded tokens), pipeline_parallel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext

import torch
import torch.nn.functional as F


def mean_squared_error(model, inputs, target):
    return F.mse_loss(model(inputs).float(), target)


def train_single_process(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    global_batches,
    steps: int,
    micro_batches_per_step: int = 1,
    loss_fn: Callable = mean_squared_error,
    device=None,
    autocast=nullcontext,
    before_update: Callable[[int], float] | None = None,
    accumulate: bool = False,
    exact_shares: int = 0,
) -> dict:
    """Train `model` in place for `steps` steps: each concatenates `micro_batches_per_step` global batches
    (tuples of tensors: inputs first, target last) into ONE batch, one loss over all of it
    (`loss_fn(model, *inputs, target)`, a mean over the batch as the distributed run's is), one optimizer
    step. `before_update(i)` (i = 1, 2, ...) runs between backward and the step (clipping, the learning
    rate) and returns a figure (the gradient norm). `autocast`: the context the distributed model runs
    its forward under, if any. `accumulate`: each global batch its own forward and backward (its loss / the
    batches a step), for a loss that is not a mean over rows (a mixture of experts' balancing loss, a product of
    means: the distributed run computes it per global micro-batch). `exact_shares`: exact accumulation over that many
    data-parallel ranks (strategies/job.py): each global batch cut into their shares, each share's gradient (its
    loss / every share of the step) on its own, a batch's shares summed in float64 and rounded to float32 (what
    FSDP's float64 reduce-scatter hands a shard), the batches added in float64 and rounded once. Returns each
    step's loss and figure, and step 1's gradients by name."""
    device = torch.device("cpu") if device is None else device
    model.to(device)
    losses, figures, first_gradients = [], [], {}
    for step in range(1, steps + 1):
        micro_batches = [next(global_batches) for _ in range(micro_batches_per_step)]
        optimizer.zero_grad()
        if exact_shares:
            loss = exact_accumulation(model, micro_batches, exact_shares, loss_fn, device, autocast)
        elif accumulate:
            micro_losses = []
            for micro_batch in micro_batches:
                *inputs, target = (part.to(device) for part in micro_batch)
                with autocast():
                    micro_loss = loss_fn(model, *inputs, target)
                (micro_loss / micro_batches_per_step).backward()
                micro_losses.append(micro_loss.detach())
            loss = torch.stack(micro_losses).mean()  # equal micro-batches: the step's mean loss
        else:
            *inputs, target = (torch.cat(parts).to(device) for parts in zip(*micro_batches, strict=True))
            with autocast():
                loss = loss_fn(model, *inputs, target)
            loss.backward()
        if step == 1:
            first_gradients = {
                n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None
            }
        figure = before_update(step) if before_update else None
        figures.append(figure.item() if torch.is_tensor(figure) else figure)
        optimizer.step()
        losses.append(loss.item())
    optimizer.zero_grad()
    return {"losses": losses, "figures": figures, "first_gradients": first_gradients}


def exact_accumulation(model, micro_batches, shares: int, loss_fn, device, autocast) -> torch.Tensor:
    """train_single_process's `exact_shares`: the gradients left in the parameters, the step's mean loss returned."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    divisor, total, losses = len(micro_batches) * shares, None, []
    for micro_batch in micro_batches:
        unit = None
        for share in range(shares):
            rows = len(micro_batch[0]) // shares
            *inputs, target = (part[share * rows : (share + 1) * rows].to(device) for part in micro_batch)
            for p in parameters:
                p.grad = None
            with autocast():
                loss = loss_fn(model, *inputs, target)
            (loss / divisor).backward()
            gradients = torch.cat([p.grad.reshape(-1) for p in parameters]).double()
            unit = gradients if unit is None else unit + gradients
            losses.append(loss.detach())
        total = unit.float().double() if total is None else total + unit.float().double()
    offset = 0
    for p in parameters:
        p.grad = total[offset : offset + p.numel()].view_as(p).float()
        offset += p.numel()
    return torch.stack(losses).mean()


def named_tensors(source) -> dict:
    """A module's parameters by name, or a mapping of name -> tensor as it is."""
    return dict(source.named_parameters()) if isinstance(source, torch.nn.Module) else dict(source)


def max_abs_difference(a: torch.nn.Module | Mapping, b: torch.nn.Module | Mapping) -> float:
    """Largest |a - b| over the tensors (parameters) of `b`, by name, compared on the CPU in float32; inf
    if either side holds a non-finite value (NaN would compare as "not <= tolerance" too, but inf says
    what happened)."""
    return furthest(a, b)[1]


def furthest(a: torch.nn.Module | Mapping, b: torch.nn.Module | Mapping) -> tuple[str, float]:
    """(the name of the tensor of `b` furthest from `a`'s, its largest |a - b|): max_abs_difference, and where."""
    a, b = named_tensors(a), named_tensors(b)
    for name, tensor in (*a.items(), *b.items()):
        if not torch.isfinite(tensor.detach().float()).all():
            return name, float("inf")
    return max(((n, (a[n].detach().float().cpu() - b[n].detach().float().cpu()).abs().max().item()) for n in b),
               key=lambda pair: pair[1])  # fmt: skip
