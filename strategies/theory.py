"""What each rank of a layout holds and sends by theory, composed from each piece's closed form. It needs no
process group: it runs on the undistributed GPT for any rank of any layout, at 2 ranks or 16,384, and the checks
compare it with what every rank really holds and sends (strategies/checks.py); planning/cost_model.py prices it.
"""

from __future__ import annotations

import math

from strategies import cp, ep, pp, replicate, shard, tp
from strategies.layout import Layout, Workload, unique_parameters


def held_pieces(model, layout: Layout, rank: int, args) -> list[tuple[str, list[int]]]:
    """(name, shape of the rank's tensor-parallel piece) of every parameter rank `rank` holds: the pipeline's
    choice of blocks and ends, the head's copy of a tied embedding on a last stage, tensor parallelism's split."""
    holding = pp.holding(layout, rank, args, model.cfg.n_layer, model.cfg.tie_weights)
    parameters = [(name, p.shape) for name, p in unique_parameters(model) if holding.holds(name)]
    if holding.tied_copy:
        parameters.append(("head.weight", model.tok_emb.weight.shape))
    return [(name, ep.local_shape(name, tp.local_shape(name, shape, layout, rank), layout))
            for name, shape in parameters]  # fmt: skip


def at_rest(name: str, shape, layout: Layout, rank: int) -> list[int]:
    """The piece of a parameter a rank holds at rest: FSDP's shard of its TP piece (experts split by ep: whole)."""
    return list(shape) if ep.split(name, layout) else shard.local_shape(shape, layout, rank)


def held_bytes(model, layout: Layout, rank: int, args, work: Workload) -> dict:
    """A rank's bytes by theory: each parameter's piece at rest (after the pipeline, tensor parallelism, FSDP),
    its gradient the same, AdamW's two moments the same plus a 4-byte step count per tensor; between forward and
    backward the gathered pieces of what FSDP keeps gathered (a pipeline's forward is its whole step: as at
    rest). `model` is the undistributed GPT (float32)."""
    pieces = held_pieces(model, layout, rank, args)
    params = sum(math.prod(at_rest(name, shape, layout, rank)) * 4 for name, shape in pieces)
    return {
        "params": params,
        "grads": params,
        "optimizer": 2 * params + 4 * len(pieces),
        "params_between_forward_and_backward": params
        if layout.pp > 1
        else gathered_bytes(model, layout, rank, args, work),  # fmt: skip
    }


def gathered_bytes(model, layout: Layout, rank: int, args, work: Workload) -> int:
    """Parameter bytes a rank holds between a micro-batch's forward and its backward: FSDP's gathered copies of
    what it keeps gathered (at the gathered precision: bf16 copies under --mixed_precision bf16), the rest at
    rest. (Under a pipeline, while its micro-batches run: experiments/at_scale.py sees inside the step.)"""
    gathered_element = 2 if work.mixed_precision == "bf16" and layout.shard_dims else 4
    total = 0
    for name, shape in held_pieces(model, layout, rank, args):
        gathered = (layout.shard_dims and not ep.split(name, layout)
                    and shard.gathered_between_forward_and_backward(name, args, layout))  # fmt: skip
        total += (
            math.prod(shape) * gathered_element
            if gathered
            else math.prod(at_rest(name, shape, layout, rank)) * 4
        )
    return total


def sent_traffic(model, layout: Layout, rank: int, args, work: Workload, routing: list = ()) -> list:
    """Rank `rank`'s collectives of one step's forwards and backwards, each piece's (strategies.layout.Traffic).
    `routing`: what its MoE blocks sent and received in the step (ep's all-to-alls depend on it)."""
    holding = pp.holding(layout, rank, args, model.cfg.n_layer, model.cfg.tie_weights)
    pieces = held_pieces(model, layout, rank, args)
    experts = [(name, shape) for name, shape in pieces if ep.split(name, layout)]
    pieces = [piece for piece in pieces if piece not in experts]  # ep's own: FSDP and DDP leave them alone
    blocks = len(holding.blocks)
    recomputed = blocks if args.activation_checkpointing == "full" else 0
    tied = tp.local_shape("tok_emb.weight", model.tok_emb.weight.shape, layout, rank)
    return [
        *tp.sent(layout, args, work, blocks, holding.first, holding.last, recomputed),
        *cp.sent(layout, work, blocks),
        *pp.sent(layout, rank, args, work, math.prod(shard.local_shape(tied, layout, rank)) * 4),
        *shard.sent(layout, args, work, pieces),
        *replicate.sent(layout, pieces),
        *ep.sent(layout, work, list(routing), sum(math.prod(shape) * 4 for _, shape in experts)),
    ]


def sent_bytes(model, layout: Layout, rank: int, args, work: Workload, routing: list = ()) -> dict:
    """Rank `rank`'s bytes of one step's forwards and backwards, by kind (what common/comm_counter.py counts:
    each call's whole tensor) and by the dimension that sends them, and what it puts on the wire."""
    traffic = sent_traffic(model, layout, rank, args, work, routing)
    by_kind, by_dimension = {}, {}
    for t in traffic:
        by_kind[t.kind] = by_kind.get(t.kind, 0) + t.bytes
        by_dimension.setdefault(t.by, {})[t.kind] = by_dimension.get(t.by, {}).get(t.kind, 0) + t.bytes
    return {
        "by_kind": by_kind,
        "by_dimension": by_dimension,
        "wire_bytes": sum(t.wire_bytes for t in traffic),
    }
