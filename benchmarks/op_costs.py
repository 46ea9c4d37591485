"""This machine's op model (planning/op_model.py's OpModel), measured: the matmuls and attention kernels at the shapes the
layouts run (as the fake ranks recorded them), an elementwise op's bandwidth by size, and what eager PyTorch and
DTensor cost per op dispatched, and gloo's collectives as a step issues them. Measured as the ranks run: two
ranks under torchrun (benchmarks/workers.spawn), one thread each, so the two share the cores, the caches and the
memory bus as two ranks of a layout do. benchmarks/at_scale_calibration.py calls `measure_this_machine` and writes
the result into the this_machine profile.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.workers import benchmark_parser, run_worker, scratch_folder, spawn, write_result
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


def measure(spec: dict) -> dict:
    """One rank's measurement of `spec` ({gemm: [(shape, dtype)], attention: [(shape, dtype)], replays, budget_s,
    model_shape, rows}), one thread. What a step costs beyond its ops is measured last, its ops priced by the
    table just timed (the prediction's own prices), the ranks starting together (as a layout's ranks run)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    budget = spec["budget_s"]
    figures = {
        **overheads_us(budget),
        "memory_points": memory_points(budget),
        "gemm_points": [
            {"shape": list(shape), "dtype": dtype, "gflops": round(gemm_gflops(shape, dtype, budget), 3)}
            for shape, dtype in spec["gemm"]
        ],  # fmt: skip
        "attention_points": [
            {"shape": list(shape), "dtype": dtype, "gflops": round(attention_gflops(shape, dtype, budget), 3)}
            for shape, dtype in spec["attention"]
        ],  # fmt: skip
        "measured_ops": timed_ops(spec["replays"], budget / 10),
        "eager_gaps": {},
    }
    if spec.get("model_shape"):
        timed = {key: us * 1e-6 for key, us in figures["measured_ops"].items()}
        dist.barrier()
        figures["eager_gaps"] = eager_gaps(spec["model_shape"], spec["rows"], budget, timed)
        dist.barrier()
        figures["redistribute_overhead_us"] = redistribute_overhead_us(budget, figures, timed)
        dist.barrier()
        figures["dtensor_gaps"] = dtensor_gaps(spec["model_shape"], spec["rows"], budget, figures, timed)
        dist.barrier()
        figures["fsdp_overhead_us"] = fsdp_overhead_us(
            spec["model_shape"], spec["rows"], budget, figures, timed
        )
        dist.barrier()
        figures["functional_collective_overhead_us"] = functional_collective_overhead_us(
            spec["model_shape"], spec["rows"], budget, figures, timed
        )
        dist.barrier()
        figures["shared_core_ratio"] = shared_core_ratio(spec["model_shape"], spec["rows"])
    return figures


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


def merged(results: list[dict]) -> dict:
    """Two ranks' measurements as one: each figure their mean (an op either rank could not run: left out)."""
    mean = lambda key: round((results[0][key] + results[1][key]) / 2, 2)  # noqa: E731
    figures = {key: mean(key) for key in ("op_overhead_us", "view_overhead_us", "redistribute_overhead_us",
                                          "fsdp_overhead_us", "functional_collective_overhead_us",
                                          "shared_core_ratio") if key in results[0]}  # fmt: skip
    figures["dtensor_gaps"] = {
        k: round((v + results[1]["dtensor_gaps"][k]) / 2, 2)
        for k, v in results[0].get("dtensor_gaps", {}).items()
    }
    figures["eager_gaps"] = {}  # none without a model to step
    if "points" in results[0].get("eager_gaps", {}):  # the two ranks' points averaged, then fitted
        points = {phase: [{**p, "beyond_us": round((p["beyond_us"] + q["beyond_us"]) / 2, 2)}
                          for p, q in zip(ranks_points, results[1]["eager_gaps"]["points"][phase], strict=True)]
                  for phase, ranks_points in results[0]["eager_gaps"]["points"].items()}  # fmt: skip
        figures["eager_gaps"] = {**gaps_of(points), "points": points}
    both = results[0]["measured_ops"].keys() & results[1]["measured_ops"].keys()
    figures["measured_ops"] = {k: round((results[0]["measured_ops"][k] + results[1]["measured_ops"][k]) / 2, 3)
                              for k in sorted(both)}  # fmt: skip
    for key, field in (("memory_points", "gbps"), ("gemm_points", "gflops"), ("attention_points", "gflops")):
        figures[key] = [
            {**p, field: round((p[field] + q[field]) / 2, 3)}
            for p, q in zip(results[0][key], results[1][key], strict=False)
        ]
    return figures


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


# ------------------------------------------------------------------------ what the ops alone do not explain
def gpt_step(model_shape: dict, rows: int):
    """The GPT of `model_shape` (seed 0) and a step of it on `rows` x its block of random tokens: forward, backward,
    AdamW. The step (`step(recorder=None)`) sets the recorder's phase as it goes (forward, backward, step) and
    returns each phase's seconds."""
    from common.gpt import GPT, GPTConfig, adamw, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_shape))
    optimizer = adamw(list(model.parameters()), 3e-4, 0.1)
    ids = torch.randint(0, model_shape["vocab_size"], (rows, model_shape["block_size"]))

    def step(recorder=None) -> tuple[float, float, float]:
        started = time.perf_counter()
        if recorder:
            recorder.phase = "forward"
        loss = lm_loss(model(ids), ids)
        forward_done = time.perf_counter()
        if recorder:
            recorder.phase = "backward"
        loss.backward()
        backward_done = time.perf_counter()
        if recorder:
            recorder.phase = "step"
        optimizer.step()
        optimizer.zero_grad()
        return forward_done - started, backward_done - forward_done, time.perf_counter() - backward_done

    return step


def eager_gaps(model_shape: dict, rows: int, budget_s: float, timed: dict) -> dict:
    """What a real step of one process costs beyond its ops run one by one: the GPT of `model_shape` at `rows` x
    its block of tokens and at a quarter of the rows (what a pipeline's micro-batch runs here), a step of each in
    turn (median of 20 each: the VM's drift falls on both alike), its forward, backward and AdamW step timed, its
    ops recorded and priced as the op model prices them (`timed`: the table of timed ops, seconds). Per phase,
    forward and backward, what it took beyond them, fitted over the two sizes as per op dispatched (nn.Module's
    calls, autograd's graph) and per byte its ops move (the allocator, and the caches an op timed alone finds warm:
    at 4 rows a step paid ~1.7x the gap it paid at 1, the same 170 ops forward; priced per op alone, a pipeline's
    micro-batches were over-predicted); the optimizer's step beyond its ops, per step."""
    from planning.ops import OpRecorder

    sizes = sorted({rows, max(1, rows // 4)})
    steps = {size: gpt_step(model_shape, size) for size in sizes}
    for step in steps.values():
        for _ in range(3):
            step()
    took: dict = {size: [] for size in sizes}
    for _ in range(20):
        for size, step in steps.items():
            took[size].append(step())
    recorders = {}
    for size, step in steps.items():
        with OpRecorder() as recorders[size]:
            step(recorders[size])
    points = {}
    for i, phase in enumerate(("forward", "backward", "step")):
        points[phase] = []
        for size in sizes:
            calls = recorders[size].calls.get(phase, {})
            beyond = statistics.median(t[i] for t in took[size]) - replayed_seconds(calls, timed, budget_s)
            points[phase].append({"ops": sum(calls.values()), "bytes": sum(c * call.bytes for call, c in calls.items()),
                                  "beyond_us": round(beyond * 1e6, 2)})  # fmt: skip
    return {**gaps_of(points), "points": points}


def gaps_of(points: dict) -> dict:
    """eager_gaps' figures from its points (per phase, per size: the ops, the bytes they move, the seconds beyond
    them): forward and backward fitted per op and per byte, the optimizer's step per step. Fitted after the points
    are combined (two ranks' mean, rounds' median), not each figure apart: the two are solved together, and a
    median of each apart need not go through any round's points (at the workload's rows, the one a layout runs)."""
    gaps = {}
    for phase in ("forward", "backward"):
        (few_point, *_, point) = points[phase]
        ops_few, bytes_few, few = few_point["ops"], few_point["bytes"], few_point["beyond_us"] * 1e-6
        ops, moved, beyond = point["ops"], point["bytes"], point["beyond_us"] * 1e-6
        # two sizes, two unknowns: per op and per byte; one size (rows 1), or noise that makes either negative:
        # per op alone
        determinant = ops_few * moved - ops * bytes_few
        per_op, per_byte = beyond / ops, 0.0
        if determinant > 0:
            solved = (
                (few * moved - beyond * bytes_few) / determinant,
                (ops_few * beyond - ops * few) / determinant,
            )
            if min(solved) >= 0:
                per_op, per_byte = solved
        gaps[f"{phase}_us_per_op"] = round(per_op * 1e6, 2)
        gaps[f"{phase}_us_per_mb"] = round(per_byte * 1e12, 2)
    gaps["step_us"] = points["step"][-1]["beyond_us"]
    return gaps


def beyond_its_ops(step, baseline, budget_s: float, figures: dict, timed: dict):
    """What `step` costs beyond `baseline` (the same model without the piece measured) and beyond the ops it adds:
    each a step (`step(recorder)` sets the recorder's phase as it goes and returns each phase's seconds), timed in
    turn (median of 20 each: the VM's drift, tens of percent within a minute, falls on both alike), less the
    difference of their ops as the op model prices them (the timed table, an op no replay can run by its bytes,
    each op's eager gap but FSDP's hook ops', each DTensor op's dispatch as far as dtensor_gaps is measured):
    ({phase: those seconds}, the recorder of one step)."""
    from planning.op_model import op_model_from
    from planning.ops import OpRecorder

    # the op model of the figures measured so far: ops no replay can run priced by their bytes, each op's eager
    # gap, DTensor's cost
    keys = ("memory_points", "op_overhead_us", "dtensor_gaps", "eager_gaps")
    model = op_model_from({"ops": {key: figures[key] for key in keys if key in figures}}, {"fp32": 1.0}, 1.0)

    def priced(recorder, phase: str) -> float:
        calls = recorder.calls.get(phase, {})
        return (
            replayed_seconds(calls, timed, budget_s)
            + sum(count * model.seconds(call) for call, count in calls.items() if call.replay is None
                  and call.kind != "view")
            + model.beyond_ops_seconds(phase, calls.items())
            # FSDP's hook ops run outside nn.Module and autograd: not the step's gap (OpModel.phase_seconds)
            - model.beyond_ops_seconds(phase, recorder.in_fsdp_hooks.get(phase, {}).items())
            + model.dtensor_seconds(phase, recorder.dtensor_calls[phase], recorder.dtensor_tensors[phase])
        )  # fmt: skip

    # the fake group's collectives leave their outputs as they found them (uninitialised memory): its denormal
    # floats slowed one rank's ops ten-fold (measured), so they are flushed to zero while this is timed
    torch.set_flush_denormal(True)
    took: dict = {step: [], baseline: []}
    try:
        for run in (step, baseline):
            for _ in range(3):
                run()
        for _ in range(20):
            for run in (step, baseline):
                took[run].append(run())
    finally:
        torch.set_flush_denormal(False)
    recorded = {}
    for run in (step, baseline):
        with OpRecorder() as recorded[run]:
            run(recorded[run])
    left = {}
    for phase in took[step][0]:
        measured = statistics.median(t[phase] for t in took[step]) - statistics.median(
            t[phase] for t in took[baseline]
        )
        left[phase] = max(measured - (priced(recorded[step], phase) - priced(recorded[baseline], phase)), 0.0)
    return left, recorded[step]


def stepping(loss_of):
    """A step for beyond_its_ops: `loss_of()`'s forward, then its backward (the recorder's phase set between);
    returns {forward, backward: seconds}."""

    def step(recorder=None) -> dict:
        started = time.perf_counter()
        loss = loss_of()
        forward_done = time.perf_counter()
        if recorder:
            recorder.phase = "backward"
        loss.backward()
        return {"forward": forward_done - started, "backward": time.perf_counter() - forward_done}

    return step


def fake_group_mesh():
    """A 1-D mesh over the launch's ranks on a fake process group: every collective returns at once."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - registers the "fake" backend

    return DeviceMesh.from_group(
        dist.new_group(ranks=list(range(dist.get_world_size())), backend="fake"), "cpu"
    )


def redistribute_overhead_us(budget_s: float, figures: dict, timed: dict) -> float:
    """What one DTensor redistribute costs beyond the collective it sends (tp's gathers and reductions: Python
    that plans the change of placements, the functional collective and its wait): tensor parallelism's MLP
    (column-wise, then row-wise, as strategies/tp.py shards a block) on a fake process group over the launch's
    ranks, where every collective returns at once: what its forward and backward take beyond the same MLP
    unsharded and beyond their ops (beyond_its_ops), per redistribute."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    width = 128
    mlp, plain = (torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                      torch.nn.Linear(4 * width, width)) for _ in range(2))  # fmt: skip
    parallelize_module(mlp, fake_group_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(256, width)

    left, recorder = beyond_its_ops(stepping(lambda: mlp(x).sum()), stepping(lambda: plain(x).sum()),
                                    budget_s, figures, timed)  # fmt: skip
    return round(sum(left.values()) / sum(recorder.redistributes.values()) * 1e6, 2)


def dtensor_gaps(model_shape: dict, rows: int, budget_s: float, figures: dict, timed: dict) -> dict:
    """What a DTensor op costs beyond the local op it runs (sharding propagation, unwrapping and wrapping: Python),
    measured on the model, not on one add: the GPT of `model_shape` split by tensor parallelism as strategies/tp.py
    splits it, on a fake process group over the launch's ranks, against the same GPT unsharded (beyond_its_ops:
    beyond their ops and the redistributes, priced at redistribute_overhead_us), per DTensor op of its forward and
    of its backward; and AdamW's step over its parameters against the same step over plain tensors of their local
    shapes, per DTensor the step's ops take (a fused step is one op over every parameter, gradient and moment:
    DTensor unwraps each, ~40 us a parameter here, measured from 8 to 64 parameters). An add of two one-element
    DTensors took 12 us beyond the add; this GPT's forward ~100 us an op, its backward ~40."""
    from types import SimpleNamespace

    from common.gpt import GPT, GPTConfig, adamw, lm_loss
    from strategies import tp

    torch.manual_seed(0)
    model, plain = GPT(GPTConfig(**model_shape)), GPT(GPTConfig(**model_shape))
    tp.apply(model, fake_group_mesh(), SimpleNamespace(sequence_parallel=False, wrong_variant=""))
    ids = torch.randint(0, model_shape["vocab_size"], (rows, model_shape["block_size"]))
    redistribute_s = figures.get("redistribute_overhead_us", 0.0) * 1e-6

    left, recorder = beyond_its_ops(stepping(lambda: lm_loss(model(ids), ids)),
                                    stepping(lambda: lm_loss(plain(ids), ids)), budget_s, figures, timed)  # fmt: skip
    gaps = {
        f"{phase}_us_per_op": round(
            max(left[phase] - recorder.redistributes[phase] * redistribute_s, 0.0)
            / recorder.dtensor_calls[phase]
            * 1e6,
            2,
        )
        for phase in ("forward", "backward")
    }
    # the step: the same parameters as plain tensors of their local shapes, gradients alike
    local = [torch.nn.Parameter(p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone())
             for p in model.parameters()]  # fmt: skip
    for param in local:
        param.grad = torch.randn_like(param)
    left, recorder = beyond_its_ops(optimizer_stepping(adamw(list(model.parameters()), 3e-4, 0.1)),
                                    optimizer_stepping(adamw(local, 3e-4, 0.1)), budget_s, figures, timed)  # fmt: skip
    gaps["step_us_per_tensor"] = round(left["step"] / recorder.dtensor_tensors["step"] * 1e6, 2)
    return gaps


def optimizer_stepping(optimizer):
    """A step for beyond_its_ops: one `optimizer.step()` (on the gradients already there); {step: seconds}."""

    def step(recorder=None) -> dict:
        if recorder:
            recorder.phase = "step"
        started = time.perf_counter()
        optimizer.step()
        return {"step": time.perf_counter() - started}

    return step


def fsdp_overhead_us(model_shape: dict, rows: int, budget_s: float, figures: dict, timed: dict) -> float:
    """What one FSDP event (an unshard, a reduce-scatter) costs beyond its ops: FSDP2's hooks, Python that plans
    each all-gather and reduce-scatter and moves the unit between its sharded and unsharded parameters (in a
    py-spy profile of one fsdp rank of the calibration's GPT on a fake process group, 30 % of the step). The GPT
    of `model_shape` (rows x its block of tokens), as eager_gaps runs it, each block fully_shard-ed and the whole
    once more as strategies/shard.py wraps it, on a fake process group over the launch's ranks: what its forward
    and backward take beyond the same GPT unsharded and beyond their ops (beyond_its_ops: FSDP's copies priced by
    their bytes), per event. Blocks of small MLPs cost 0.5 ms an event, whether a unit held 2 or 9 parameters
    (one process: 6.1-7.1 against 7.3-8.3 ms over 12 events); this GPT's, 0.9-1.5 ms."""
    from torch.distributed.fsdp import fully_shard

    from common.gpt import GPT, GPTConfig, lm_loss

    mesh = fake_group_mesh()
    torch.manual_seed(0)
    model, plain = GPT(GPTConfig(**model_shape)), GPT(GPTConfig(**model_shape))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, model_shape["vocab_size"], (rows, model_shape["block_size"]))

    left, recorder = beyond_its_ops(stepping(lambda: lm_loss(model(ids), ids)),
                                    stepping(lambda: lm_loss(plain(ids), ids)), budget_s, figures, timed)  # fmt: skip
    return round(sum(left.values()) / sum(recorder.fsdp_events.values()) * 1e6, 2)


def functional_collective_overhead_us(model_shape: dict, rows: int, budget_s: float, figures: dict,
                                      timed: dict) -> float:  # fmt: skip
    """What one functional collective called outside a redistribute costs beyond its collective and the ops: cp's
    all-gathers of K and V (their autograd wrapping and wait, the reduce-scatter of their backward) with the
    Python of the attention around them (its plan of chunks, its own autograd Function). The GPT of `model_shape`,
    its attention split by context parallelism as strategies/cp.py splits it over the launch's ranks, on a fake
    process group, against the same GPT on the same rank's tokens (rows x block / ranks), beyond their ops
    (beyond_its_ops), per functional collective. A gather of 64 KB and its backward took 161 us beyond a local
    cat's here; cp's 4-block GPT, ~1 ms forward beyond its ops over its 8 gathers, ~0.05 backward over 8."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from common.gpt import GPT, GPTConfig, lm_loss
    from strategies import cp
    from strategies.layout import Layout

    ranks, block = dist.get_world_size(), model_shape["block_size"]
    if block % ranks:
        return 0.0  # no split of this block over the ranks: nothing to measure (the figure prices nothing)
    torch.manual_seed(0)
    model, plain = GPT(GPTConfig(**model_shape)), GPT(GPTConfig(**model_shape))
    balanced = block % (2 * ranks) == 0  # the calibration's runs balance the causal load (two chunks a rank)
    cp.apply(model, fake_group_mesh(), Layout(cp=ranks), dist.get_rank(),
             SimpleNamespace(cp_load_balance=balanced, wrong_variant=""))  # fmt: skip
    ids = torch.randint(0, model_shape["vocab_size"], (rows, block // ranks))

    left, recorder = beyond_its_ops(stepping(lambda: lm_loss(model(ids), ids)),
                                    stepping(lambda: lm_loss(plain(ids), ids)), budget_s, figures, timed)  # fmt: skip
    return round(sum(left.values()) / sum(recorder.functional_collectives.values()) * 1e6, 2)


# a second process on a rank's core: the GPT's steps, without end, one thread, until killed
SHARING_CORE = """
import torch
from benchmarks.op_costs import gpt_step
torch.set_num_threads(1)
step = gpt_step({shape!r}, {rows})
for _ in range(3):
    step()
print("ready", flush=True)
while True:
    step()
"""


def shared_core_ratio(model_shape: dict, rows: int, rounds: int = 3) -> float:
    """What two ranks sharing one core cost: the GPT's step (forward, backward, AdamW) on each rank with a second
    process running the same steps beside it, against the same step with that process stopped (SIGSTOP), both
    ranks at once, in turn (`rounds` times: the VM's drift falls on both alike); the median of the ratios. 2.0 if
    time-slicing cost nothing; the switches, and the caches each process finds refilled by the other, cost more
    (dp_shard 2 x tp 2's 4 ranks on these 2 cores spent 101 ms of CPU a rank a step where tp's 2 ranks, the same
    rows and the same split matmuls without FSDP, spent 66)."""
    import signal
    import subprocess

    import torch.distributed as dist

    each_phase = gpt_step(model_shape, rows)
    step = lambda: sum(each_phase())  # noqa: E731 - the whole step's seconds
    code = SHARING_CORE.format(shape=model_shape, rows=rows)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    beside = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    ratios = []
    try:
        beside.stdout.readline()  # warmed up
        os.kill(beside.pid, signal.SIGSTOP)
        for _ in range(3):
            step()
        for _ in range(rounds):
            dist.barrier()
            alone = statistics.median(step() for _ in range(20))
            os.kill(beside.pid, signal.SIGCONT)
            dist.barrier()
            shared = statistics.median(step() for _ in range(20))
            os.kill(beside.pid, signal.SIGSTOP)
            ratios.append(shared / alone)
    finally:
        beside.kill()
        beside.wait()
    return round(statistics.median(ratios), 3)


COLLECTIVE_BYTES = [2**k for k in range(14, 23, 2)]  # 16 KB to 4 MB: what a layout's collectives carry here
# each size's calls: on 2 ranks each one beside a compute alone; on 4 ranks in 4 turns with the compute alone (60
# calls, timed once, fitted a same-partner all-reduce at 0.4-1.4 ms latency in four runs a minute apart; 240 in
# turns, averaged over the ranks: 1.3-1.5 ms)
CALLS_OF_2, CALLS_OF_4, TURNS = 120, 240, 4
COMPUTE_BETWEEN = 256  # a 256-square matmul (about 0.3 ms here) three times between two collectives


def collectives_between_compute(same_group: bool = False) -> list[dict]:
    """gloo's collectives as a training step issues them: each after some compute, the two ranks not in lockstep
    (back to back, as a collectives benchmark times them, a 1 MB all-reduce took 0.75 ms here; after 1 ms of
    matmuls, 2.9 ms). Per kind and size: the MEAN time of (compute + collective) minus the compute's alone, the
    ranks' figures averaged. A step's time is the sum of its collectives, so their mean is what it pays: two
    ranks' threads (compute and gloo's) on two cores leave a long tail (a 128 KB all-reduce after 1 ms of
    matmuls: median 1.3 ms, mean 1.9; in a tp run's profile, 95 waits: median 1.2 ms, mean 2.1). The median,
    used before, dropped it: tp's 19 all-reduces a step were priced at 9.6 ms against the 40 ms the profile shows
    them waiting.

    On 4 ranks (2 a core) the ranks pair as a 2 x 2 layout's two dimensions: each call with the partner of its
    rank's previous one (`same_group`, as tp's chained all-reduces) or each with the other partner (as FSDP's
    all-gathers between tp's all-reduces). The compute alone is timed in a phase of its own, every rank computing:
    timed between the collectives (the 2-rank way) it ran while the other pair waited in theirs, on a core less
    shared than a step's, and a 64 KB all-reduce read 2.4-2.9 ms against 1.6-2.4 measured by phases."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename: the same op
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN), torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN)
    groups = [None]  # 2 ranks: the world
    if world == 4:
        rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = [rows[rank // 2]] if same_group else [rows[rank // 2], columns[rank % 2]]
    size_of = dist.get_world_size(groups[0])

    def compute():
        for _ in range(3):
            torch.mm(a, b)

    def timed(run, calls: int) -> list[float]:
        took = []
        for i in range(calls):
            started = time.perf_counter()
            compute()
            if run:
                run(groups[i % len(groups)])
            took.append(time.perf_counter() - started)
        return took

    partner = (rank + world // 2) % world  # a pipeline's next or previous stage (the outer dimension)

    def exchange(tensor: torch.Tensor) -> None:
        """A stage's send and receive, one each way, as torch's schedules post them."""
        first, then = (dist.isend, dist.irecv) if rank < partner else (dist.irecv, dist.isend)
        for op in (first, then):  # post them (batch_isend_irecv); each work waited on once
            for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, partner)]):
                work.wait()

    rows = []
    # 4 ranks, each call with a new partner: also a pipeline's sends on shared cores, priced a send and a receive
    kinds = ("all_reduce", "all_gather", "reduce_scatter") + (
        ("send",) if world > 2 and not same_group else ()
    )
    for kind in kinds:
        for size in COLLECTIVE_BYTES:
            whole = torch.zeros(size // 4)
            part = torch.zeros(size // 4 // size_of)
            run = {"all_reduce": lambda g: dist.all_reduce(whole, group=g),  # noqa: B023
                   "all_gather": lambda g: dist.all_gather_into_tensor(whole, part, group=g),  # noqa: B023
                   "reduce_scatter": lambda g: dist.reduce_scatter_tensor(part, whole, group=g),  # noqa: B023
                   "send": lambda g: exchange(whole)}[kind]  # noqa: B023 # fmt: skip
            dist.barrier()
            both, alone = [], []
            if world <= 2:  # each rank its own core: the compute alone between the collectives
                for _ in range(CALLS_OF_2):
                    both += timed(run, 1)
                    alone += timed(None, 1)
            else:  # in turns, so that the machine's drift reaches both alike
                for _ in range(TURNS):
                    dist.barrier()
                    alone += timed(None, CALLS_OF_4 // TURNS)
                    dist.barrier()
                    both += timed(run, CALLS_OF_4 // TURNS)
            seconds = max(statistics.mean(both) - statistics.mean(alone), 1e-6)
            rows.append({"op": kind, "bytes": size, "time_us": seconds * 1e6})
    each = [None] * world  # every rank's figures (a rank's own wait is a step's): their mean
    dist.all_gather_object(each, rows)
    return [{**row, "time_us": statistics.mean(r[i]["time_us"] for r in each)} for i, row in enumerate(rows)]


def late_receive_us(rounds: int = 60) -> float:
    """What a pipeline's receive waits when it is posted after its data was sent: rank 0 sends (a micro-batch's
    activations, 32 and 256 KB) and goes on computing for 3 ms, as a stage goes on to its next micro-batch; rank
    1 posts its receive 1.5 ms later, as a stage reaching the forward that needs it; the receive's mean time
    (torch's schedules post each receive when they reach its action: in a 1F1B step on these 2 cores the last
    stage waited 1.0-1.9 ms before each steady-state forward whose input had been sent long before)."""
    import torch.distributed as dist

    a, b = torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN), torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN)

    def compute(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            torch.mm(a, b)

    waited = []
    for size in (32 * 1024, 256 * 1024):
        message = torch.zeros(size // 4)
        for _ in range(rounds):
            dist.barrier()
            if dist.get_rank() == 0:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, message, 1)])
                compute(3e-3)
            else:
                compute(1.5e-3)
                started = time.perf_counter()
                works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, message, 0)])
            for work in works:  # once each: a gloo receive waited on again waits for another message
                work.wait()
            if dist.get_rank() == 1:
                waited.append(time.perf_counter() - started)
    each = [0.0, 0.0]
    dist.all_gather_object(each, statistics.mean(waited) if waited else 0.0)
    return round(each[1] * 1e6, 2)  # rank 1's: the receiver's


def worker(args):
    """Each rank: gloo's collectives after compute, then the ops of the spec, both ranks at once; rank 0 writes
    both ranks' figures merged."""
    import torch.distributed as dist

    from common.config import RunArgs
    from common.runtime import make_accelerator

    accelerator = make_accelerator(RunArgs(), scratch_folder(args))
    collective_rows = collectives_between_compute()
    late_receive = late_receive_us() if dist.get_world_size() == 2 else None
    if not args.spec:  # the collectives alone (4 ranks on the 2 cores), and each with its last call's partner
        same_group_rows = collectives_between_compute(same_group=True)
        if accelerator.is_main_process:
            write_result(
                args.result, {"collective_rows": collective_rows, "same_group_rows": same_group_rows}
            )
        return accelerator
    with open(args.spec, "rb") as handle:
        spec = pickle.load(handle)
    dist.barrier()  # the two ranks measure the ops side by side
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, measure(spec))
    if accelerator.is_main_process:
        write_result(args.result, {"collective_rows": collective_rows,
                                   "ops": {**merged(each), "late_receive_us": late_receive}})  # fmt: skip
    return accelerator  # run_worker shuts it down


def fitted_of(rows: list[dict]) -> dict:
    """gloo's collectives_between_compute rows as a fit per kind: latency + bytes / bandwidth."""
    from benchmarks.performance import fit_alpha_beta

    return {kind: {"bandwidth_gbps": round(f["bandwidth_gbps"] or 1e6, 3), "latency_us": round(f["alpha_us"])}
            for kind, f in fit_alpha_beta(rows).items()}  # fmt: skip


def measure_this_machine(spec: dict, timeout_s: float = 1800) -> tuple[dict, dict, dict]:
    """The op model's figures and gloo's fit per kind (latency + bytes / bandwidth), measured on 2 ranks; and the
    same fits on twice as many ranks as cores, in pairs (what a 4-rank layout's collectives cost on 2 cores: each
    rank's compute shares a core, and a partner may wait for its turn on one; a collective between two of 4 ranks
    here took 1.3-2.3x what it took between 2 ranks): {"switching": each call with a new partner, "same_group":
    each with its last call's}."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "spec.pickle")  # OpCall replays hold dtypes and TensorSpecs: not JSON
        with open(path, "wb") as handle:
            pickle.dump(spec, handle)
        result = spawn("op_costs.py", 2, ["--spec", path], timeout_s)
    shared = (
        spawn("op_costs.py", 4, [], timeout_s) if os.cpu_count() == 2 else None
    )  # the 4-rank layouts' case
    return (
        fitted_of(result["collective_rows"]),
        result["ops"],
        {
            "switching": fitted_of(shared["collective_rows"]),
            "same_group": fitted_of(shared["same_group_rows"]),
        }
        if shared
        else {},
    )


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:
        parser.error("run by benchmarks/at_scale_calibration.py (its ops to time come from the fake ranks)")
    run_worker(worker, args)


if __name__ == "__main__":
    main()
