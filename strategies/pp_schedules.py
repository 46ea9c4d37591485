"""The pipeline schedules as one model, used by the runtime (strategies/pp.py), the timeline that prices a step
(planning/timeline.py) and the fake ranks at scale (planning/fake_ranks.py): which torch.distributed.pipelining
schedule each --pp_schedule is, where its stages sit (looped: rank r holds stages r, r + p, ...; a "V": r and
2p - 1 - r), which blocks a stage holds, each rank's forwards and backwards in the order its schedule runs them
(torch's own order for the zero-bubble schedules, read from torch's schedule without a stage), the bubble by each
schedule's paper, and what a rank holds and hands on by theory (its stages' blocks, the ends, the tokens it
sends)."""

from __future__ import annotations

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


def block_bounds(n_layer: int, n_stages: int) -> list[int]:
    """Stage s holds blocks [bounds[s], bounds[s + 1]): as even as whole blocks allow."""
    return [round(i * n_layer / n_stages) for i in range(n_stages + 1)]


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
    bounds = block_bounds(n_layer, n_stages)
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
