"""The shape of the job (torchtitan's `ParallelDims`): how many ranks each dimension of parallelism takes,
where a rank sits in each, and the arithmetic of how a tensor is split, in which every piece's theory of
bytes held and sent is written.

Six degrees, outermost first (torchtitan's order: the pipeline outermost, its sends cross the slowest
links; tensor parallelism innermost, on the fastest), their product the world size:
  pp            pipeline stages: ranks that each hold some of the blocks (strategies/pp.py)
  dp_replicate  data-parallel replicas: whole copies of what the other dimensions split (replicate.py)
  dp_shard      data-parallel shards: ranks that split parameters, gradients, AdamW state (shard.py)
  ep            expert parallelism: data-parallel ranks that also split each MoE block's experts (ep.py)
  cp            context parallelism: ranks that split each sample's sequence (cp.py)
  tp            tensor parallelism: ranks that split every matrix (tp.py)
Ranks are numbered tp fastest, then cp, ep, dp_shard, dp_replicate, pp. The dp_replicate x dp_shard x ep ranks
each read their own share of the data; the tp, cp and pp ranks of one data-parallel rank read the same samples.

The gradient of a piece of the model is averaged over every rank that computed part of it: the data-parallel
ranks and the cp ranks (each saw its own tokens). When dp_shard > 1, FSDP shards over dp_shard x ep x cp and
replicates over dp_replicate (HSDP); otherwise every one of those ranks holds the piece whole and the
gradients are all-reduced over dp_replicate x ep x cp (`shard_dims`, `replicate_dims`, as torchtitan's
"dp_shard_cp"). The experts are the exception (ep.py): split over ep, averaged over the rest.

torchtitan counts the ep ranks inside its dp_shard (its dp_shard 4 with ep 2 is our --dp_shard 2 --ep 2), so
that ep borrows ranks from data parallelism; here every degree is a factor of the world size, ep too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.comm_counter import bus_factor

DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")  # outermost first


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees().values())

    def degrees(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in DIMS}

    def describe(self) -> str:
        """'dp_shard 2 x tp 2 x pp 2 (8 ranks)', the dimensions that are on, or 'one process'."""
        on = [f"{dim} {n}" for dim, n in self.degrees().items() if n > 1]
        return f"{' x '.join(on)} ({self.world_size} ranks)" if on else "one process"

    # ------------------------------------------------------------------------- where a rank sits
    def coordinate(self, rank: int, dim: str) -> int:
        """Rank `rank`'s index along `dim` (tp fastest)."""
        stride = math.prod(getattr(self, inner) for inner in DIMS[DIMS.index(dim) + 1 :])
        return (rank // stride) % getattr(self, dim)

    def rank_at(self, **coordinates: int) -> int:
        """The rank at these coordinates (the others 0)."""
        rank = 0
        for dim in DIMS:
            rank = rank * getattr(self, dim) + coordinates.get(dim, 0)
        return rank

    def group(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """The ranks that share every coordinate of `rank` but those of `dims` (its group over `dims`)."""
        mine = {dim: self.coordinate(rank, dim) for dim in DIMS}
        return [
            r
            for r in range(self.world_size)
            if all(self.coordinate(r, d) == mine[d] for d in DIMS if d not in dims)
        ]

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own share of every global batch."""
        return self.dp_replicate * self.dp_shard * self.ep

    def dp_rank(self, rank: int) -> int:
        """Which share of the data rank `rank` reads."""
        index = 0
        for dim in ("dp_replicate", "dp_shard", "ep"):
            index = index * getattr(self, dim) + self.coordinate(rank, dim)
        return index

    # ------------------------------------------------------------------ how data parallelism covers cp
    @property
    def shard_dims(self) -> tuple[str, ...]:
        """The dimensions FSDP shards over (empty: nothing sharded)."""
        return tuple(d for d in ("dp_shard", "ep", "cp") if getattr(self, d) > 1) if self.dp_shard > 1 else ()

    @property
    def replicate_dims(self) -> tuple[str, ...]:
        """The dimensions whose ranks hold the same piece whole and average its gradient."""
        dims = ("dp_replicate",) + (() if self.dp_shard > 1 else ("ep", "cp"))
        return tuple(d for d in dims if getattr(self, d) > 1)

    def size(self, dims: tuple[str, ...]) -> int:
        return math.prod(getattr(self, d) for d in dims)

    def mesh(self, device_type: str):
        """A DeviceMesh over every rank, of the accelerator's device type (gloo on CPU, NCCL on GPU), inside the
        process group Accelerate made: one mesh dimension per degree > 1, in DIMS order."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = [dim for dim, n in self.degrees().items() if n > 1]
        return init_device_mesh(
            device_type, tuple(getattr(self, d) for d in dims), mesh_dim_names=tuple(dims)
        )


def submesh(mesh, dims: tuple[str, ...]):
    """The mesh over `dims` (several dimensions flattened into one, named by joining theirs)."""
    if len(dims) == 1:
        return mesh[dims[0]]
    name = "_".join(dims)
    try:
        return mesh[name]
    except KeyError:
        return mesh[dims]._flatten(name)


# ----------------------------------------------------------------------------- the split arithmetic
def chunk_rows(rows: int, parts: int, index: int) -> int:
    """How many of `rows` rows torch.chunk gives part `index` of `parts` (DTensor and FSDP2 split so): pieces of
    ceil(rows / parts), the last ones short or empty. Arithmetic, not torch.chunk itself: at_scale asks it for
    every expert of every forward, and under fake tensors a chunk made 256 tensors a call (83 s of 89, profiled)."""
    piece = -(-rows // parts)
    return max(0, min(piece, rows - index * piece))


def padded_numel(shape, parts: int) -> int:
    """Elements of FSDP2's all-gather buffer for a tensor split in `parts` on dim 0: dim 0 padded up to a
    multiple of `parts` (uneven shards)."""
    return math.ceil(shape[0] / parts) * parts * math.prod(shape[1:])


def unique_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter), a tied weight once (under the first name that holds it)."""
    return list({id(p): (name, p) for name, p in model.named_parameters()}.values())


def unique_tensors(tensors) -> list:
    """Each tensor once (a tied weight is one parameter under two names)."""
    return list({id(t): t for t in tensors}.values())


@dataclass(frozen=True)
class Workload:
    """What a run asks of its layout, all the pieces' theory needs besides their own flags: the model's shape
    (common/gpt.GPTConfig), the rows each data-parallel rank takes per micro-batch, the micro-batches per
    optimizer step, the precision, the device type it trains on (a refusal of what a device cannot run)."""

    model: object  # GPTConfig
    rows: int
    micro_batches: int = 1
    mixed_precision: str = "no"
    device_type: str = "cpu"

    @property
    def tokens(self) -> int:
        """Tokens a data-parallel rank takes per micro-batch."""
        return self.rows * self.model.block_size


def stream_dtype(layout: Layout, work: Workload) -> torch.dtype:
    """The residual stream's dtype (what pipeline stages send, what a MoE dispatches, a norm's output): float32
    under autocast (a matmul's bf16 output added to a float32 stream stays float32), bf16 under FSDP's bf16
    policy (the embedding's bf16 copy starts it so)."""
    return torch.bfloat16 if work.mixed_precision == "bf16" and layout.shard_dims else torch.float32


@dataclass(frozen=True)
class Traffic:
    """Bytes of one kind of collective in one step, counted as common/comm_counter.py counts them (each call's
    whole tensor), on a group of `ranks` ranks, sent by the piece of parallelism named `by`."""

    kind: str
    bytes: int
    ranks: int
    by: str
    wire: float | None = None  # what leaves the rank, where the bus factor's even split does not hold
    calls: int | None = (
        None  # how many calls a step, where the piece knows it (else a share of those counted)
    )
    # the step's term that prices it, where not its piece's own (planning/cost_model.py): a pipeline's
    # collectives once a step after its schedule ("pp_step"), ep's gradient and counts all-reduces with the data
    # parallel ones ("ep_data_parallel"); the bytes stay its piece's
    term: str | None = None

    @property
    def wire_bytes(self) -> float:
        """What this rank puts on the wire for it: `wire` if the piece knows it (an uneven all-to-all: the rows it
        sends its peers, not itself), else the nccl-tests bus factor of its group's size; what it receives point
        to point it does not send."""
        if self.wire is not None:
            return self.wire
        if self.kind == "recv" or self.ranks == 1:
            return 0.0
        return bus_factor(self.kind, self.ranks) * self.bytes


@dataclass(frozen=True)
class Mistake:
    """A deliberate mistake a piece teaches (its --wrong_variant): what it is, and the runs under which it is one,
    `applies(plan)` (strategies/piece.Plan: the flags, the layout, the workload, DeepSpeed's ZeRO stage or None).
    A mistake that changes nothing under a run is refused there: no check could fail on it."""

    what: str
    applies: Callable[[object], bool]

    @classmethod
    def of(cls, dim: str, what: str) -> Mistake:
        """A mistake of dimension `dim`'s piece: one wherever that dimension runs (its degree > 1), DeepSpeed's
        engine aside (it replaces the pieces)."""
        return cls(what, lambda plan: plan.engine_stage is None and getattr(plan.layout, dim) > 1)
