"""The op model's kernels, measured (benchmarks/op_costs.py runs them on two ranks at once): a call's seconds, the
matmuls and attention kernels at the shapes the layouts run (as the fake ranks recorded them), an elementwise op's
bandwidth by size, each recorded op run again at its shapes, and the eager dispatch overheads."""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from planning.ops import replay

MEMORY_SIZES = [2**k for k in range(10, 27, 2)]  # elements of float32 per operand: 4 KB to 256 MB
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def seconds_per_call(fn, budget_s: float) -> float:
    """The median of 5 batches of calls, each at least budget_s / 5 (one call to warm up)."""
    fn()
    started, calls = time.perf_counter(), 0
    while time.perf_counter() - started < budget_s / 25 or calls < 3:
        fn()
        calls += 1
    per_batch = calls  # a batch: about budget_s / 25
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - started) / per_batch)
    return statistics.median(samples)


def gemm_gflops(shape: tuple[int, int, int], dtype: str, budget_s: float) -> float:
    m, k, n = shape
    a, b = torch.randn(m, k, dtype=DTYPES[dtype]), torch.randn(k, n, dtype=DTYPES[dtype])
    return 2 * m * k * n / seconds_per_call(lambda: torch.mm(a, b), budget_s) / 1e9


def attention_gflops(shape: tuple, dtype: str, budget_s: float) -> float:
    """(batch x heads, queries, keys, head width, causal, backward): the CPU flash kernel, as the ranks call it."""
    heads, queries, keys, width, causal, backward = shape
    q = torch.randn(1, heads, queries, width, dtype=DTYPES[dtype])
    k, v = (torch.randn(1, heads, keys, width, dtype=DTYPES[dtype]) for _ in range(2))
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = forward(q, k, v, 0.0, bool(causal))
    if backward:
        grad = torch.randn_like(out)
        run = lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(  # noqa: E731
            grad, q, k, v, out, lse, 0.0, bool(causal)
        )
    else:
        run = lambda: forward(q, k, v, 0.0, bool(causal))  # noqa: E731
    flops = 4.0 * heads * queries * keys * width * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    return flops / seconds_per_call(run, budget_s) / 1e9


def overheads_us(budget_s: float) -> dict:
    """Per op dispatched: an elementwise op on one element under autograd (a training step's forward records
    its graph), and a view. (A DTensor op's cost beyond its local op is measured on the model: dtensor_gaps.)"""
    a, b = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    op = seconds_per_call(lambda: a + b, budget_s)
    view = seconds_per_call(lambda: a.view(1, 1), budget_s)
    return {"op_overhead_us": round(op * 1e6, 2), "view_overhead_us": round(view * 1e6, 2)}


def memory_points(budget_s: float) -> list[dict]:
    """An elementwise add (reads two operands, writes one) by the bytes it moves; its dispatch (the same add of
    one element) taken out."""
    one, out_one = torch.ones(1), torch.empty(1)
    dispatch_s = seconds_per_call(lambda: torch.add(one, one, out=out_one), budget_s)
    points = []
    for size in MEMORY_SIZES:
        a, b, out = torch.randn(size), torch.randn(size), torch.empty(size)
        took = seconds_per_call(lambda: torch.add(a, b, out=out), budget_s)  # noqa: B023
        moved = 3 * 4 * size
        points.append({"bytes": moved, "gbps": round(moved / max(took - dispatch_s, 1e-9) / 1e9, 3)})
    return points


def replayed_seconds(calls: dict, timed: dict, budget_s: float) -> float:
    """A recorded phase's ops ({OpCall: count}) at the seconds the op model prices them: the timed table's, an op
    not in it timed now; views and allocations at nothing (what they cost is in the gap being measured)."""
    total = 0.0
    for call, count in calls.items():
        if call.kind == "view" or call.replay is None:
            continue
        key = repr(call.replay)
        if key not in timed:
            timed[key] = seconds_per_call(replay(call.replay), budget_s / 10)
        total += count * timed[key]
    return total


def timed_ops(replays: list, budget_s: float) -> dict:
    """Each recorded op run again at its shapes: {repr(replay): microseconds}; an op that cannot run again on
    fresh tensors (its values matter) is left to the model's rules."""
    timed = {}
    for spec in replays:
        try:
            timed[repr(spec)] = round(seconds_per_call(replay(spec), budget_s) * 1e6, 3)
        except Exception:  # noqa: BLE001 - any op may refuse made-up values; the rules price it instead
            continue
    return timed


def shapes_of(traced_ranks: list[dict]) -> dict:
    """The distinct matmul and attention shapes (with dtypes) the fake ranks recorded."""
    gemm, attention, replays = set(), set(), set()
    for rank in traced_ranks:
        for calls in rank["ops"]["calls"].values():
            for call, _ in calls:
                if call.replay is not None and call.kind != "view":
                    replays.add(call.replay)
                if call.kind == "gemm":
                    gemm.add((call.shape, call.dtype))
                elif call.kind == "attention":
                    attention.add(((*call.shape, int(call.causal), int(call.backward)), call.dtype))
    return {"gemm": sorted(gemm), "attention": sorted(attention), "replays": sorted(replays, key=repr)}
