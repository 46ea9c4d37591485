"""cp: context parallelism. Each sample's sequence is split over the ranks; every rank holds the whole model
(data parallelism: DDP through Accelerate's prepare(), over every rank) and runs it on its share of the
tokens only, so the activations each rank keeps fall as 1/N. What cannot be split is attention: a query
attends to every key before it, wherever that key lives. Written here by hand, as picotron does (PyTorch's
`context_parallel` maps only CUDA attention kernels):

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

Theory: each rank holds what a DDP rank holds; one step all-gathers K and V of every block (the full
sequence's, B x T x d each: the all-gather's output) and reduce-scatters their gradients (the same bytes),
per micro-batch, over the cp ranks, and all-reduces every gradient once over all ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from common.config import require
from common.gpt import GPT
from strategies import ddp
from strategies.defaults import (  # noqa: F401  # fmt: skip (the interface)
    STEADY_STEP,
    backward,
    checkpointer,
    clip,
    forward,
    measure_held,
    measure_window,
    quiet,
    with_optimizer,
)
from strategies.layout import Layout, bus_factor, unique_parameters

NAME = "cp"
SUMMARY = "context parallelism: each sample's sequence split over the ranks, K/V all-gathered per block"
RANKS = 2
CHECKPOINT_FORMAT = "dcp"  # PyTorch's distributed checkpoint: any layout reads it
AUTOCAST = True
OWN_WRONG_VARIANTS = {
    "cp_merge_without_lse": "the partial attention outputs averaged, not rescaled by their log-sum-exp",
    "cp_causal_mask_not_shifted": "every (query chunk, key chunk) pair masked as if both started at position 0",
}
WRONG_VARIANTS = (*OWN_WRONG_VARIANTS, "resume_without_optimizer_state", "resume_without_data_position")


def layout(world_size: int, dp_size: int = 0, tp_size: int = 0) -> Layout:
    dp = dp_size or 1
    require(
        tp_size in (0, 1) and world_size % dp == 0 and world_size // dp >= 2,
        f"--strategy cp needs >= 2 ranks per sequence and no --tp_size: {world_size} ranks, --dp_size {dp_size}, "
        f"--tp_size {tp_size} (e.g. 2 ranks, or 4 ranks with --dp_size 2)",
    )
    return Layout(world_size, dp, cp=world_size // dp)


def refuse(cfg, layout: Layout) -> None:
    chunks = 2 * layout.cp
    require(cfg.block_size % chunks == 0, f"--block_size {cfg.block_size} with --strategy cp on {layout.cp} ranks: "
            f"the sequence is cut into {chunks} equal chunks, so it must be a multiple of {chunks}")  # fmt: skip
    require(cfg.mixed_precision == "no", "--mixed_precision bf16 with --strategy cp: not built")
    require(cfg.activation_checkpointing == "none", "--activation_checkpointing with --strategy cp: not built (the "
            "recompute would all-gather K and V again)")  # fmt: skip


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
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
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
        k_all = funcol.all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.group)
        v_all = funcol.all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.group)
        started = time.perf_counter()
        plan = plan_for(self.mine, self.holders, q.shape[2] // 2, self.mask_not_shifted)
        out = ChunkedAttention.apply(q.contiguous(), k_all, v_all, plan, self.merge_without_lse)
        self.seconds += time.perf_counter() - started
        return out


class ContextParallelGPT(nn.Module):
    """The GPT (the same modules under the same names) run on this rank's chunks of each sequence: forward
    takes whole (batch, T) tokens and targets, as every strategy's, and returns the mean loss over its own."""

    configure_optimizers = GPT.configure_optimizers

    def __init__(self, gpt: GPT, chunks: list[int], n_chunks: int):
        super().__init__()
        self.tok_emb, self.pos_emb, self.blocks, self.ln_f, self.head = (
            gpt.tok_emb, gpt.pos_emb, gpt.blocks, gpt.ln_f, gpt.head
        )  # fmt: skip
        self.chunks, self.n_chunks = chunks, n_chunks

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        size = idx.shape[1] // self.n_chunks
        positions = torch.cat(
            [torch.arange(c * size, (c + 1) * size, device=idx.device) for c in self.chunks]
        )
        x = self.tok_emb(idx[:, positions]) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets[:, positions].flatten())


def apply(model: GPT, layout: Layout, accelerator, cfg):
    """Attention by context parallelism in every block, the GPT on this rank's chunks, DDP over every rank."""
    rank = accelerator.process_index
    group = layout.mesh(accelerator.device.type)["cp"].get_group()
    cp_rank, balanced = layout.cp_rank(rank), cfg.cp_load_balance
    attentions = []
    for block in model.blocks:
        block.attn.attend = ContextParallelAttention(group, cp_rank, layout.cp, balanced, cfg.wrong_variant)
        attentions.append(block.attn.attend)
    piece = ContextParallelGPT(
        model.to(accelerator.device), chunks_of(cp_rank, layout.cp, balanced), 2 * layout.cp
    )
    piece.attentions = attentions  # a plain list: their timings, for `report`
    return with_optimizer(accelerator.prepare(piece), accelerator, cfg)


held_bytes = ddp.held_bytes  # every rank holds everything


def sent_bytes(model: GPT, layout: Layout, cfg) -> dict:
    """Per micro-batch, every block all-gathers K and V (the whole sequence's) and reduce-scatters their
    gradients, over the cp ranks; DDP all-reduces every gradient once per step, over every rank."""
    k = cfg.gradient_accumulation_steps
    whole = cfg.per_rank_batch_size * cfg.block_size * model.cfg.d_model * 4
    context = {
        "all_gather": k * 2 * model.cfg.n_layer * whole,
        "reduce_scatter": k * 2 * model.cfg.n_layer * whole,
    }
    data = {"all_reduce": sum(p.numel() * 4 for _, p in unique_parameters(model))}
    wire = sum(bus_factor(kind, layout.cp) * size for kind, size in context.items())
    wire += bus_factor("all_reduce", layout.world_size) * data["all_reduce"]
    return {"by_kind": {**context, **data}, "data_parallel": data, "tensor_parallel": {}, "context_parallel": context,
            "wire_bytes": wire}  # fmt: skip


def report(session, model, cfg) -> None:
    """Each rank's time computing attention (the all-gathers left out), gathered: the load balance."""
    piece = getattr(model, "module", model)
    mine = sum(attention.seconds for attention in piece.attentions)
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    if session.is_main:
        session.metrics["attention_s_per_rank"] = every_rank
        session.metrics["attention_imbalance"] = max(every_rank) / max(min(every_rank), 1e-12)
        session.print(
            f"attention time per rank (s): {', '.join(f'{s:.3f}' for s in every_rank)}; slowest / fastest "
            f"{session.metrics['attention_imbalance']:.2f} ({'balanced' if cfg.cp_load_balance else 'unbalanced'} chunks)"
        )
