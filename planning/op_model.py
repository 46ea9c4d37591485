"""What an op costs on one hardware profile: the op model that prices the ops a fake rank recorded
(planning/ops.py's OpCall).

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
import math
from dataclasses import dataclass

from planning.ops import OpCall


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
    # optimizer step (measured on the GPT: benchmarks/overhead_costs.eager_gaps)
    per_op_overhead_s: dict | None = None  # phase -> seconds per op
    per_byte_overhead_s: dict | None = None  # phase -> seconds per byte the phase's ops read and write
    step_overhead_s: float = 0.0
    # a GPU's GEMM kernels: the output tiles (rows, columns) one SM computes at a time, and the SMs; a GEMM runs in
    # waves of sm_count tiles, its last wave and its edge tiles partly idle (NVIDIA's Matrix Multiplication
    # Background guide, tile and wave quantization); none: every GEMM at the measured efficiency
    gemm_tiles: tuple = ()
    sm_count: int = 0

    def quantisation(self, m: int, n: int) -> float:
        """The share of the SMs' tile work a GEMM's (m x n) output uses, with the tile that uses most."""
        if not self.gemm_tiles or not self.sm_count:
            return 1.0
        best = 0.0
        for rows, cols in self.gemm_tiles:
            tiles = math.ceil(m / rows) * math.ceil(n / cols)
            waves = math.ceil(tiles / self.sm_count)
            best = max(best, m * n / (waves * self.sm_count * rows * cols))
        return best

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
            work /= self.quantisation(call.shape[0], call.shape[2])
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
        gemm_tiles=tuple(tuple(t) for t in spec.get("gemm_tiles", {}).get("value", ())),
        sm_count=spec.get("sm_count", {}).get("value", 0),
    )
