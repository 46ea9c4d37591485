"""What a collective costs on a hardware profile: an alpha-beta time per call (latency x ring steps + bytes x the
nccl-tests bus factor / bandwidth) over the link its group spans, or a profile's own fit per call (this_machine),
for the traffic a layout's theory says each rank sends (planning/cost_model.py puts it in the step)."""

from __future__ import annotations

import math

from common.comm_counter import bus_factor
from planning.hardware import Hardware, Link
from strategies.layout import DIMS, Layout, Traffic


def link_of(layout: Layout, dims: tuple[str, ...], hw: Hardware) -> Link:
    """The link a group over `dims` crosses: intra-node when its ranks (tp fastest) fit in one node."""
    inner = [d for d in DIMS if DIMS.index(d) > max(DIMS.index(x) for x in dims)]
    span = math.prod(getattr(layout, d) for d in (*inner, *dims))
    return hw.intra_node if span <= hw.gpus_per_node else hw.inter_node


def ring_steps(kind: str, n: int) -> int:
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}.get(kind, 1)


def collective_seconds(kind: str, size: float, ranks: int, link: Link, calls: int = 1) -> float:
    """alpha-beta: calls x latency x ring steps + bytes x bus factor / bandwidth (nothing for what is received).
    On a link with a measured bus bandwidth by payload (`Link.busbw`), an all-reduce, all-gather or reduce-scatter
    is priced by it instead: bytes x bus factor / the bus bandwidth at its payload a call (size / calls)."""
    if kind == "recv" or ranks == 1 or not size:
        return 0.0
    if link.busbw and kind in ("all_reduce", "all_gather", "reduce_scatter"):
        return size * bus_factor(kind, ranks) / measured_busbw(link.busbw, size / calls)
    return calls * link.latency * ring_steps(kind, ranks) + size * bus_factor(kind, ranks) / link.bandwidth


def measured_busbw(points: tuple, payload: float) -> float:
    """The bus bandwidth at `payload` bytes a call, read off measured (bytes, bytes/s) points: between two, linear in
    log2 of the payload; past the largest, the largest's; below the smallest, the smallest's time a call (a call that
    small is its latency: the bandwidth falls with the payload)."""
    sizes = [size for size, _ in points]
    if payload <= sizes[0]:
        return points[0][1] * payload / sizes[0]
    if payload >= sizes[-1]:
        return points[-1][1]
    upper = next(i for i, size in enumerate(sizes) if size >= payload)
    (low, low_bw), (high, high_bw) = points[upper - 1], points[upper]
    share = math.log2(payload / low) / math.log2(high / low)
    return low_bw + share * (high_bw - low_bw)


DIMENSION_GROUP = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp_replicate": ("dp_replicate",),
    "ep": ("ep",),
    "pp_step": ("pp",),
}


def traffic_seconds(
    traffic, layout: Layout, hw: Hardware, calls: dict | None = None, switched: dict | None = None
) -> dict:
    """Seconds per dimension of one step's traffic (a Theory's `traffic`); `calls` per kind (counted, if
    known) spread over the dimensions in proportion to their bytes, else one message per kind and dimension.
    Each in the term its piece names (Traffic.term: a pipeline's loss broadcast and tied embedding's all-reduce
    run once a step, after the schedule, `pp_step`), else its dimension's. On a CPU whose ranks share its
    cores, each call at the fits measured so: on a group of a size measured whole (`fitted_shared_groups`: all 4
    ranks) at that size's; else `switched` (per kind, the share of its calls on a group other than the rank's
    previous call's, as fake ranks count them; all, if not known) at `fitted_shared`, the rest at
    `fitted_shared_same_group`."""
    shared = hw.fitted_shared if hw.cores and layout.world_size > hw.cores and hw.fitted_shared else None
    same_group = (hw.fitted_shared_same_group or {}) if shared else {}
    of_size = (hw.fitted_shared_groups or {}) if shared else {}
    by_kind, known = {}, {}  # per kind: the bytes of the traffic whose calls are not known; the calls known
    for t in traffic:
        if t.calls is None:
            by_kind[t.kind] = by_kind.get(t.kind, 0) + t.bytes
        else:
            known[t.kind] = known.get(t.kind, 0) + t.calls
    seconds: dict[str, float] = {}
    for t in traffic:
        by = t.term or t.by  # the term the piece prices it in (Traffic.term), else its own dimension
        dims = DIMENSION_GROUP.get(by) or (layout.shard_dims or ("dp_shard",))
        if t.calls is not None:
            n_calls = t.calls
        else:  # the counted calls the pieces do not account for, in proportion to the bytes
            share = t.bytes / by_kind[t.kind] if by_kind[t.kind] else 0
            n_calls = max(1, round(max((calls or {}).get(t.kind, 1) - known.get(t.kind, 0), 1) * share))
        fit = (shared or hw.fitted or {}).get(t.kind)
        if fit:  # measured per call on this group size: latency + the message's bytes / the fitted bandwidth
            at = lambda f: n_calls * f.latency + t.bytes / f.bandwidth  # noqa: B023, E731
            if t.kind == "recv":
                spent = 0.0
            elif t.kind in of_size.get(t.ranks, {}):  # a group of a size measured whole (all 4 ranks)
                spent = at(of_size[t.ranks][t.kind])
            elif t.kind in same_group:  # the calls with a new partner at one fit, the others at the other
                new = (switched or {}).get(t.kind, 1.0)
                spent = new * at(fit) + (1 - new) * at(same_group[t.kind])
            else:
                spent = at(fit)
        else:
            spent = collective_seconds(t.kind, t.bytes, t.ranks, link_of(layout, dims, hw), n_calls)
        seconds[by] = seconds.get(by, 0.0) + spent
    return seconds


def own_calls(ops: dict, phase: str, ddp: bool) -> list:
    """A fake rank's recorded calls of `phase` ([(OpCall, count)]); under a launch's DDP (`ddp`), less those
    FSDP2's hooks ran (the fake rank's replicate: DDP's reducer is C++; a ddp rank of the calibration's GPT
    recorded 486 ops forward, 256 of them in the hooks, where the model alone runs 170)."""
    calls = ops["calls"].get(phase, [])
    hooks = dict(ops.get("in_fsdp_hooks", {}).get(phase, [])) if ddp else {}
    return [(call, n - hooks.get(call, 0)) for call, n in calls if n > hooks.get(call, 0)]


def switched_shares(counted: dict) -> dict | None:
    """Per kind, the share of a fake rank's calls on a group other than its previous call's (`counted`: its
    CollectiveCounter's calls and switched)."""
    if "switched" not in counted:
        return None
    return {kind: counted["switched"].get(kind, 0) / n for kind, n in counted["calls"].items() if n}


def clip_collectives_seconds(counted: dict | None, layout: Layout, hw: Hardware) -> float:
    """The clipping's all-reduces of its squared sums (common/optim.clip_by_global_norm): as a fake rank counted
    them (`counted`: planning/fake_ranks' clip_collectives), else one of a float32 a dimension that splits the
    parameters (the pieces' groups of gradients: dp_shard's, tp's, ep's, and the stages' sum over pp)."""
    if counted is None:
        split = [d for d in (*layout.shard_dims, "tp", "ep", "pp") if getattr(layout, d) > 1]
        traffic = [
            Traffic("all_reduce", 4, getattr(layout, d), "clip", calls=1) for d in dict.fromkeys(split)
        ]
        return traffic_seconds(traffic, layout, hw).get("clip", 0.0)
    traffic = [
        Traffic(kind, sent, ranks, "clip", calls=calls)
        for kind, ranks, calls, sent in counted["on_groups_of"]
    ]
    return traffic_seconds(traffic, layout, hw, switched=switched_shares(counted)).get("clip", 0.0)
