"""Activation checkpointing, and what autograd keeps from a forward for its backward, counted.

A forward keeps tensors for the backward: a Linear its input, LayerNorm its input and statistics, GELU its
input, attention q, k, v and its output. Checkpointing a block keeps only what is needed to run it again:
  full       the block's input; backward runs the block's forward again (every matmul twice);
  selective  the block's input and the outputs of the expensive ops (matmuls, attention, tensor parallelism's
             collectives); backward recomputes only the cheap ones (LayerNorm, GELU, reshapes): torch's
             selective activation checkpointing.
Both are torch.utils.checkpoint, non-reentrant: the form FSDP2, DTensor and pipelining's backward all work
with, and the parameters keep their names (no wrapper module).

SavedActivations counts the bytes kept: every tensor autograd saves (its saved-tensor hooks, parameters
and their views left out: they are held anyway), plus what a checkpoint keeps for its recompute (its input;
under selective, the outputs its policy saves, seen as they are made). Each storage once.
"""

from __future__ import annotations

import contextvars
import functools

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

MODES = ("none", "full", "selective")
aten = torch.ops.aten
# the ops selective checkpointing saves the outputs of: matmuls and attention (CPU and GPU kernels)
SAVED_BY_SELECTIVE = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    # and what tensor parallelism's collectives return: recomputing them would send the bytes again
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
}
_COUNTING: contextvars.ContextVar[SavedActivations | None] = contextvars.ContextVar(
    "saved_activations", default=None
)


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def run_checkpointed(function, x: torch.Tensor, mode: str) -> torch.Tensor:
    """function(x) (a block's forward) under activation checkpointing `mode` ("none": plainly)."""
    if mode == "none" or not torch.is_grad_enabled():
        return function(x)
    counter = _COUNTING.get()
    if counter is not None:
        counter.add(x)  # the checkpoint keeps its input, to run the block again
    context_fn = noop_context_fn
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        if (
            counter is not None
        ):  # see what the policy saves as it is made (forward only: counting stops after)
            function = _seen_by(counter, function)
    return checkpoint(function, x, use_reentrant=False, context_fn=context_fn)


def _seen_by(counter: SavedActivations, function):
    def counted(x):
        with _OutputsOf(SAVED_BY_SELECTIVE, counter):
            return function(x)

    return counted


class _OutputsOf(TorchDispatchMode):
    """Counts the outputs of `ops` (inside a checkpoint: the selective policy's mode sees them next and saves them)."""

    def __init__(self, ops, counter: SavedActivations):
        super().__init__()
        self.ops, self.counter = ops, counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops and _COUNTING.get() is self.counter:
            for tensor in out if isinstance(out, tuple) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.counter.add(tensor)
        return out


class SavedActivations:
    """`with SavedActivations() as saved: loss = model(x, y)` then `saved.bytes`: what the forward kept for the
    backward (each storage once). Count a forward only: a backward's recomputes are not kept."""

    def __init__(self):
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def __enter__(self) -> SavedActivations:
        self._token = _COUNTING.set(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        _COUNTING.reset(self._token)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)):
            self.add(tensor)
        return tensor

    def add(self, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())
