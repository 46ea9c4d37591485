"""What a step costs beyond its ops, measured (benchmarks/op_costs.py runs it on two ranks at once): eager
PyTorch's gaps per phase of the GPT's step, DTensor's redistributes and gaps, FSDP2's and the functional
collectives' overhead per call, and what a second process beside a rank on its core costs it. Each figure is the
step's time less its ops priced by the op table just timed (the prediction's own prices)."""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.kernel_costs import replayed_seconds


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
from benchmarks.overhead_costs import gpt_step
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
