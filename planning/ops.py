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

`OpModel` prices an OpCall on one hardware profile (planning/hardware.yaml's `ops:`):
  gemm       FLOPs at the throughput measured for the nearest measured shape (this machine: timed at the shapes
             the layouts run), or at a fraction of the datasheet peak that a published measurement reached (GPUs);
  attention  its FLOPs (causal: the half under the mask; backward 2.5x the forward, FlashAttention-2's five
             matmuls against two) at the nearest measured shape's throughput, or a published fraction of peak;
  memory     every other op: the bytes it reads and writes at the bandwidth measured for that many bytes;
  dispatch   every op dispatched, and every DTensor op, costs its measured overhead (eager PyTorch on a CPU runs
             each op where it is issued; a GPU's launches are asynchronous and hide behind its kernels: 0 there);
             so do a DTensor redistribute and an FSDP unshard or reduce-scatter (its hooks' Python).
"""

from __future__ import annotations

import bisect
import contextlib
import math
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


def describe(func, args: tuple, kwargs: dict, result) -> OpCall | None:
    """The OpCall of one dispatched op, None for what is not a rank's work (collectives: their own model; prim
    ops: metadata)."""
    namespace, _, name = str(func.overloadpacket).partition(".")
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
        namespace, _, name = str(func.overloadpacket).partition(".")
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


# ---------------------------------------------------------------------------------------------- the op model
@dataclass(frozen=True)
class OpModel:
    """A hardware profile's `ops:` section (planning/hardware.yaml). Throughputs in FLOP/s, bandwidths in bytes/s.
    gemm_points and attention_points: (shape, dtype, FLOP/s) measured; else gemm_efficiency / attention_efficiency
    x the datasheet peak (each with its source in the profile). memory_points: (bytes moved, bytes/s) measured,
    sorted by bytes; else memory_efficiency x the datasheet bandwidth."""

    peak_flops: dict
    memory_bandwidth: float
    gemm_points: tuple = ()
    attention_points: tuple = ()
    memory_points: tuple = ()
    gemm_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    op_overhead_s: float = 0.0
    view_overhead_s: float = 0.0
    # a DTensor op beyond the local op it runs (sharding propagation, unwrapping, wrapping): phase -> seconds per
    # DTensor op forward and backward, per DTensor it takes in the optimizer step (a fused step takes them all)
    dtensor_overhead_s: dict | None = None
    redistribute_overhead_s: float = 0.0  # a change of a DTensor's placements, beyond the collective it sends
    fsdp_overhead_s: float = 0.0  # an FSDP unshard or reduce-scatter: its hooks' Python, beyond its ops
    # a functional collective called outside a redistribute (cp's gathers of K and V), with the Python of the
    # layer that calls it, beyond the collective and the ops
    functional_collective_overhead_s: float = 0.0
    measured_s: dict | None = (
        None  # repr(OpCall.replay) -> seconds: the op timed at that very shape (this machine)
    )
    # what a step costs beyond its ops one by one (nn.Module, autograd, the allocator, caches an op timed alone
    # finds warm): per op dispatched and per byte its ops move, in the forward and in the backward; and per
    # optimizer step (measured on the GPT: benchmarks/op_costs.eager_gaps)
    per_op_overhead_s: dict | None = None  # phase -> seconds per op
    per_byte_overhead_s: dict | None = None  # phase -> seconds per byte the phase's ops read and write
    step_overhead_s: float = 0.0

    def precision(self, dtype: str) -> str:
        return "bf16" if dtype in ("bfloat16", "float16") else "fp32"

    def throughput(self, points: tuple, shape: tuple, dtype: str, efficiency: float) -> float:
        """The FLOP/s of the measured point nearest `shape` in log space (same dtype), else efficiency x peak."""
        same = [p for p in points if p[1] == dtype and len(p[0]) == len(shape)]
        if not same:
            return efficiency * self.peak_flops[self.precision(dtype)]

        def distance(point) -> float:
            return sum(abs(math.log(max(a, 1) / max(b, 1))) for a, b in zip(point[0], shape, strict=True))

        return min(same, key=distance)[2]

    def bandwidth(self, moved: int) -> float:
        if not self.memory_points:
            return self.memory_efficiency * self.memory_bandwidth
        sizes = [p[0] for p in self.memory_points]
        i = bisect.bisect_left(sizes, moved)
        if i == 0 or i == len(sizes):
            return self.memory_points[min(i, len(sizes) - 1)][1]
        (s0, b0), (s1, b1) = self.memory_points[i - 1], self.memory_points[i]
        w = math.log(moved / s0) / math.log(s1 / s0)  # interpolated in log bytes
        return b0 + w * (b1 - b0)

    def seconds(self, call: OpCall) -> float:
        """One op: its work at the throughput it reaches, plus its dispatch."""
        if call.kind == "view":
            return self.view_overhead_s
        timed = (self.measured_s or {}).get(repr(call.replay)) if call.replay else None
        if timed is not None:  # its dispatch included
            return timed
        if call.kind == "gemm":
            work = call.flops / self.throughput(
                self.gemm_points, call.shape, call.dtype, self.gemm_efficiency
            )
            # a small matmul is memory-bound: never faster than its operands at the bandwidth
            work = max(work, call.bytes / self.bandwidth(call.bytes))
        elif call.kind == "attention":
            key = (*call.shape, int(call.causal), int(call.backward))
            work = call.flops / self.throughput(
                self.attention_points, key, call.dtype, self.attention_efficiency
            )
        else:
            work = call.bytes / self.bandwidth(call.bytes) if call.bytes else 0.0
        return work + self.op_overhead_s

    def dtensor_seconds(self, phase: str, dtensor_calls: int, dtensor_tensors: int) -> float:
        """DTensor's own cost in a phase: per DTensor op forward and backward, per DTensor taken in the step."""
        per = (self.dtensor_overhead_s or {}).get(phase, 0.0)
        return (dtensor_tensors if phase == "step" else dtensor_calls) * per

    def phase_seconds(
        self,
        phase: str,
        calls,
        dtensor_calls: int = 0,
        redistributes: int = 0,
        fsdp_events: int = 0,
        dtensor_tensors: int = 0,
        functional_collectives: int = 0,
        in_fsdp_hooks=(),
    ) -> float:
        """A phase's [(OpCall, count)], DTensor ops (and the DTensors they took), redistributes, FSDP's unshards
        and reduce-scatters and the functional collectives called outside a redistribute, priced one after another
        (one stream: eager order), with what the phase costs beyond its ops. `in_fsdp_hooks`: those of the calls
        FSDP2's hooks ran, priced at their own cost but not at the step's gap beyond its ops (beyond_ops_seconds:
        nn.Module's calls and autograd's graph, per op of the model): the hooks' Python is what an FSDP event
        costs (fsdp_overhead_s), measured with these ops so priced."""
        ops = (
            sum(count * self.seconds(call) for call, count in calls)
            + self.dtensor_seconds(phase, dtensor_calls, dtensor_tensors)
            + redistributes * self.redistribute_overhead_s
            + fsdp_events * self.fsdp_overhead_s
            + functional_collectives * self.functional_collective_overhead_s
        )
        beyond = self.beyond_ops_seconds(phase, calls) - self.beyond_ops_seconds(phase, in_fsdp_hooks)
        return ops + beyond + (self.step_overhead_s if phase == "step" else 0.0)

    def beyond_ops_seconds(self, phase: str, calls) -> float:
        """What a phase of [(OpCall, count)] costs beyond its ops timed one by one: per op, and per byte its ops
        move (a step at 4 rows a micro-batch paid ~1.7x the gap of the same step at 1 here, its op count alike)."""
        per_op = (self.per_op_overhead_s or {}).get(phase, 0.0)
        per_byte = (self.per_byte_overhead_s or {}).get(phase, 0.0)
        return sum(count * (per_op + per_byte * call.bytes) for call, count in calls)


def op_model_from(profile: dict, peak_flops: dict, memory_bandwidth: float) -> OpModel:
    """A profile's `ops:` mapping (units: GFLOP/s, GB/s, us) as an OpModel; a profile without one is the roofline
    at the datasheet's figures."""
    spec = profile.get("ops") or {}
    measured = None
    gaps = spec.get("eager_gaps") or {}
    dtensor_gaps = spec.get("dtensor_gaps") or {}
    table = spec.get("measured_ops")
    if table:  # {repr(replay): microseconds}, or the name of a JSON file of it beside planning/hardware.yaml
        import json
        from pathlib import Path

        if isinstance(table, str):
            table = json.loads((Path(__file__).parent / table).read_text())
        measured = {key: us * 1e-6 for key, us in table.items()}
    points = lambda key: tuple((tuple(p["shape"]), p["dtype"], p["gflops"] * 1e9) for p in spec.get(key, []))  # noqa: E731
    return OpModel(
        peak_flops,
        memory_bandwidth,
        gemm_points=points("gemm_points"),
        attention_points=points("attention_points"),
        memory_points=tuple(sorted((p["bytes"], p["gbps"] * 1e9) for p in spec.get("memory_points", []))),
        gemm_efficiency=spec.get("gemm_efficiency", {}).get("value", 1.0),
        attention_efficiency=spec.get("attention_efficiency", {}).get("value", 1.0),
        memory_efficiency=spec.get("memory_efficiency", {}).get("value", 1.0),
        op_overhead_s=spec.get("op_overhead_us", 0.0) * 1e-6,
        view_overhead_s=spec.get("view_overhead_us", 0.0) * 1e-6,
        dtensor_overhead_s={
            phase: dtensor_gaps.get(key, 0.0) * 1e-6
            for phase, key in (
                ("forward", "forward_us_per_op"),
                ("backward", "backward_us_per_op"),
                ("step", "step_us_per_tensor"),
            )
        },
        redistribute_overhead_s=spec.get("redistribute_overhead_us", 0.0) * 1e-6,
        fsdp_overhead_s=spec.get("fsdp_overhead_us", 0.0) * 1e-6,
        functional_collective_overhead_s=spec.get("functional_collective_overhead_us", 0.0) * 1e-6,
        measured_s=measured,
        per_op_overhead_s={
            phase: gaps.get(f"{phase}_us_per_op", 0.0) * 1e-6 for phase in ("forward", "backward")
        },
        per_byte_overhead_s={  # us per MB: 1e-12 s per byte
            phase: gaps.get(f"{phase}_us_per_mb", 0.0) * 1e-12 for phase in ("forward", "backward")
        },
        step_overhead_s=gaps.get("step_us", 0.0) * 1e-6,
    )
