"""What each rank of a layout holds and sends by theory, composed from every registered piece's closed forms
(strategies/piece.Theory asks each piece the same questions in the registry's order). It needs no process
group: it runs on the undistributed GPT for any rank of any layout, at 2 ranks or 16,384, and the checks compare
it with what every rank really holds and sends (strategies/checks.py); planning/cost_model.py prices it.
"""

from __future__ import annotations

from strategies import registry
from strategies.layout import Layout, Workload
from strategies.piece import Measures, Plan, Theory, having


def theory_of(model, layout: Layout, rank: int, args, work: Workload, counted: dict | None = None) -> Theory:
    """Rank `rank` of `layout` by theory, every registered piece's (no engine: DeepSpeed has its own theory)."""
    return Theory(model, Plan(args, layout, work, None, registry.PIECES), rank, counted)


def held_pieces(model, layout: Layout, rank: int, args, work: Workload) -> list[tuple[str, list[int]]]:
    """(name, shape of the rank's piece before data parallelism) of every parameter rank `rank` holds: the
    pipeline's choice of blocks and ends, the head's copy of a tied embedding on a last stage, tensor
    parallelism's split, expert parallelism's."""
    return theory_of(model, layout, rank, args, work).held


def held_bytes(model, layout: Layout, rank: int, args, work: Workload) -> dict:
    """A rank's bytes by theory (strategies/piece.Theory.held_bytes). `model` is the undistributed GPT."""
    return theory_of(model, layout, rank, args, work).held_bytes()


def gathered_bytes(model, layout: Layout, rank: int, args, work: Workload) -> int:
    """Parameter bytes a rank holds between a micro-batch's forward and its backward."""
    return theory_of(model, layout, rank, args, work).gathered_bytes()


def sent_traffic(model, layout: Layout, rank: int, args, work: Workload, routing: list = ()) -> list:
    """Rank `rank`'s collectives of one step's forwards and backwards, each piece's (strategies.layout.Traffic).
    `routing`: what its MoE blocks sent and received in the step (ep's all-to-alls depend on it)."""
    return theory_of(model, layout, rank, args, work, {"routing": list(routing)}).traffic


def sent_bytes(model, layout: Layout, rank: int, args, work: Workload, routing: list = ()) -> dict:
    """Rank `rank`'s bytes of one step by kind and by dimension, and on the wire (Theory.sent_bytes)."""
    return theory_of(model, layout, rank, args, work, {"routing": list(routing)}).sent_bytes()


def stage_theories(model, layout: Layout, args, work: Workload) -> list[Theory]:
    """The theory of each pipeline stage's first rank (every rank, when there is no pipeline), what it holds and
    sends composed: what planning/cost_model.py prices. What a piece's closed form takes from a run (a mixture of
    experts' routing) is what it assumes of one (`assumed_inputs`: a uniform routing, what experiments/at_scale.py
    assumes and counts); it needs the rank's blocks first."""
    theories = []
    for rank in (layout.rank_at(pp=stage) for stage in range(layout.pp)):
        theory = theory_of(model, layout, rank, args, work)
        assumed = {
            k: v
            for piece in having(theory.plan.on, Measures)
            for k, v in piece.assumed_inputs(theory).items()
        }
        theories.append(theory_of(model, layout, rank, args, work, assumed) if assumed else theory)
    return theories
