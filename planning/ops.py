"""The ops a step really runs, and what each costs on a hardware profile.

`OpRecorder` is a TorchDispatchMode: on a fake rank (planning/fake_ranks.py) it sees every aten op the rank's
real step dispatches, in eager PyTorch's order and decomposition: the matmuls at the rank's own shapes (tp's
shards, cp's chunks, pp's stage), attention's fused kernel, the norms, the casts, FSDP's copies into and out of
its all-gather buffers and into its reduce-scatter's (torch.ops.fsdp: memory-bound), the fused AdamW; and each
FSDP unshard and reduce-scatter is counted, as FSDP's Python around it (its hooks) is priced per event. Each op
is kept as an `OpCall` (its name, its tensors' shapes and dtype, its FLOPs and the bytes it reads and writes),
counted per phase of the step (forward, backward, step). What DTensor
dispatches (tp's and FSDP's parameters) is counted as well: each DTensor op costs its own dispatch on top of the
local op it runs. The op DTensor runs on fake tensors to learn an output's global shape (its sharding
propagation) is not the rank's work and is left out.

What each op costs on a hardware profile is planning/op_model.py's OpModel.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
# ops that allocate or describe and move no data (an allocation's cost is its dispatch)
ALLOCATIONS = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
               "alias", "_local_scalar_dense", "set_", "resize_", "is_same_size", "sym_size", "sym_stride",
               "sym_numel", "sym_storage_offset")  # fmt: skip
# the fake rank's own stand-ins for data (a real rank's batch comes from its loader, outside the step's time)
NOT_THE_STEP = ("randint",)
# FSDP2's ops (torch.ops.fsdp): rank work, memory-bound; the first and the last mark one of its events each (an
# unshard: its all-gather's copy in; a reduce-scatter: the gradients' chunks copied into its input)
FSDP_OPS = ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat")
FSDP_EVENTS = ("all_gather_copy_in", "chunk_cat")
# a functional collective's ops (torch.ops._c10d_functional) that are not a collective of their own: its wait, and
# the wrapping of its result for autograd
FUNCTIONAL_PLUMBING = ("wait_tensor", "_wrap_tensor_autograd")
# FlashAttention-2's backward runs five matmuls of the forward's size (Q K^T again, dV, dP, dQ, dK) against its two
BACKWARD_ATTENTION_FACTOR = 2.5


@dataclass(frozen=True)
class OpCall:
    """One op as a rank dispatches it: kind is gemm, attention, memory or view (views and allocations: no data
    moved); `shape` what its price looks up: (m, k, n) for a matmul (a batch's multiplied in), (batch x heads,
    queries, keys, head width) for attention."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    flops: float
    bytes: int
    causal: bool = False
    backward: bool = False
    replay: tuple | None = None  # (the op's qualified name, its arguments with each tensor as a TensorSpec)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


def replay_spec(func, args: tuple, kwargs: dict) -> tuple | None:
    """What `replay` needs to run the op again on fresh tensors of the same shapes; None if an argument is not
    plain data (a process group, a generator)."""

    def spec(x):
        if isinstance(x, torch.Tensor):
            return TensorSpec(tuple(x.shape), tuple(x.stride()), str(x.dtype).removeprefix("torch."))
        if isinstance(x, (list, tuple)):
            return tuple(spec(v) for v in x)
        if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):  # fmt: skip
            return x
        raise TypeError(type(x))

    try:
        return (func._schema.name.removeprefix("aten::"), func._overloadname, spec(args),
                tuple(sorted((k, spec(v)) for k, v in kwargs.items())))  # fmt: skip
    except TypeError:
        return None


def replay(spec: tuple):
    """A callable that runs the op `spec` describes on fresh tensors (floats random, integers and booleans 0: a
    valid index, a valid target), one thread's CPU."""
    name, overload, args, kwargs = spec

    def make(x):
        if isinstance(x, TensorSpec):
            dtype = getattr(torch, x.dtype)
            # the storage its strides reach, filled, then viewed (an expanded tensor's elements share memory)
            size = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride, strict=True)) if all(x.shape) else 0
            storage = torch.empty(size, dtype=dtype)
            storage = storage.normal_() if dtype.is_floating_point else storage.zero_()
            return storage.as_strided(x.shape, x.stride)
        if isinstance(x, tuple):
            return [make(v) for v in x]
        return x

    op = getattr(getattr(torch.ops.aten, name), overload)
    made_args, made_kwargs = [make(a) for a in args], {k: make(v) for k, v in kwargs}
    return lambda: op(*made_args, **made_kwargs)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def op_name(func) -> tuple[str, str]:
    """An op's namespace and name (aten, mm): the name is its OpCall's."""
    namespace, _, name = str(func.overloadpacket).partition(".")
    return namespace, name


def describe(func, args: tuple, kwargs: dict, result) -> OpCall | None:
    """The OpCall of one dispatched op, None for what is not a rank's work (collectives: their own model; prim
    ops: metadata)."""
    namespace, name = op_name(func)
    if not (namespace == "aten" or (namespace == "fsdp" and name in FSDP_OPS)) or name in NOT_THE_STEP:
        return None
    inputs, outputs = _tensors((args, kwargs)), _tensors(result)
    dtype = str((inputs or outputs or [torch.empty(0)])[0].dtype).removeprefix("torch.")
    schema = func._schema
    returns_alias = [r.alias_info for r in schema.returns]
    if name in ALLOCATIONS or (
        returns_alias and all(a is not None and not a.is_write for a in returns_alias)
    ):
        return OpCall(name, "view", dtype, (), 0.0, 0)
    moved = _bytes(inputs) + _bytes(outputs)
    if (
        not outputs
    ):  # an in-place op returning nothing (the fused AdamW): what it writes is its marked arguments
        named = dict(zip((a.name for a in schema.arguments), args, strict=False)) | (kwargs or {})
        moved += sum(_bytes(_tensors(named.get(a.name))) for a in schema.arguments
                     if a.alias_info is not None and a.alias_info.is_write)  # fmt: skip
    spec = replay_spec(func, args, kwargs) if namespace == "aten" else None
    if name in GEMMS:
        a, b = inputs[1:3] if name in ("addmm", "baddbmm") else inputs[:2]
        batch = a.shape[0] if a.dim() == 3 and b.dim() == 3 else 1
        m, k = a.shape[-2], a.shape[-1]
        n = b.shape[-1]
        return OpCall(name, "gemm", dtype, (batch * m, k, n), 2.0 * batch * m * k * n, moved, replay=spec)
    if "scaled_dot_product" in name:
        named = dict(zip((a.name for a in schema.arguments), args, strict=False)) | (kwargs or {})
        q, k = named["query"], named["key"]
        causal, backward = bool(named.get("is_causal", False)), name.endswith("_backward")
        heads, queries, keys, width = q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3]
        flops = 4.0 * heads * queries * keys * width * (0.5 if causal else 1.0)
        flops *= BACKWARD_ATTENTION_FACTOR if backward else 1.0
        return OpCall(
            name, "attention", dtype, (heads, queries, keys, width), flops, moved, causal, backward, spec
        )
    return OpCall(name, "memory", dtype, (), 0.0, moved, replay=spec)


class OpRecorder(TorchDispatchMode):
    """`with OpRecorder() as ops:` ... then `ops.calls[phase]` (a Counter of OpCall), `ops.dtensor_calls[phase]`
    (DTensor ops) and `ops.dtensor_tensors[phase]` (the DTensors they took), `ops.redistributes[phase]`,
    `ops.functional_collectives[phase]` (those called outside a redistribute: cp's gathers, ep's all-to-alls),
    `ops.fsdp_events[phase]` and `ops.in_fsdp_hooks[phase]` (those of the calls FSDP2's hooks ran); set
    `ops.phase` as the step moves on (forward, backward, step, clip). On fake tensors a scalar read (`.item()`)
    reads 1: they hold no data."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.calls: dict[str, Counter] = {}
        self.dtensor_calls: Counter = Counter()
        self.dtensor_tensors: Counter = Counter()
        self.redistributes: Counter = Counter()
        self.functional_collectives: Counter = Counter()
        self._in_redistribute = 0
        self.fsdp_events: Counter = Counter()
        # the ops FSDP2's hooks run (inside its record_function regions, "FSDP::..."): a launch's DDP, whose
        # reducer is C++, runs none of them where a fake rank's replicate (FSDP2's machinery) does
        self.in_fsdp_hooks: dict[str, Counter] = {}
        self._regions: list[bool] = []  # the open record_function regions: FSDP's or not
        self._propagating = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        if any(
            t not in (torch.Tensor, FakeTensor) for t in types
        ):  # a DTensor op: it runs local ops, seen next
            if not self._propagating:
                self.dtensor_calls[self.phase] += 1
                # a fused optimizer's one op takes every parameter, gradient and moment: DTensor unwraps each
                self.dtensor_tensors[self.phase] += sum(
                    type(t) not in (torch.Tensor, FakeTensor)
                    for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)
                )
            return NotImplemented
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            # a fake tensor holds no data: a scalar read (.item(): the clipping's norm, an MoE's loads) reads 1
            result = 1.0 if args[0].dtype.is_floating_point else 1
        else:
            result = func(*args, **kwargs)
        namespace, name = op_name(func)
        if namespace == "_c10d_functional" and name not in FUNCTIONAL_PLUMBING:
            if not (self._propagating or self._in_redistribute):
                self.functional_collectives[self.phase] += 1
        if func is torch.ops.profiler._record_function_enter_new.default:
            self._regions.append(str(args[0]).startswith("FSDP::"))
        elif func.overloadpacket is torch.ops.profiler._record_function_exit and self._regions:
            self._regions.pop()
        if not self._propagating:
            call = describe(func, args, kwargs, result)
            if call is not None:
                self.calls.setdefault(self.phase, Counter())[call] += 1
                if any(self._regions):
                    self.in_fsdp_hooks.setdefault(self.phase, Counter())[call] += 1
                if call.name in FSDP_EVENTS and str(func.overloadpacket).startswith("fsdp."):
                    self.fsdp_events[self.phase] += 1
        return result

    @contextlib.contextmanager
    def _quiet_during_sharding_propagation(self):
        """DTensor learns an op's output shape by running it on fake global tensors (ShardingPropagator's
        _propagate_tensor_meta_non_cached, private): not the rank's work, so not recorded."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(propagator, *args, **kwargs):
            self._propagating += 1
            try:
                return original(propagator, *args, **kwargs)
            finally:
                self._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = original

    @contextlib.contextmanager
    def _counting_redistributes(self):
        """Each change of a DTensor's placements (tp's gathers and splits, FSDP's none) runs DTensor's
        redistribute_local_tensor: Python that plans the change on top of the collective it may send (private;
        imported by name in three modules, so patched in each)."""
        from torch.distributed.tensor import _api, _dispatch, _redistribute

        modules = [m for m in (_redistribute, _api, _dispatch) if hasattr(m, "redistribute_local_tensor")]
        original = _redistribute.redistribute_local_tensor

        def redistribute(*args, **kwargs):
            if not self._propagating:
                self.redistributes[self.phase] += 1
            self._in_redistribute += 1  # its functional collective is priced in the redistribute's overhead
            try:
                return original(*args, **kwargs)
            finally:
                self._in_redistribute -= 1

        for module in modules:
            module.redistribute_local_tensor = redistribute
        try:
            yield
        finally:
            for module in modules:
                module.redistribute_local_tensor = original

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._quiet_during_sharding_propagation())
        self._stack.enter_context(self._counting_redistributes())
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()

    def summary(self) -> dict:
        """What a fake rank sends back: per phase, [(OpCall, count)], the DTensor ops, the redistributes and FSDP's
        events."""
        return {"calls": {phase: list(calls.items()) for phase, calls in self.calls.items()},
                "dtensor_calls": dict(self.dtensor_calls), "dtensor_tensors": dict(self.dtensor_tensors),
                "redistributes": dict(self.redistributes),
                "functional_collectives": dict(self.functional_collectives), "fsdp_events": dict(self.fsdp_events),
                "in_fsdp_hooks": {phase: list(calls.items()) for phase, calls in self.in_fsdp_hooks.items()}}  # fmt: skip
