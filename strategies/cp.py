"""cp: context parallelism. Each sample's sequence is split over the --cp ranks; each runs its piece of the model
on its share of the tokens only, so the activations each rank keeps fall as 1/N. Its gradients are averaged
with the data-parallel ranks' (strategies/layout.py: the cp ranks join dp_shard's sharding or dp_replicate's
replicas). What cannot be split is attention: a query attends to every key before it, wherever that key
lives. Written here by hand, as picotron does (PyTorch's `context_parallel` maps only CUDA attention kernels),
on the GPT's two hooks: each block's `attend` and the model's `positions`:

- **Keys and values all-gathered**, one all-gather each per block (torch's autograd-aware functional
  all-gather: its backward reduce-scatters their gradients to their owners). A ring (each rank passing its
  K/V block to the next, N - 1 times, while computing on the previous one) sends the same bytes in N - 1
  steps that can hide behind compute; on CPU gloo sends block, nothing overlaps, and each step costs a
  ~1 ms latency, so one all-gather is cheaper here (Llama 3 trains with all-gather CP for its small GQA K/V).
- **Partial results merged by their log-sum-exp.** Attention over one key block gives an output normalised
  by that block's softmax sum; outputs over several blocks combine as sum_b exp(lse_b - lse) o_b, with lse
  the log-sum-exp over all blocks: the flash-attention identity, exact. Each block runs PyTorch's fused CPU
  kernel, and the backward is written here (ChunkedAttention): the kernel's backward per block, given the
  merged output and log-sum-exp, so no score matrix is ever kept.
- **Causal masking, load-balanced.** The sequence is cut into 2N chunks; rank r holds chunks r and
  2N - 1 - r (a head chunk and a tail chunk), so each rank's queries see the same number of key chunks in
  all: without it (--cp_load_balance false: rank r holds chunks 2r, 2r + 1) the last rank does the most.
  A query chunk attends to earlier chunks whole, to its own with the causal mask, to later ones not at all.

Theory: nothing held changes but the activations. One step all-gathers K and V of every block the rank
holds (the whole sequence's, B x T x kv width / tp each: the all-gather's output; grouped-query attention gathers
its few key/value heads before repeating them) and reduce-scatters their gradients
(the same bytes), per micro-batch, over the cp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from common.config import flag, require
from common.device import device_time
from common.gpt import grouped
from strategies.layout import Layout, Mistake, Traffic
from strategies.piece import Context, HooksTheStep, Measures, Piece, Plan, Theory

MISTAKES = {  # each: what it is, and the runs under which it is one
    "cp_merge_without_lse": Mistake.of(
        "cp", "the partial attention outputs averaged, not rescaled by their log-sum-exp"
    ),
    "cp_causal_mask_not_shifted": Mistake.of(
        "cp", "every (query chunk, key chunk) pair masked as if both started at position 0"
    ),
}


@dataclass
class Flags:
    cp: int = flag(0, "context-parallel degree: ranks that split each sample's sequence, attention over keys and "
                   "values all-gathered per block (0, 1: off)")  # fmt: skip
    cp_load_balance: bool = flag(True, "with --cp: each rank holds a head and a tail chunk of the sequence (equal "
                                 "causal attention work); false: neighbouring chunks (the last rank does the most)")  # fmt: skip


def refuse(plan: Plan) -> None:
    layout, work = plan.layout, plan.work
    if layout.cp == 1:
        return
    # its attention runs PyTorch's fused CPU kernel and that kernel's backward (flash below): refused here, before
    # anything starts, on any other device (PyTorch's own context_parallel maps the CUDA kernels)
    require(work.device_type == "cpu", f"--cp {layout.cp} on {work.device_type}: this context parallelism's attention "
            "is the CPU kernel's; on GPUs use PyTorch's context_parallel (torch.distributed.tensor.experimental)")  # fmt: skip
    chunks = 2 * layout.cp
    require(work.model.block_size % chunks == 0, f"--block_size {work.model.block_size} with --cp {layout.cp}: the "
            f"sequence is cut into {chunks} equal chunks, so it must be a multiple of {chunks}")  # fmt: skip


def chunks_of(cp_rank: int, cp: int, balanced: bool) -> list[int]:
    """The sequence chunks (of 2 x cp) a cp rank holds: a head and a tail chunk, or two neighbours."""
    return [cp_rank, 2 * cp - 1 - cp_rank] if balanced else [2 * cp_rank, 2 * cp_rank + 1]


def flash(q, k, v, causal: bool):
    """PyTorch's fused CPU attention kernel: the output and each query's log-sum-exp, no score matrix kept."""
    require(q.device.type == "cpu", "--strategy cp's attention kernel is the CPU one (on CUDA use PyTorch's own "
            "context_parallel, which maps the CUDA kernels)")  # fmt: skip
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def merge(partial: list, without_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs over several key chunks as one: sum_b exp(lse_b - lse) o_b, lse the log-sum-exp of all; and lse."""
    outputs, lses = zip(*partial, strict=True)
    total = torch.logsumexp(torch.stack(lses), dim=0)
    if without_lse:  # the mistake
        return torch.stack(outputs).mean(dim=0), total
    return sum(torch.exp(lse - total).unsqueeze(-1) * out for out, lse in partial), total


class ChunkedAttention(torch.autograd.Function):
    """Attention of query chunks over key chunks by plan: [(query slice, [(key slice, causal), ...]), ...].
    Forward: the fused kernel per (query chunk, key chunk), merged by log-sum-exp. Backward: the fused
    kernel's backward per pair, given the MERGED output and log-sum-exp (the flash / ring-attention identity:
    the probabilities it recomputes are then the global ones), dK and dV summed into their chunks. What it
    keeps for backward: q, the gathered k and v, the output and log-sum-exp; never a score matrix."""

    @staticmethod
    def forward(ctx, q, k, v, plan, without_lse):
        out, lse = (
            torch.empty_like(q),
            q.new_empty(q.shape[:-1], dtype=torch.float32),
        )  # the kernel's lse: float32
        for rows, keys in plan:
            partial = [flash(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal) for cols, causal in keys]
            out[:, :, rows], lse[:, :, rows] = merge(partial, without_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, keys in ctx.plan:
            for cols, causal in keys:
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad_out[:, :, rows].contiguous(), q[:, :, rows], k[:, :, cols], v[:, :, cols],
                    out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), 0.0, causal,
                )  # fmt: skip
                dq[:, :, rows] += gq
                dk[:, :, cols] += gk
                dv[:, :, cols] += gv
        return dq, dk, dv, None, None


def plan_for(mine: list[int], holders: list[list[int]], size: int, mask_not_shifted: bool = False) -> list:
    """The (query slice, [(key slice, causal)]) pairs of a rank holding chunks `mine` (its local tokens, in
    order), the keys gathered in rank order (`holders`): a query chunk attends to earlier chunks whole, to
    its own with the causal mask, to later ones not at all."""
    where = {chunk: 2 * rank + j for rank, chunks in enumerate(holders) for j, chunk in enumerate(chunks)}
    plan = []
    for j, chunk in enumerate(mine):
        if mask_not_shifted:  # the mistake: every pair masked as if it were the diagonal one
            keys = [(slice(where[b] * size, (where[b] + 1) * size), True) for b in sorted(where)]
        else:
            keys = [
                (slice(where[b] * size, (where[b] + 1) * size), b == chunk)
                for b in sorted(where)
                if b <= chunk
            ]
        plan.append((slice(j * size, (j + 1) * size), keys))
    return plan


class ContextParallelAttention:
    """Causal attention of this rank's query chunks over every rank's keys and values (the module docstring)."""

    def __init__(self, group, cp_rank: int, cp: int, balanced: bool, variant: str):
        self.group = group
        self.mine = chunks_of(cp_rank, cp, balanced)
        self.holders = [chunks_of(r, cp, balanced) for r in range(cp)]  # chunks in all-gather order
        self.merge_without_lse = variant == "cp_merge_without_lse"
        self.mask_not_shifted = variant == "cp_causal_mask_not_shifted"
        self.seconds = 0.0  # time computing attention (the all-gathers left out): the load balance

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (batch, heads, local tokens, head_dim); the local tokens are this rank's chunks, in order
        k_all = funcol.all_gather_single_autograd(k.contiguous(), gather_dim=2, group=self.group)
        v_all = funcol.all_gather_single_autograd(v.contiguous(), gather_dim=2, group=self.group)
        started = device_time(q.device)  # after the all-gathers: attention's own time
        plan = plan_for(self.mine, self.holders, q.shape[2] // 2, self.mask_not_shifted)
        k_all, v_all = (
            grouped(q, k_all),
            grouped(q, v_all),
        )  # (grouped-query attention: gathered, then repeated)
        out = ChunkedAttention.apply(q.contiguous(), k_all, v_all, plan, self.merge_without_lse)
        self.seconds += device_time(q.device) - started
        return out


class ChunkPositions:
    """The GPT's `positions` hook under context parallelism: the positions of this rank's chunks, in order."""

    def __init__(self, chunks: list[int]):
        self.chunks = chunks

    def __call__(self, length: int, device) -> torch.Tensor:
        size = length // len(self.chunks)
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunks])


def apply(model, cp_mesh, layout: Layout, rank: int, args) -> list[ContextParallelAttention]:
    """Attention by context parallelism in every block `model` holds, and its positions this rank's chunks.
    Returns the attentions (their timings, for `report`)."""
    cp_rank, balanced = layout.coordinate(rank, "cp"), args.cp_load_balance
    group = cp_mesh.get_group()
    attentions = []
    positions = ChunkPositions(chunks_of(cp_rank, layout.cp, balanced))
    for block in model.blocks.values():
        block.attn.attend = ContextParallelAttention(group, cp_rank, layout.cp, balanced, args.wrong_variant)
        block.attn.positions = positions  # rotary embeddings turn each token by its own position
        attentions.append(block.attn.attend)
    model.positions = positions
    return attentions


def split_batch(x: torch.Tensor, y: torch.Tensor, layout: Layout, rank: int, args) -> tuple:
    """This rank's tokens of every sample (and their targets): its chunks of each sequence."""
    chunks = chunks_of(layout.coordinate(rank, "cp"), layout.cp, args.cp_load_balance)
    positions = ChunkPositions(chunks)(x.shape[1] // layout.cp, x.device)
    return x[:, positions], y[:, positions]


def sent(t: Theory) -> list[Traffic]:
    """Per micro-batch, every block this rank holds all-gathers K and V (the whole sequence's, this rank's
    tensor-parallel share of the key/value heads) and reduce-scatters their gradients, over the cp ranks: two calls
    of each a block and micro-batch (known, so that a predictor does not share out FSDP's calls of the same kinds,
    over other ranks, by bytes)."""
    layout, work, blocks = t.layout, t.work, t.blocks
    kv_width = work.model.kv_heads * (work.model.d_model // work.model.n_head)
    element = 2 if work.mixed_precision == "bf16" else 4  # K and V: matmul outputs, bf16 under either bf16
    whole = work.micro_batches * work.tokens * kv_width // layout.tp * element
    calls = 2 * blocks * work.micro_batches
    return [
        Traffic(kind, 2 * blocks * whole, layout.cp, "cp", calls=calls)
        for kind in ("all_gather", "reduce_scatter")
    ]


def report(session, attentions: list[ContextParallelAttention], balanced: bool) -> None:
    """Each rank's time computing attention (the all-gathers left out), gathered: the load balance."""
    mine = sum(attention.seconds for attention in attentions)
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    if session.is_main:
        session.metrics["attention_s_per_rank"] = every_rank
        session.metrics["attention_imbalance"] = max(every_rank) / max(min(every_rank), 1e-12)
        session.print(
            f"attention time per rank (s): {', '.join(f'{s:.3f}' for s in every_rank)}; slowest / fastest "
            f"{session.metrics['attention_imbalance']:.2f} ({'balanced' if balanced else 'unbalanced'} chunks)"
        )


class ContextParallel(Piece, HooksTheStep, Measures):
    name = dim = "cp"
    Flags = Flags
    MISTAKES = MISTAKES

    def traits(self, plan: Plan) -> set[str]:
        return {"collectives_in_attention"}  # an autograd function of its own around all-gathers

    def refuse(self, plan: Plan) -> None:
        refuse(plan)

    def apply(self, stages: list, ctx: Context) -> list:
        ctx.runtime[self.name] = [
            a for stage in stages for a in apply(stage, ctx.mesh["cp"], ctx.layout, ctx.rank, ctx.args)
        ]
        return stages

    def sent(self, t: Theory) -> list[Traffic]:
        return sent(t)

    def split_batch(self, job, x, y) -> tuple:
        return split_batch(x, y, job.layout, job.rank, job.args)

    def report(self, job, session) -> None:
        report(session, job.state(self), job.args.cp_load_balance)


PIECE = ContextParallel()
