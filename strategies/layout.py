"""How the ranks are arranged: one place for the shape of the job and its refusals (torchtitan's
`ParallelDims`). A Layout is pp x dp x cp x tp ranks: `pp` pipeline stages (ranks that each hold some of
the blocks), `dp` data-parallel groups that each read their own share of the data, `cp` ranks that split
each sample's sequence, `tp` ranks per tensor-parallel group that read the same data and each hold a
piece of every layer. Ranks are numbered tp fastest, then cp, dp, pp (torchtitan's order: the pipeline
outermost, its sends cross the slowest links; tensor parallelism innermost, on the fastest).

Also the arithmetic of how a tensor is split (`piece_shape`), which every strategy's theory of bytes
held and sent is written in: torch.chunk's split, as DTensor and FSDP2 split dim 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.comm_counter import bus_factor
from common.config import require


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context-parallel ranks: the ranks that split each sample's sequence (strategies/cp.py)

    def __post_init__(self):
        require(
            self.pp * self.dp * self.cp * self.tp == self.world_size,
            f"{'--pp_size ' + str(self.pp) + ' x ' if self.pp > 1 else ''}--dp_size {self.dp} x "
            f"{'--cp_size ' + str(self.cp) + ' x ' if self.cp > 1 else ''}--tp_size {self.tp} "
            f"must equal the {self.world_size} ranks launched",
        )

    def dp_rank(self, rank: int) -> int:
        """Which share of the data rank `rank` reads: the ranks of one tensor-parallel or context-parallel
        group, and the stages of one pipeline, read the same samples."""
        return (rank // (self.cp * self.tp)) % self.dp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.dp * self.cp * self.tp)

    def mesh(self, device_type: str):
        """A DeviceMesh over every rank, of the accelerator's device type (gloo on CPU, NCCL on GPU), inside
        the process group Accelerate made: ("dp", "tp"), with "pp" first for a pipeline and "cp" before "tp"
        for context parallelism."""
        from torch.distributed.tensor import init_device_mesh

        dims = [("pp", self.pp)] * (self.pp > 1) + [("dp", self.dp)] + [("cp", self.cp)] * (self.cp > 1)
        dims += [("tp", self.tp)]
        return init_device_mesh(
            device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims)
        )


def data_parallel_only(strategy: str, world_size: int, dp_size: int, tp_size: int) -> Layout:
    """Every rank a data-parallel rank (ddp, zero2, fsdp): >= 2 ranks, and no --dp_size / --tp_size."""
    require_ranks(strategy, world_size)
    require(
        not (dp_size or tp_size), f"--dp_size / --tp_size are for --strategy tp and fsdp_tp, not {strategy}"
    )
    return Layout(world_size, world_size)


def require_ranks(strategy: str, world_size: int) -> None:
    require(
        (strategy == "none") == (world_size == 1),
        f"--strategy {strategy} with {world_size} rank(s): 'none' is one process, the others need >= 2 ranks "
        "(accelerate_configs/cpu_ddp.yaml)",
    )


def chunk_rows(rows: int, parts: int, index: int) -> int:
    """How many of `rows` rows torch.chunk gives part `index` of `parts` (DTensor and FSDP2 split so)."""
    chunks = torch.chunk(torch.empty(rows, device="meta"), parts)
    return chunks[index].shape[0] if index < len(chunks) else 0


def piece_shape(shape, layout: Layout, rank: int, tp_split_dim: int | None, dp_sharded: bool) -> list[int]:
    """The shape of the piece of a parameter that rank `rank` holds: first tensor parallelism's split of
    dimension `tp_split_dim` (None: replicated) across the tp ranks, then, if `dp_sharded`, FSDP2's split
    of dim 0 of that piece across the data-parallel groups (torch.chunk of a chunk)."""
    shape = list(shape)
    if tp_split_dim is not None:
        shape[tp_split_dim] = chunk_rows(shape[tp_split_dim], layout.tp, layout.tp_rank(rank))
    if dp_sharded:
        shape[0] = chunk_rows(shape[0], layout.dp, layout.dp_rank(rank))
    return shape


def padded_numel(shape, parts: int) -> int:
    """Elements of FSDP2's all-gather buffer for a tensor split in `parts` on dim 0: dim 0 padded up to a
    multiple of `parts` (uneven shards)."""
    return math.ceil(shape[0] / parts) * parts * math.prod(shape[1:])


def unique_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter), a tied weight once (under the first name that holds it)."""
    return list({id(p): (name, p) for name, p in model.named_parameters()}.values())


def held(params: int, tensors: int, between_forward_and_backward: int | None = None) -> dict:
    """A rank's bytes by theory, from the bytes of the parameters it holds at rest (`tensors` of them):
    gradients shaped like them; AdamW's exp_avg and exp_avg_sq shaped like them plus a 4-byte step count
    per tensor; the parameters held between forward and backward (default: as at rest)."""
    return {
        "params": params,
        "grads": params,
        "optimizer": 2 * params + 4 * tensors,
        "params_between_forward_and_backward": params
        if between_forward_and_backward is None
        else between_forward_and_backward,
    }


def communication(data_parallel: dict, tensor_parallel: dict, layout: Layout) -> dict:
    """The bytes of one step by kind (what common/comm_counter.py counts: each call's full tensor), split by
    the group that sends them, and what each rank puts on the wire (the bus factor of that group's size)."""
    by_kind = {
        kind: data_parallel.get(kind, 0) + tensor_parallel.get(kind, 0)
        for kind in {**data_parallel, **tensor_parallel}
    }
    wire = sum(bus_factor(kind, layout.dp) * size for kind, size in data_parallel.items() if layout.dp > 1)
    wire += sum(bus_factor(kind, layout.tp) * size for kind, size in tensor_parallel.items() if layout.tp > 1)
    return {
        "by_kind": by_kind,
        "data_parallel": data_parallel,
        "tensor_parallel": tensor_parallel,
        "wire_bytes": wire,
    }
