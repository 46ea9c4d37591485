"""A pipeline's step as its schedule runs it: each stage rank's forwards and backwards in the schedule's own order,
each waiting for what it needs (a forward for the previous stage's output, a backward for the next stage's
gradient), simulated event by event. The step is when the last rank finishes; the bubble what is left of it
beyond a rank's own work. The closed forms it reproduces (tests/test_timeline.py), for p stage ranks, m
micro-batches and a micro-batch's forward F and backward B on a rank:
  gpipe, 1f1b         (m + p - 1) (F + B)                        (Huang et al. 2019; Narayanan et al. 2021)
  interleaved_1f1b    (m + (p - 1) / v) (F + B), v stages a rank (Narayanan et al. 2021, section 2.2.2)
The zero-bubble schedules split each backward into the input's gradient (I, which the previous stage waits for)
and the weights' (W, which nothing waits for, so it fills the bubble; Qi et al. 2024): their order is torch's own
(torch.distributed.pipelining's ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble compute it for every rank
as plain lists; read here without a stage), zbv on a "V" of stages (rank r holds stages r and 2p - 1 - r).
With stages that differ (the first holds the embedding, the last the head and the loss) and sends that take
time, it gives what no closed form does.
"""

from __future__ import annotations

from strategies.pp_schedules import SCHEDULES, SPLIT_BACKWARD, holder, order

# --pp_schedule -> the timeline that prices it: the zero-bubble schedules in torch's own order, their backward
# split in two; dualpipev (its forwards and backwards of two micro-batches overlapped) as 1F1B, an upper bound
TIMELINE_OF = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved_1f1b": "interleaved_1f1b",
               "interleaved_zero_bubble": "interleaved_zero_bubble", "zbv": "zbv"}  # fmt: skip


def stages_per_rank(schedule: str) -> int:
    """The model chunks a stage rank holds under `schedule` (strategies/pp.py's SCHEDULES) as the timeline runs
    it: interleaving's and the zero-bubble schedules', else one."""
    return SCHEDULES[schedule][1] if TIMELINE_OF.get(schedule, "1f1b") != "1f1b" else 1


def simulate(
    schedule: str,
    p: int,
    m: int,
    forward_s,
    backward_s,
    v: int = 1,
    send_s: float = 0.0,
    weight_share: float = 0.5,
    late_s: float = 0.0,
) -> dict:
    """The step's seconds: `forward_s[s]`, `backward_s[s]` one micro-batch's forward and backward on model chunk s
    (a number: the same on every chunk), `send_s` a send between ranks. A split backward (SPLIT_BACKWARD) runs
    `weight_share` of it as W: each matmul's backward is two matmuls of its size, one for its input's gradient
    and one for its weight's, so about half (attention's and the norms' backwards go with the input's: W is
    at most half, and half is what it can hide at most). `late_s`: a receive its rank posts only after the data
    was sent (each rank posts a receive when it reaches the action that needs it, as torch's schedules do), which
    waits for the sender's side to answer (gloo: the sender's thread, busy with its next micro-batch). Returns
    step_s, each rank's busy_s, bubble_s = step_s - the busiest rank's work, and each rank's late_receives (those
    posted after their data was sent)."""
    stages = p * v
    per_chunk = lambda times: [times] * stages if isinstance(times, (int, float)) else list(times)  # noqa: E731
    backward = per_chunk(backward_s)
    took_of = {"F": per_chunk(forward_s), "B": backward, "W": [b * weight_share for b in backward],
               "I": [b * (1 - weight_share) for b in backward]}  # fmt: skip
    gradient = "I" if schedule in SPLIT_BACKWARD else "B"  # what the stage before waits for
    # each action as (its slot, the slots it waits for, its seconds); a slot = (micro-batch, chunk, kind)
    slot = lambda kind, microbatch, stage: (microbatch * stages + stage) * 4 + "FBIW".index(kind)  # noqa: E731
    queues = []
    for r in range(p):
        queue = []
        for a in order(schedule, r, p, m, v):
            if a.kind == "F":
                needs = [slot("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
            elif a.kind == "W":
                needs = [slot("I", a.microbatch, a.stage)]
            else:
                needs = [slot("F", a.microbatch, a.stage)]
                needs += [slot(gradient, a.microbatch, a.stage + 1)] if a.stage < stages - 1 else []
            # a neighbour's output crosses to this rank: a send (none from a chunk on the same rank)
            sends = [send_s if holder(n // 4 % stages, p, schedule) != r else 0.0 for n in needs]
            queue.append((slot(a.kind, a.microbatch, a.stage), needs, sends, took_of[a.kind][a.stage]))
        queues.append(queue)
    done: list[float | None] = [None] * (m * stages * 4)
    free, busy, position, late = [0.0] * p, [0.0] * p, [0] * p, [0] * p
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r in range(p):
            queue = queues[r]
            while position[r] < len(queue):
                here, needs, sends, took = queue[position[r]]
                if any(done[n] is None for n in needs):
                    break
                # a receive posted before its data arrives ends as it arrives; posted after, late_s after it
                ready = 0.0
                for n, sent in zip(needs, sends, strict=True):
                    posted_late = bool(sent) and done[n] + sent <= free[r]
                    late[r] += posted_late
                    ready = max(ready, free[r] + late_s if posted_late else done[n] + sent)
                free[r] = (free[r] if free[r] > ready else ready) + took
                busy[r] += took
                done[here] = free[r]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # an order that waits on itself: a bug in `order`, never a hang
            raise RuntimeError(f"{schedule} on p {p}, m {m}, v {v}: the schedule deadlocks")
    step = max(free)
    return {"step_s": step, "busy_s": busy, "bubble_s": step - max(busy), "late_receives": late}


def step_seconds(
    schedule: str,
    p: int,
    m: int,
    forward_s,
    backward_s,
    v: int = 1,
    send_s: float = 0.0,
    weight_share: float = 0.5,
    late_s: float = 0.0,
) -> float:
    """`simulate`'s step_s, at a large m in the time of a few rounds: a schedule settles into repeating itself
    every p micro-batches (1F1B's steady state, interleaving's rounds; with stages that differ, after a warm-up
    of some rounds), so the step of m is that of k rounds plus what each further round adds, once two windows of
    rounds (k to k + 1, k + 1 to 2k + 1) add the same per round. Equal to simulate's (tests/test_timeline.py)."""

    def at(rounds: int) -> float:
        return simulate(schedule, p, rounds * p, forward_s, backward_s, v, send_s, weight_share, late_s)[
            "step_s"
        ]

    k = 4
    while m % p == 0 and 2 * (2 * k + 1) <= m // p:  # past half of m the whole simulation costs no more
        a, b, c, d = at(k), at(k + 1), at(2 * k), at(2 * k + 1)
        if (
            abs((b - a) - (d - c)) <= 1e-9 * d and abs((c - a) - k * (b - a)) <= 1e-9 * d
        ):  # periodic from k on
            return d + (m // p - 2 * k - 1) * (d - c)
        k *= 2
    return simulate(schedule, p, m, forward_s, backward_s, v, send_s, weight_share, late_s)["step_s"]
