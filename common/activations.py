"""What autograd keeps from a forward for its backward, counted (every layout's memory check and
benchmarks/activation_checkpointing.py; the checkpointing itself is strategies/activation_checkpointing.py).

SavedActivations counts the bytes kept: every tensor autograd saves (its saved-tensor hooks, parameters and
their views left out: they are held anyway), plus what a checkpoint keeps for its recompute (its input and,
under selective checkpointing, the outputs its policy saves: the checkpointing code adds them while a
counter is active, since a checkpoint's own saved-tensor hooks hide them from ours). Each storage once.
"""

from __future__ import annotations

import contextvars

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_COUNTING: contextvars.ContextVar[SavedActivations | None] = contextvars.ContextVar(
    "saved_activations", default=None
)


def active_counter() -> SavedActivations | None:
    """The SavedActivations counting right now, if any."""
    return _COUNTING.get()


class OutputsCounted(TorchDispatchMode):
    """Counts the outputs of `ops` into `counter` (inside a selective checkpoint: its policy's mode sees them
    next and saves them)."""

    def __init__(self, ops, counter: SavedActivations):
        super().__init__()
        self.ops, self.counter = ops, counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # wait_tensor returns the collective's output it waited for, counted already; a fake tensor's is a new
        # one (its schema declares no alias), which counted tp's every all-reduce twice at scale
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return out
        if func in self.ops and _COUNTING.get() is self.counter:
            for tensor in out if isinstance(out, tuple) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.counter.add(tensor)
        return out


class SavedActivations:
    """`with SavedActivations() as saved: loss = lm_loss(model(x), y)` then `saved.bytes`: what the forward
    kept for the backward (each storage once). Count a forward only: a backward's recomputes are not kept."""

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
        if isinstance(
            local, AsyncCollectiveTensor
        ):  # a collective's output not yet waited for: its own storage
            local = local.wait()
        storage = local.untyped_storage()
        # a fake tensor (experiments/at_scale.py) has no data pointer: its storage's own identity instead
        key = storage._cdata if isinstance(local, FakeTensor) else storage.data_ptr()
        self.storages[key] = storage.nbytes()

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())
