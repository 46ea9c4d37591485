"""The pipeline schedules as one model, used by the runtime (strategies/pp.py), the predictor (planning/cost_model.py)
and the fake ranks at scale (planning/fake_ranks.py): which torch.distributed.pipelining schedule each
--pp_schedule is, where its stages sit (looped: rank r holds stages r, r + p, ...; a "V": r and 2p - 1 - r), which
blocks a stage holds, each rank's forwards and backwards in the order its schedule runs them (torch's own order for
the zero-bubble schedules, read from torch's schedule without a stage), the bubble by each schedule's paper, and
what a rank holds and hands on by theory (its stages' blocks, the ends, the tokens it sends).

And the timeline of those orders (simulate, step_seconds): each stage rank's forwards and backwards in its order,
each waiting for what it needs (a forward for the previous stage's output, a backward for the next stage's
gradient), simulated event by event. The step is when the last rank finishes; the bubble what is left of it beyond
a rank's own work. The closed forms it reproduces (tests/test_timeline.py), for p stage ranks, m micro-batches and
a micro-batch's forward F and backward B on a rank:
  gpipe, 1f1b         (m + p - 1) (F + B)                        (Huang et al. 2019; Narayanan et al. 2021)
  interleaved_1f1b    (m + (p - 1) / v) (F + B), v stages a rank (Narayanan et al. 2021, section 2.2.2)
The zero-bubble schedules split each backward into the input's gradient (I, which the previous stage waits for)
and the weights' (W, which nothing waits for, so it fills the bubble; Qi et al. 2024), in torch's own order, zbv on
a "V" of stages. With stages that differ (the first holds the embedding, the last the head and the loss) and sends
that take time, it gives what no closed form does."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from strategies.layout import Layout, chunk_rows

# name: (torch.distributed.pipelining's schedule, stages per rank, where they sit); imported when a pipeline
# is built: the module costs 0.6 s of start-up (it imports torch._dynamo), which no other piece needs
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
# the zero-bubble schedules: each micro-batch's backward split in input gradients, then weight gradients
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv", "dualpipev")


def stages_of(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stage indices stage-rank `pp_rank` of `pp` holds."""
    _, per_rank, placement = SCHEDULES[schedule]
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + pp * i for i in range(per_rank)]


def holder(stage: int, pp: int, schedule: str) -> int:
    """The stage-rank that holds `stage` (looped: stage mod p, for any number of chunks a rank; a "V": r for stage r
    and for stage 2p - 1 - r)."""
    if SCHEDULES[schedule][2] == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def block_bounds(n_layer: int, n_stages: int, fewer_at_ends: int = 0) -> list[int]:
    """Stage s holds blocks [bounds[s], bounds[s + 1]): as even as whole blocks allow, as if the first and the last
    stage each held `fewer_at_ends` blocks more than they do (Llama 3's pipeline, section 3.3.2, one each: the first
    stage also holds the embedding, the last the head and the loss; 126 blocks on 32 stages: 3, 4, ..., 4, 3). The
    blocks are spread over n_layer + 2 x fewer_at_ends places, the first and the last `fewer_at_ends` of them
    empty (a stage may be left with none: pp refuses that)."""
    spread = n_layer + 2 * fewer_at_ends
    return [min(n_layer, max(0, round(i * spread / n_stages) - fewer_at_ends)) for i in range(n_stages + 1)]


def blocks_a_stage(n_layer: int, n_stages: int, fewer_at_ends: int = 0) -> list[int]:
    """How many blocks each stage holds under block_bounds (0 where the split leaves a stage none)."""
    bounds = block_bounds(n_layer, n_stages, fewer_at_ends)
    return [end - start for start, end in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True)
class Holding:
    """What a rank of a pipeline holds: its stages' blocks, whether it holds the embeddings (`first`) and the
    final norm and head (`last`), and whether its head is the tied embedding's copy."""

    blocks: tuple[int, ...]
    first: bool
    last: bool
    tied_copy: bool

    def holds(self, name: str) -> bool:
        if name.startswith("blocks."):
            return int(name.split(".")[1]) in self.blocks
        if name.startswith(("tok_emb.", "pos_emb.")):
            return self.first
        return self.last  # ln_f, the head


def holding(layout: Layout, rank: int, args, n_layer: int, tied: bool) -> Holding:
    """By theory, what rank `rank` holds (the whole model when there is no pipeline)."""
    if layout.pp == 1:
        return Holding(tuple(range(n_layer)), True, True, False)
    stage_ids = stages_of(layout.coordinate(rank, "pp"), layout.pp, args.pp_schedule)
    n_stages = layout.pp * len(stage_ids)
    bounds = block_bounds(n_layer, n_stages, args.pp_fewer_blocks_at_ends)
    blocks = tuple(i for s in stage_ids for i in range(bounds[s], bounds[s + 1]))
    last = n_stages - 1 in stage_ids
    return Holding(blocks, 0 in stage_ids, last, tied and last)


SEQUENCE_SPLIT = (
    "sequence_split_over_tp"  # tp's trait under sequence parallelism: a rank runs its share of tokens
)


def stage_tokens(layout: Layout, rank: int, traits, tokens: int) -> int:
    """The tokens of each sequence a stage sends on, of the `tokens` the rank runs (context parallelism's chunks
    already): where the plan splits the sequence over tp (its traits: sequence parallelism), the rank's own share
    of them (strategies/tp.py hands a stage's local tokens over)."""
    if SEQUENCE_SPLIT in traits:
        return chunk_rows(tokens, layout.tp, layout.coordinate(rank, "tp"))
    return tokens


STEADY_FROM = 3  # the bubble leaves out the first two steps (one-time work: shapes, buffers, warm-up)


def bubble_theory(schedule: str, p: int, m: int) -> float | None:
    """The share of a step a stage-rank idles, by its paper (equal forward, backward, weight-gradient times);
    None where the paper gives no closed form for this placement."""
    v = SCHEDULES[schedule][1]
    if schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        return (p - 1) / (v * m + p - 1)
    if schedule == "zbv" and m >= 2 * p:
        return 0.0
    return None


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B"; split: "I" (the input's gradient) and "W" (the weights')
    microbatch: int
    stage: int  # the model chunk: 0 .. p v - 1


def torch_order(schedule: str, rank: int, p: int, m: int) -> list[Action]:
    """Rank `rank`'s actions as torch's zero-bubble schedule orders them (2 stages a rank), its idle slots left
    out: the schedule object made without its stages, given what its order reads (its __init__ needs real
    stages)."""
    from torch.distributed.pipelining import schedules

    cls = {
        "zbv": schedules.ScheduleZBVZeroBubble,
        "interleaved_zero_bubble": schedules.ScheduleInterleavedZeroBubble,
    }
    made = object.__new__(cls[schedule])
    made.pp_group_size, made._n_microbatches, made.n_local_stages, made.num_stages = p, m, 2, 2 * p
    made.microbatches_per_round = m // max(1, m // p)  # as ScheduleInterleavedZeroBubble.__init__ sets it
    kind = schedules._ComputationType
    kinds = {kind.FORWARD: "F", kind.BACKWARD_INPUT: "I", kind.BACKWARD_WEIGHT: "W", kind.FULL_BACKWARD: "B"}
    return [Action(kinds[a.computation_type], a.microbatch_index, a.stage_index)
            for a in made._calculate_single_rank_operations(rank)
            if a is not None and a.microbatch_index < m]  # (zbv orders 2p - 1 of them at least)  # fmt: skip


def order(schedule: str, rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    """Rank `rank`'s actions in the order its schedule runs them."""
    if schedule == "gpipe":
        return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(p - rank - 1, m)
        actions = [Action("F", i, rank) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i, rank), Action("B", i, rank)]
        return actions + [Action("B", i, rank) for i in range(m - warmup, m)]
    if schedule == "interleaved_1f1b":
        if m % p:
            raise ValueError(
                f"interleaved_1f1b needs micro-batches in multiples of the stage ranks: m {m}, p {p}"
            )
        total = m * v

        # looped: the rank's chunk c is stage c p + r (stages_of's placement, for any v chunks)
        def forward(k: int) -> Action:  # micro-batches p at a time through each of the rank's chunks in turn
            group, within = divmod(k, p * v)
            chunk, offset = divmod(within, p)
            return Action("F", group * p + offset, chunk * p + rank)

        def backward(k: int) -> Action:  # the same, the chunks last first
            group, within = divmod(k, p * v)
            chunk, offset = divmod(within, p)
            return Action("B", group * p + offset, (v - 1 - chunk) * p + rank)

        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)  # Megatron's warm-up forwards
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        return actions + [backward(k) for k in range(total - warmup, total)]
    if schedule in ("zbv", "interleaved_zero_bubble"):
        return torch_order(schedule, rank, p, m)
    raise ValueError(
        f"no timeline for --pp_schedule {schedule!r}: gpipe, 1f1b, interleaved_1f1b, zbv, interleaved_zero_bubble"
    )


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
    ranks = _dependencies(schedule, p, m, v)
    took_at = [[took_of[kind][stage] for _, kind, stage, _, _ in actions] for actions in ranks]
    done: list[float | None] = [None] * (m * stages * 4)
    free, busy, position, late = [0.0] * p, [0.0] * p, [0] * p, [0] * p
    remaining = sum(len(actions) for actions in ranks)
    while remaining:
        progressed = False
        for r in range(p):
            actions = ranks[r]
            while position[r] < len(actions):
                here, _, _, needs, crossing = actions[position[r]]
                if any(done[n] is None for n in needs):
                    break
                # a receive posted before its data arrives ends as it arrives; posted after, late_s after it
                ready = 0.0
                for n, crosses in zip(needs, crossing, strict=True):
                    sent = send_s if crosses else 0.0
                    posted_late = bool(sent) and done[n] + sent <= free[r]
                    late[r] += posted_late
                    ready = max(ready, free[r] + late_s if posted_late else done[n] + sent)
                took = took_at[r][position[r]]
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


@functools.lru_cache(maxsize=256)
def _dependencies(schedule: str, p: int, m: int, v: int) -> tuple:
    """Each rank's actions in its order as (slot, kind, stage, the slots it waits for, whether each of those crosses
    from another rank): the same whatever the actions take, so a planner that prices many layouts of p stage ranks
    orders them once. A slot = (micro-batch, chunk, kind)."""
    stages = p * v
    gradient = "I" if schedule in SPLIT_BACKWARD else "B"  # what the stage before waits for
    slot = lambda kind, microbatch, stage: (microbatch * stages + stage) * 4 + "FBIW".index(kind)  # noqa: E731
    ranks = []
    for r in range(p):
        actions = []
        for a in order(schedule, r, p, m, v):
            if a.kind == "F":
                needs = (slot("F", a.microbatch, a.stage - 1),) if a.stage > 0 else ()
            elif a.kind == "W":
                needs = (slot("I", a.microbatch, a.stage),)
            else:
                needs = (slot("F", a.microbatch, a.stage),)
                needs += (slot(gradient, a.microbatch, a.stage + 1),) if a.stage < stages - 1 else ()
            # a neighbour's output crosses to this rank: a send (none from a chunk on the same rank)
            crossing = tuple(holder(n // 4 % stages, p, schedule) != r for n in needs)
            actions.append((slot(a.kind, a.microbatch, a.stage), a.kind, a.stage, needs, crossing))
        ranks.append(tuple(actions))
    return tuple(ranks)


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
