"""A GPU run rehearsed on the CPU: the real code runs, with real numbers, while every tensor carries where it
would live on a GPU, and the first thing that would crash there fails the run here, in one line naming it.

On a CPU-only machine `accelerator.device` is the CPU, so a batch never moved to it, a reduction of a host
tensor over NCCL, or an autocast of the wrong device type all run fine, and the first GPU run crashes at step
1. With DIST_REHEARSAL=1 in the environment, common/config.run_cli runs the whole program under `rehearse()`
(tests/helpers' forked ranks and fault_tolerance's groups too), which tracks one fact per tensor, "on the host",
with GPU semantics:
- made on the host: a factory called without a device (torch.zeros(3), torch.tensor(list), from_numpy) or given
  a host tensor's own `.device`, `.cpu()` / `.to("cpu")` (a "cpu" written in the line), a file read by
  torch.load, an op whose tensor inputs all live there;
- on the device: `.to(device)` / a factory given any other spelling of the CPU (accelerator.device, a mesh's
  device type: a GPU run's is cuda), a module's `.to(device)`, whatever the frameworks make in C++ (DDP's
  buckets, autograd's gradients), anything computed from device tensors.
It fails on (RehearsalFailure, naming the op, the shapes and the project's lines that reached it):
- an op that mixes a host tensor with a device tensor (CUDA allows only 0-dim host tensors as scalars, host
  indices for indexing, and copies between the two);
- a collective given a host tensor (Accelerate's process group on GPUs is NCCL, which has no host tensors);
- an autocast API called with a literal device type ("cpu"): on a GPU it would cast nothing;
- a CPU-only kernel (`*_for_cpu`) called by name on device tensors: a GPU run fails there, after start-up.
And `planned_device_type()` (common/device.py) answers "cuda", so what a GPU run refuses before start-up is
refused here too. What it cannot see: speed, memory, NCCL's own behaviour (scripts/gpu_check.sh on a GPU).
"""

from __future__ import annotations

import collections
import contextlib
import linecache
import os
import re
import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from common.device import REHEARSAL_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RehearsalFailure(RuntimeError):
    """What would crash on a GPU."""


def enabled() -> bool:
    return os.environ.get(REHEARSAL_ENV, "") not in ("", "0", "false")


def rehearse_if_asked():
    """`rehearse()` when DIST_REHEARSAL is set, else nothing."""
    return rehearse() if enabled() else contextlib.nullcontext()


# Factories that take a device: made on the host unless given one.
FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye, torch.from_numpy, torch.empty_strided,
    torch.scalar_tensor, torch.frombuffer,
}  # fmt: skip
# Ops that may take host and device tensors together on CUDA: copies between them, host indices.
CROSS_DEVICE = {"copy_", "_copy_from", "_to_copy", "copy", "_foreach_copy_", "index", "index_put_",
                "_index_put_impl_", "lift_fresh", "_local_scalar_dense", "set_", "detach", "alias", "empty_like",
                "new_empty", "new_empty_strided", "_has_compatible_shallow_copy_type"}  # fmt: skip
DEVICE = torch.Tensor.device  # the property: a TorchFunctionMode sees its __get__
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")
LITERAL_AUTOCAST = re.compile(
    r"""(autocast\w*|get_autocast_dtype|set_autocast_\w+)\(\s*(device_type\s*=\s*)?["']"""
)


class Marks:
    """Which tensors live on the host (by identity; a DTensor by its local tensor)."""

    def __init__(self):
        self.host = WeakIdKeyDictionary()
        # the torch.device objects host tensors handed out (`x.device`, a new object each time): a factory or .to
        # given one makes a host tensor, as on a GPU. Held, so their ids stay theirs; the oldest dropped past a bound
        self.host_devices: collections.OrderedDict = collections.OrderedDict()

    def note_host_device(self, device) -> None:
        self.host_devices[id(device)] = device
        if len(self.host_devices) > 100_000:
            self.host_devices.popitem(last=False)

    def is_host(self, t: torch.Tensor) -> bool:
        local = getattr(t, "_local_tensor", None)
        return (local is not None and local in self.host) or t in self.host

    def set(self, t, on_host: bool) -> None:
        for tensor in (t, getattr(t, "_local_tensor", None)):
            if isinstance(tensor, torch.Tensor):
                if on_host:
                    self.host[tensor] = True
                else:
                    self.host.pop(tensor, None)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _where() -> str:
    """The project's three innermost frames that led here (file:line <- its caller ...), for the one line."""
    frames = [
        f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}"
        for frame in reversed(traceback.extract_stack(limit=80)[:-2])
        if frame.filename.startswith(ROOT) and frame.name not in ("__torch_dispatch__", "__torch_function__")
    ]
    return " <- ".join(frames[:3]) or "(framework code)"


def _called_by_name(op: str) -> bool:
    """Whether the Python line that reached `op` names it: a CPU-only kernel called directly (cp's attention), not
    one that a portable op (scaled_dot_product_attention) picked for CPU tensors, which on a GPU picks its own."""
    frame = sys._getframe(2)  # out through torch's frames (its op wrappers) and this file's, to the project's
    while frame is not None and (
        not frame.f_code.co_filename.startswith(ROOT) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    return frame is not None and op in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def _names_host(device, marks: Marks) -> bool:
    """Whether a device argument means the host on a GPU run too: a host tensor's own `.device`, or a "cpu" written
    in the calling line. Any other spelling of the CPU here is the run's device (accelerator.device, a mesh's
    device_type, a group's device), which a GPU run spells cuda."""
    if torch.device(device).type != "cpu":
        return False
    if id(device) in marks.host_devices:
        return True
    caller = sys._getframe(2)  # _names_host <- __torch_function__ <- the call's own line
    line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    return bool(re.search(r"""["']cpu["']|cpu_device""", line))


def _shape(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


class _Dispatch(TorchDispatchMode):
    """Every aten op, the frameworks' included: checks the mix, carries the mark to the outputs."""

    def __init__(self, marks: Marks):
        super().__init__()
        self.marks = marks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        host = [t for t in inputs if self.marks.is_host(t)]
        name = func.__name__.split(".")[0]
        namespace = func.namespace
        if host and namespace in COLLECTIVE_NAMESPACES and any(t.numel() for t in host):
            raise RehearsalFailure(f"rehearsal: {namespace}.{name} got a host tensor {_shape(host[0])} at {_where()}: "
                                   "a GPU run's process group (NCCL) takes device tensors only")  # fmt: skip
        device = [t for t in inputs if not self.marks.is_host(t)]
        if device and name.endswith(("_for_cpu", "_for_cpu_backward")) and _called_by_name(name):
            raise RehearsalFailure(f"rehearsal: aten.{name}, a CPU-only kernel, on a device tensor at {_where()}: a "
                                   "GPU run would fail here, after start-up (refuse it before)")  # fmt: skip
        if host and device and name not in CROSS_DEVICE and any(t.dim() > 0 for t in host):
            big = next(t for t in host if t.dim() > 0)
            raise RehearsalFailure(f"rehearsal: aten.{name} mixes a host tensor {_shape(big)} with a device tensor "
                                   f"{_shape(device[0])} at {_where()}: on a GPU this is a device mismatch")  # fmt: skip
        out = func(*args, **kwargs)
        if name.endswith("_"):
            return out  # in place (a copy_ included): the tensor written stays where it lives
        if name == "_to_copy" or name in ("lift_fresh", "detach", "alias", "empty_like"):
            on_host = bool(inputs) and self.marks.is_host(inputs[0])  # a dtype change keeps the place
        elif namespace == "aten" and not inputs:
            return out  # a factory's place is decided where it was called (_Function)
        else:
            # where the inputs live; a 0-dim one (a Python number made a tensor in C++) decides nothing
            deciding = [t for t in inputs if t.dim() > 0] or inputs
            on_host = all(self.marks.is_host(t) for t in deciding)
        for t in _tensors(out):
            self.marks.set(t, on_host)
        return out


class _Function(TorchFunctionMode):
    """Where a tensor is meant to go: factories, .to / .cpu / .cuda, a parameter's .data swapped."""

    def __init__(self, marks: Marks):
        super().__init__()
        self.marks = marks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            out = func(*args, **kwargs)
            device = kwargs.get("device")
            if device is None:
                on_host = torch.get_default_device().type == "cpu"
            else:
                on_host = _names_host(device, self.marks)
            if func is torch.from_numpy or func is torch.frombuffer:
                on_host = True
            self.marks.set(out, on_host)
            return out
        if getattr(func, "__self__", None) is DEVICE:  # x.device
            out = func(*args, **kwargs)
            if self.marks.is_host(args[0]):
                self.marks.note_host_device(out)
            return out
        name = getattr(func, "__name__", "")
        if name == "cpu" and args and isinstance(args[0], torch.Tensor):
            return self._moved(args[0], func(*args, **kwargs), True)
        if name == "cuda":
            out = func(*args, **kwargs)
            return self._moved(args[0], out, False)
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            target = kwargs.get(
                "device",
                next((a for a in args[1:] if isinstance(a, str | torch.device | torch.Tensor)), None),
            )
            out = func(*args, **kwargs)
            if target is None:
                return out  # a dtype: stays where it is
            if isinstance(target, torch.Tensor):
                return self._moved(args[0], out, self.marks.is_host(target))
            return self._moved(args[0], out, _names_host(target, self.marks))
        if name == "__set__" and args and isinstance(args[0], torch.Tensor) and len(args) == 2:
            out = func(*args, **kwargs)  # param.data = tensor: the parameter lives where the tensor does
            if isinstance(args[1], torch.Tensor):
                self.marks.set(args[0], self.marks.is_host(args[1]))
            return out
        return func(*args, **kwargs)

    def _moved(self, source, out, on_host: bool):
        if out is source and self.marks.is_host(source) != on_host:
            out = (
                source.detach().clone().requires_grad_(source.requires_grad) if source.is_leaf else source * 1
            )
        self.marks.set(out, on_host)
        return out


def _literal_autocast(api):
    """An autocast API that fails when the project calls it with a literal device type."""

    def checked(*args, **kwargs):
        caller = sys._getframe(1)
        if caller.f_code.co_filename.startswith(ROOT) and caller.f_code.co_filename != __file__:
            line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
            if LITERAL_AUTOCAST.search(line):
                where = f"{os.path.relpath(caller.f_code.co_filename, ROOT)}:{caller.f_lineno}"
                raise RehearsalFailure(f"rehearsal: {api.__name__} with a literal device type at {where}: on a GPU "
                                       "it would not apply to the run's tensors (use their device's type)")  # fmt: skip
        return api(*args, **kwargs)

    return checked


@contextlib.contextmanager
def rehearse():
    """Run the body as a GPU run would see its tensors (see the module docstring)."""
    marks = Marks()
    patched = {
        "is_autocast_enabled": torch.is_autocast_enabled,
        "get_autocast_dtype": torch.get_autocast_dtype,
    }
    autocast_init = torch.amp.autocast_mode.autocast.__init__
    for name, api in patched.items():
        setattr(torch, name, _literal_autocast(api))
    torch.amp.autocast_mode.autocast.__init__ = _literal_autocast(autocast_init)
    module_to = torch.nn.Module.to

    def to(module, *args, **kwargs):  # a module's tensors move with it (parameters keep their identity)
        out = module_to(module, *args, **kwargs)
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            on_host = _names_host(next((a for a in args if isinstance(a, str | torch.device)), device), marks)
            for tensor in [*module.parameters(), *module.buffers()]:
                marks.set(tensor, on_host)
        return out

    torch.nn.Module.to = to
    parameter_new = torch.nn.Parameter.__new__

    def new_parameter(cls, data=None, requires_grad=True):  # a Parameter lives where its data does
        out = parameter_new(cls, data, requires_grad)
        if isinstance(data, torch.Tensor):
            marks.set(out, marks.is_host(data))
        return out

    torch.nn.Parameter.__new__ = new_parameter
    torch_load = torch.load

    def load(*args, **kwargs):  # a file's tensors arrive on the host unless mapped elsewhere
        out = torch_load(*args, **kwargs)
        location = kwargs.get("map_location")
        if location is None or str(location).startswith("cpu"):
            for tensor in _tensors(out):
                marks.set(tensor, True)
        return out

    torch.load = load
    # the object collectives (all_gather_object...) stage on the group's device: "cpu" for gloo, the GPU for NCCL,
    # which is what every group of a GPU run is
    c10d = torch.distributed.distributed_c10d
    object_device = c10d._get_object_coll_device
    c10d._get_object_coll_device = lambda group=None: torch.device("cpu")
    try:
        with _Function(marks), _Dispatch(marks):
            yield marks
    finally:
        for name, api in patched.items():
            setattr(torch, name, api)
        torch.amp.autocast_mode.autocast.__init__ = autocast_init
        torch.nn.Module.to = module_to
        torch.nn.Parameter.__new__ = parameter_new
        torch.load = torch_load
        c10d._get_object_coll_device = object_device


def host_tensors(tree, marks: Marks) -> list:
    """The tensors of `tree` that live on the host (for tests)."""
    return [t for t in _tensors(tree) if marks.is_host(t)]
