"""This machine's op model (planning/ops.py's OpModel), measured: the matmuls and attention kernels at the shapes the
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
                                          "fsdp_overhead_us") if key in results[0]}  # fmt: skip
    for gaps in ("eager_gaps", "dtensor_gaps"):
        figures[gaps] = {
            k: round((v + results[1][gaps][k]) / 2, 2) for k, v in results[0].get(gaps, {}).items()
        }
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
def eager_gaps(model_shape: dict, rows: int, budget_s: float, timed: dict) -> dict:
    """What a real step of one process costs beyond its ops run one by one: the GPT of `model_shape` (rows x
    its block of tokens), its forward, backward and AdamW step timed (median of 20), its ops recorded and priced
    as the op model prices them (`timed`: the table of timed ops, seconds); per op dispatched, forward and
    backward, what the phase took beyond them (nn.Module's calls, autograd building and walking its graph, the
    allocator, and whatever the table's ops, timed one at a time, miss of a whole step's); the optimizer's step
    beyond its ops, per step."""
    from common.gpt import GPT, GPTConfig, adamw, lm_loss
    from planning.ops import OpRecorder

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

    for _ in range(3):
        step()
    took = [step() for _ in range(20)]
    with OpRecorder() as recorder:
        step(recorder)
    gaps = {}
    for i, phase in enumerate(("forward", "backward", "step")):
        measured = statistics.median(t[i] for t in took)
        calls = recorder.calls.get(phase, {})
        dispatched = sum(calls.values())
        gaps[phase] = (measured - replayed_seconds(calls, timed, budget_s)) / (
            dispatched if phase != "step" else 1
        )
    return {"forward_us_per_op": round(gaps["forward"] * 1e6, 2),
            "backward_us_per_op": round(gaps["backward"] * 1e6, 2),
            "step_us": round(gaps["step"] * 1e6, 2)}  # fmt: skip


def beyond_its_ops(step, baseline, budget_s: float, figures: dict, timed: dict):
    """What `step` costs beyond `baseline` (the same model without the piece measured) and beyond the ops it adds:
    each a step (`step(recorder)` sets the recorder's phase as it goes and returns each phase's seconds), timed in
    turn (median of 20 each: the VM's drift, tens of percent within a minute, falls on both alike), less the
    difference of their ops as the op model prices them (the timed table, an op no replay can run by its bytes,
    each op's eager gap, each DTensor op's dispatch as far as dtensor_gaps is measured): ({phase: those seconds},
    the recorder of one step)."""
    from planning.ops import OpRecorder, op_model_from

    # the op model of the figures measured so far: ops no replay can run priced by their bytes, DTensor's cost
    model = op_model_from({"ops": {key: figures[key] for key in ("memory_points", "op_overhead_us", "dtensor_gaps")
                                   if key in figures}}, {"fp32": 1.0}, 1.0)  # fmt: skip

    def priced(recorder, phase: str) -> float:
        calls = recorder.calls.get(phase, {})
        gap = figures["eager_gaps"].get(f"{phase}_us_per_op", 0.0) if phase != "step" else 0.0
        return (
            replayed_seconds(calls, timed, budget_s)
            + sum(count * model.seconds(call) for call, count in calls.items() if call.replay is None
                  and call.kind != "view")
            + sum(calls.values()) * gap * 1e-6
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


COLLECTIVE_BYTES = [2**k for k in range(14, 23, 2)]  # 16 KB to 4 MB: what a layout's collectives carry here
COMPUTE_BETWEEN = 256  # a 256-square matmul (about 0.3 ms here) three times between two collectives


def collectives_between_compute() -> list[dict]:
    """gloo's collectives as a training step issues them: each after some compute, the two ranks not in lockstep
    (back to back, as a collectives benchmark times them, a 1 MB all-reduce took 0.75 ms here; after 1 ms of
    matmuls, 2.9 ms). Per kind and size: the MEAN time of (compute + collective) minus the compute's alone. A
    step's time is the sum of its collectives, so their mean is what it pays: two ranks' threads (compute and
    gloo's) on two cores leave a long tail (a 128 KB all-reduce after 1 ms of matmuls: median 1.3 ms, mean 1.9;
    in a tp run's profile, 95 waits: median 1.2 ms, mean 2.1). The median, used before, dropped it: tp's 19
    all-reduces a step were priced at 9.6 ms against the 40 ms the profile shows them waiting."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename: the same op
    torch.set_num_threads(1)
    world = dist.get_world_size()
    a, b = torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN), torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN)

    def compute():
        for _ in range(3):
            torch.mm(a, b)

    rows = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for size in COLLECTIVE_BYTES:
            whole = torch.zeros(size // 4)
            part = torch.zeros(size // 4 // world)
            run = {"all_reduce": lambda: dist.all_reduce(whole),  # noqa: B023
                   "all_gather": lambda: dist.all_gather_into_tensor(whole, part),  # noqa: B023
                   "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole)}[kind]  # fmt: skip
            dist.barrier()
            both, alone = [], []
            for _ in range(60):
                started = time.perf_counter()
                compute()
                run()
                both.append(time.perf_counter() - started)
                started = time.perf_counter()
                compute()
                alone.append(time.perf_counter() - started)
            seconds = max(statistics.mean(both) - statistics.mean(alone), 1e-6)
            rows.append({"op": kind, "bytes": size, "time_us": seconds * 1e6})
    return rows


def worker(args):
    """Each rank: gloo's collectives after compute, then the ops of the spec, both ranks at once; rank 0 writes
    both ranks' figures merged."""
    import torch.distributed as dist

    from common.config import RunArgs
    from common.runtime import make_accelerator

    accelerator = make_accelerator(RunArgs(), scratch_folder(args))
    with open(args.spec, "rb") as handle:
        spec = pickle.load(handle)
    collective_rows = collectives_between_compute()
    dist.barrier()  # the two ranks measure the ops side by side
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, measure(spec))
    if accelerator.is_main_process:
        write_result(args.result, {"collective_rows": collective_rows, "ops": merged(each)})
    return accelerator  # run_worker shuts it down


def measure_this_machine(spec: dict, timeout_s: float = 1800) -> tuple[dict, dict]:
    """The op model's figures and gloo's fit per kind (latency + bytes / bandwidth), measured on 2 ranks."""
    from benchmarks.performance import fit_alpha_beta

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "spec.pickle")  # OpCall replays hold dtypes and TensorSpecs: not JSON
        with open(path, "wb") as handle:
            pickle.dump(spec, handle)
        result = spawn("op_costs.py", 2, ["--spec", path], timeout_s)
    fits = fit_alpha_beta(result["collective_rows"])
    fitted = {kind: {"bandwidth_gbps": round(f["bandwidth_gbps"] or 1e6, 3), "latency_us": round(f["alpha_us"])}
              for kind, f in fits.items()}  # fmt: skip
    return fitted, result["ops"]


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:
        parser.error("run by benchmarks/at_scale_calibration.py (its ops to time come from the fake ranks)")
    run_worker(worker, args)


if __name__ == "__main__":
    main()
