"""Where a training step's time goes, from torch.profiler's own trace (one chrome trace file per rank,
viewable in https://ui.perfetto.dev or chrome://tracing).

A step is the profiler's `ProfilerStep#N` span on the training thread. Inside it:
  compute        the training thread's top-level operators, minus the spans of operators (at any
                 depth) that issue or wait for a collective (c10d::*, _c10d_functional::*, *wait*);
  communication  the collectives themselves: gloo runs each on its own worker thread and the profiler
                 marks it `gloo:<op>` (NCCL: `nccl:<op>`), from start to finish, whoever waits for it;
                 plus the training thread's issuing and waiting;
  overlapped     time in both (a collective running while the training thread computes: DDP's bucket
                 all-reduce during backward, FSDP2's prefetched all-gathers);
  idle           time in neither: the training thread outside any operator. That is Python and
                 framework work between operators (DTensor's sharding propagation, FSDP2's and DDP's
                 hooks, our loop) and waits the trace does not mark (DDP waiting for its last bucket
                 at the end of backward is a gap in the trace, not an operator).
compute + communication - overlapped + idle = the step. On CPU ranks that share cores, "overlapped"
is two threads taking turns on a core, not free time: compare it with the step, not with zero.

On a GPU the work is the device's, not the training thread's (an operator's CPU span is its kernel launch): where
the trace holds device spans (kineto's `kernel`, `gpu_memcpy`, `gpu_memset`), compute is the device's kernels,
communication NCCL's kernels (`nccl*`), and idle the step's time with the device doing neither.
"""

from __future__ import annotations

import json
import os
import re

COMMUNICATION_OPS = re.compile(r"^(c10d::|_c10d_functional::|c10d_functional::)|wait", re.IGNORECASE)
COLLECTIVE_SPANS = re.compile(r"^(gloo|nccl):")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's device spans (a GPU run's trace)
DEVICE_COLLECTIVES = re.compile(r"^nccl", re.IGNORECASE)  # NCCL's kernels: ncclDevKernel_AllReduce_...


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def total(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two unions (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def difference(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """a minus b (each sorted and disjoint)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def clipped(intervals, window: tuple[float, float]) -> list[tuple[float, float]]:
    return [(max(s, window[0]), min(e, window[1])) for s, e in intervals if e > window[0] and s < window[1]]


def step_breakdown(trace: dict) -> list[dict]:
    """Per profiled step of a chrome trace (torch.profiler's export_chrome_trace): milliseconds of compute,
    communication, overlapped, idle, and the step; and the step's compute / communication intervals
    (ms from the step's start) for a timeline."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in spans if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not steps:
        return []
    device_spans = [e for e in spans if e.get("cat") in DEVICE_CATEGORIES]
    if device_spans:  # a GPU run: the device's time, not its launches
        communication_all = merged(
            [(e["ts"], e["ts"] + e["dur"]) for e in device_spans if DEVICE_COLLECTIVES.match(e["name"])]
        )
        # the other kernels, on their own streams: where they run beside NCCL's, that is overlap
        compute_all = merged(
            [(e["ts"], e["ts"] + e["dur"]) for e in device_spans if not DEVICE_COLLECTIVES.match(e["name"])]
        )
        return [_step_row(step, compute_all, communication_all) for step in steps]
    training_thread = steps[0]["tid"]
    operators = sorted(
        (e for e in spans if e.get("cat") == "cpu_op" and e["tid"] == training_thread), key=lambda e: e["ts"]
    )
    top_level, covered_until = [], float("-inf")  # operators not inside another operator
    for op in operators:
        if op["ts"] >= covered_until:
            top_level.append(op)
            covered_until = op["ts"] + op["dur"]
    # issuing and waiting, at any depth: DTensor issues and waits for its collectives inside the operator
    # being computed (aten::mm on a sharded input), which is compute only outside those spans
    issuing = merged(
        [(e["ts"], e["ts"] + e["dur"]) for e in operators if COMMUNICATION_OPS.search(e["name"])]
    )
    compute_all = difference(merged([(e["ts"], e["ts"] + e["dur"]) for e in top_level]), issuing)
    collectives = [(e["ts"], e["ts"] + e["dur"]) for e in spans if COLLECTIVE_SPANS.match(e["name"])]
    communication_all = issuing + collectives
    return [_step_row(step, compute_all, communication_all) for step in steps]


def _step_row(step: dict, compute_all: list, communication_all: list) -> dict:
    """One profiled step's breakdown from the whole trace's compute and communication intervals."""
    window = (step["ts"], step["ts"] + step["dur"])
    compute = merged(clipped(compute_all, window))
    communication = merged(clipped(communication_all, window))
    overlapped = total(intersection(compute, communication))
    busy = total(compute) + total(communication) - overlapped
    return {
        "step": step["name"].split("#")[1],
        "step_ms": step["dur"] / 1e3,
        "compute_ms": total(compute) / 1e3,
        "communication_ms": total(communication) / 1e3,
        "overlapped_ms": overlapped / 1e3,
        "idle_ms": (step["dur"] - busy) / 1e3,
        "compute_intervals": milliseconds_from(window[0], compute),
        "communication_intervals": milliseconds_from(window[0], communication),
    }


def milliseconds_from(origin: float, intervals) -> list[tuple[float, float]]:
    return [((start - origin) / 1e3, (end - origin) / 1e3) for start, end in intervals]


def trace_breakdown(path: str) -> list[dict]:
    with open(path) as handle:
        return step_breakdown(json.load(handle))


def mean_breakdown(rows: list[dict]) -> dict:
    """The mean of each figure over the profiled steps (means add up: compute + communication -
    overlapped + idle = step still holds; medians taken figure by figure would not)."""
    keys = ("step_ms", "compute_ms", "communication_ms", "overlapped_ms", "idle_ms")
    return {key: sum(row[key] for row in rows) / len(rows) for key in keys} if rows else {}


def median_step(rows: list[dict]) -> dict:
    """The profiled step of median length: the one a timeline shows."""
    return sorted(rows, key=lambda row: row["step_ms"])[(len(rows) - 1) // 2]


def plot_timeline(rows: list[tuple[str, dict]], kinds: dict[str, str], title: str, path: str,
                  xlabel: str = "ms from the step's start") -> None:  # fmt: skip
    """One lane per row and kind: rows are (label, {kind: [(start_ms, end_ms), ...]}), `kinds` maps each
    kind to its colour, drawn top to bottom in that order. A profiled step is {"compute": ...,
    "communication": ...} (step_lanes); a pipeline stage is {"forward": ..., "backward": ...}."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to leave behind

    lanes = len(kinds)
    figure = Figure(figsize=(12, 1.2 + 0.45 * lanes * len(rows)))
    axis = figure.subplots()
    for index, (_, intervals) in enumerate(rows):
        top = (lanes + 1) * (len(rows) - 1 - index)
        for lane, (kind, colour) in enumerate(kinds.items()):
            bars = [(start, end - start) for start, end in intervals.get(kind, [])]
            axis.broken_barh(
                bars, (top + lanes - 1 - lane, 0.8), color=colour, label=kind if index == 0 else None
            )
    axis.set_yticks(
        [(lanes + 1) * (len(rows) - 1 - i) + lanes / 2 for i in range(len(rows))],
        [label for label, _ in rows],
    )
    axis.set_xlabel(xlabel)
    axis.set_title(title)
    axis.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


PIPELINE_KINDS = {"forward": "tab:blue", "backward": "tab:orange", "weight gradients": "tab:green"}


def pipeline_bubble(
    timelines: list[list], labels: list[str], from_step: int, title: str, path: str
) -> dict | None:
    """A pipeline's bubble, step by step: `timelines[r][k]` is stage-rank r's timed actions in step k, (kind, start,
    end) with kind F, B or W (forward, backward, weight gradients; seconds from the rank's own step start).
    A step's bubble is 1 - the mean busy time / the step's span. The median step from `from_step` (1-based) on
    is drawn to `path`; None if no step is that late."""
    import statistics

    steps = []
    for k in range(from_step - 1, len(timelines[0])):
        actions = [timeline[k] for timeline in timelines]
        start = min(a[1] for rank_actions in actions for a in rank_actions)
        span = max(a[2] for rank_actions in actions for a in rank_actions) - start
        busy = [sum(a[2] - a[1] for a in rank_actions) for rank_actions in actions]
        steps.append((1 - statistics.mean(busy) / span, span, [[(kind, s - start, e - start) for kind, s, e in a]
                                                               for a in actions]))  # fmt: skip
    if not steps:
        return None
    median = sorted(steps, key=lambda step: step[0])[len(steps) // 2]
    lanes = [(label, {name: [(1e3 * s, 1e3 * e) for kind, s, e in actions if kind == name[0].upper()]
                      for name in PIPELINE_KINDS})
             for label, actions in zip(labels, median[2], strict=True)]  # fmt: skip
    plot_timeline(lanes, PIPELINE_KINDS, f"{title}: the median step, bubble {median[0]:.2f}", path)
    return {
        "measured_bubble": statistics.median(step[0] for step in steps),
        "step_ms": 1e3 * statistics.median(step[1] for step in steps),
        "steps_measured": len(steps),
    }


STEP_KINDS = {"compute": "tab:blue", "communication": "tab:orange"}


def step_lanes(step: dict) -> dict:
    """A profiled step (step_breakdown's row) as plot_timeline's lanes."""
    return {"compute": step["compute_intervals"], "communication": step["communication_intervals"]}


def report_profile(session, rows: list[dict], title: str, nothing_profiled: str) -> None:
    """Every rank's profiled steps (a collective): the mean breakdown per rank into the metrics, each rank's
    median step into <output_dir>/profile/timeline.png, one console line. `nothing_profiled` is said when
    a rank has no rows (a resumed run may train fewer steps than profiling starts after)."""
    every_rank = session.accelerator.gather_for_metrics([rows], use_gather_object=True)
    if not all(every_rank):
        session.print(nothing_profiled)
        return
    if not session.is_main:
        return
    means = [mean_breakdown(rows) for rows in every_rank]
    session.metrics["step_breakdown_ms"] = means
    timeline = os.path.join(session.output_dir, "profile", "timeline.png")
    lanes = [(f"rank {rank}", step_lanes(median_step(rows))) for rank, rows in enumerate(every_rank)]
    plot_timeline(lanes, STEP_KINDS, title, timeline)
    session.log_table("step_breakdown", [{"rank": r, **m} for r, m in enumerate(means)], timeline)
    session.print(
        f"profiled steps, rank 0, mean of {len(every_rank[0])} (ms): "
        + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in means[0].items())
        + f"; traces and timeline.png in {os.path.dirname(timeline)}"
    )


class StepProfiler:
    """torch.profiler over `steps` optimizer steps after the first `skip` (one-time work) and one warm-up
    step; call .step() after each optimizer step. Writes <folder>/rank<r>.json (a chrome trace) when the
    last profiled step ends; .breakdown() then reads it. steps=0: does nothing."""

    def __init__(self, steps: int, folder: str, rank: int, device_type: str, skip: int = 3):
        self.path, self.profiler, self.written = os.path.join(folder, f"rank{rank}.json"), None, False
        if steps:
            from torch.profiler import ProfilerActivity, profile, schedule

            os.makedirs(folder, exist_ok=True)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
            self.profiler = profile(
                activities=activities,
                schedule=schedule(wait=skip, warmup=1, active=steps, repeat=1),
                on_trace_ready=self._export,
            )

    def _export(self, profiler) -> None:
        profiler.export_chrome_trace(self.path)
        self.written = True  # this run's trace (a resumed run's folder may hold an older one)

    def __enter__(self) -> StepProfiler:
        if self.profiler:
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.profiler:
            self.profiler.__exit__(*exc)

    def step(self) -> None:
        if self.profiler:
            self.profiler.step()

    def breakdown(self) -> list[dict]:
        """This rank's rows (step_breakdown), or [] when nothing was profiled (off, or too few steps)."""
        return trace_breakdown(self.path) if self.written else []


def waiting_for_peers(trace_paths: list[str]) -> dict:
    """How much of rank 0's collective time is waiting for the other ranks to arrive. The ranks' traces
    share one clock (one host), and every rank issues the same collectives in the same order when all
    ranks form one group (ddp, zero2, fsdp, tp), so the k-th collective span of each rank is the same
    call: it can move data only once the last rank has entered it. Per profiled step, averaged: rank 0's
    span time, the part before the last rank arrived, and the rest (the transfer proper). {} when the
    ranks' spans do not pair up (several groups, as under fsdp_tp)."""
    per_rank, steps = [], 0
    for path in trace_paths:
        with open(path) as handle:
            events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
        profiled = [e for e in events if e["name"].startswith("ProfilerStep#")]
        if not profiled:
            return {}
        start, end = min(e["ts"] for e in profiled), max(e["ts"] + e["dur"] for e in profiled)
        steps = len(profiled)
        spans = sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if COLLECTIVE_SPANS.match(e["name"]) and start <= e["ts"] < end
        )
        per_rank.append(spans)
    if len({len(spans) for spans in per_rank}) != 1 or not per_rank[0]:
        return {}
    calls = list(zip(*per_rank, strict=True))  # the k-th span of every rank
    own = [call[0] for call in calls]
    last_arrival = [max(span[0] for span in call) for call in calls]
    waiting = sum(arrival - mine[0] for arrival, mine in zip(last_arrival, own, strict=True))
    spans_total = sum(end - start for start, end in own)
    return {
        "calls_per_step": len(own) / steps,
        "spans_ms": spans_total / steps / 1e3,
        "waiting_ms": waiting / steps / 1e3,
        "after_arrival_ms": (spans_total - waiting) / steps / 1e3,
    }
