"""Where a sharded step's time goes (issue #31): train_gpt's GPT step under DDP, FSDP2 (zero2, fsdp) and
tensor parallelism, each with the variants that could remove time, timed interleaved in one run. Each
phase is given as wall time and as the main thread's own CPU time.

    torchrun --nproc_per_node 2 benchmarks/sharding_step.py             # ~3 minutes
    torchrun --nproc_per_node 2 benchmarks/sharding_step.py --rounds 2  # a quick look
    torchrun --nproc_per_node 2 benchmarks/sharding_step.py --variants fsdp,fsdp_async --compile

Each rank runs one thread (as under accelerate launch) and AdamW is fused everywhere. `cpu` is the time
the training thread itself ran (time.thread_time); wall - cpu is time it waited: for a collective, for
the other rank, or for a core while gloo's threads ran on it. A trace that counts an operator's whole
span as "compute" counts that wait as compute; on 2 ranks over 2 cores the two are not separable there.

Variants (data-parallel ones: each rank its own 4 x 64 tokens; tensor-parallel ones: both ranks the same):
- local: the model alone, no communication: the compute floor of one rank.
- ddp, ddp_1mb, ddp_4mb: DDP with gradient buckets of 25 MB (its default), 1 MB, 4 MB.
- zero2, fsdp: strategies/fsdp.shard, as train_gpt runs them (zero2: the whole model one FSDP2 unit;
  fsdp: each block a unit, then the root).
- fsdp_prefetch_2: the next two blocks' all-gathers asked for ahead (FSDP2's explicit prefetch).
- fsdp_async: all-gathers issued asynchronously (FSDP2's _set_unshard_async_op) with one-ahead prefetch.
- zero2_per_block (zero2 before #31: each block a unit), fsdp_units_of_2 (blocks in pairs): more or fewer,
  smaller or larger collectives. The bytes sent are the same (FSDP2 pads each parameter, not each unit).
- tp, tp_unfused: strategies/tp.parallelize (DTensor), AdamW fused per tensor kind / PyTorch's default.
- tp_compiled (with --compile): tp with each block compiled by torch.compile (Inductor's C++ kernels on
  CPU; ~20 s of compiling before the first step, not timed).
- tp_plain: the same Megatron plan on plain tensors with its collectives written out (picotron's way):
  no DTensor on the step's path; the same collectives, counted below.
Then each strategy's collectives alone, with no compute: zero2's and fsdp's all-gathers and reduce-scatters
through FSDP2's own buffers, tp's all-reduces and all-gather at the same sizes.
Rank 0 prints one markdown table. After the same updates on the same rows every variant's loss must equal
one process's within 1e-4 (data-parallel: the ranks' mean against an untimed model on all 8 rows; tensor-
parallel: against local), or the run fails.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from common.gpt import PER_RANK_BATCH_SIZE, GPTConfig, build_gpt, lm_loss
from strategies import shard, tp
from strategies.args import ParallelArgs
from strategies.layout import Layout, Workload

DATA_PARALLEL = ("ddp", "ddp_1mb", "ddp_4mb", "zero2", "fsdp", "fsdp_prefetch_2", "fsdp_async",
                 "zero2_per_block", "fsdp_units_of_2")  # fmt: skip
TENSOR_PARALLEL = ("tp", "tp_unfused", "tp_plain", "tp_compiled")
VARIANTS = ("local", *DATA_PARALLEL, *TENSOR_PARALLEL[:-1])


# --- tensor parallelism on plain tensors: Megatron's f and g, the vocabulary split, by hand -------------
class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: the replicated input as it is; in backward the ranks' partial gradients summed."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: the ranks' partial sums added into the output; in backward the gradient as it is."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class GatherVocabulary(torch.autograd.Function):
    """Each rank's logits over its share of the vocabulary, all-gathered into the whole; backward: its share."""

    @staticmethod
    def forward(ctx, local_logits):
        world = dist.get_world_size()
        gathered = torch.empty(
            (world * local_logits.shape[0], *local_logits.shape[1:]), dtype=local_logits.dtype
        )
        dist.all_gather_into_tensor(gathered, local_logits.contiguous())
        return torch.cat(gathered.chunk(world, dim=0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()].contiguous()


def split_plain(model) -> None:
    """Keep this rank's rows (column-parallel: q, k, v, fc_in, the vocabulary) or columns (row-parallel:
    o_proj, fc_out) of each matrix as a plain parameter."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def keep(module, name, dim):
        piece = getattr(module, name).detach().chunk(world, dim=dim)[rank].clone()
        setattr(module, name, torch.nn.Parameter(piece))

    for block in model.blocks.values():
        for linear in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.mlp.fc_in):
            keep(linear, "weight", 0)
            if linear.bias is not None:
                keep(linear, "bias", 0)
        for linear in (block.attn.o_proj, block.mlp.fc_out):
            keep(linear, "weight", 1)
    keep(model.tok_emb, "weight", 0)
    model.head.weight = model.tok_emb.weight


def plain_tp_loss(model, idx, targets):
    """The GPT's forward with the tp plan's collectives written out: 4 per block, 2 more, one all-gather."""
    rows = model.tok_emb.weight.shape[0]
    local_ids = idx - dist.get_rank() * rows
    outside = (local_ids < 0) | (local_ids >= rows)
    x = F.embedding(local_ids.masked_fill(outside, 0), model.tok_emb.weight).masked_fill(
        outside[..., None], 0.0
    )
    x = ReduceFromTensorParallel.apply(x) + model.pos_emb(torch.arange(idx.shape[1]))
    for block in model.blocks.values():
        attn, mlp = block.attn, block.mlp
        h = CopyToTensorParallel.apply(block.ln_1(x))
        batch, time_, _ = h.shape
        q, k, v = (
            proj(h).view(batch, time_, -1, attn.head_dim).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        attended = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, time_, -1)
        )
        x = x + ReduceFromTensorParallel.apply(F.linear(attended, attn.o_proj.weight)) + attn.o_proj.bias
        h = CopyToTensorParallel.apply(block.ln_2(x))
        x = (
            x
            + ReduceFromTensorParallel.apply(F.linear(F.gelu(mlp.fc_in(h)), mlp.fc_out.weight))
            + mlp.fc_out.bias
        )
    h = CopyToTensorParallel.apply(model.ln_f(x))
    logits = GatherVocabulary.apply(F.linear(h, model.head.weight))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- the variants -------------------------------------------------------------------------------------
def build(variant: str, cfg: GPTConfig, mesh):
    """(model, optimizer, loss function) of one variant."""
    model = build_gpt(cfg, 0)
    loss_of = lambda x, y: lm_loss(model(x), y)  # noqa: E731
    if variant.startswith("ddp"):
        bucket_mb = {"ddp": 25, "ddp_1mb": 1, "ddp_4mb": 4}[variant]
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        loss_of = lambda x, y: lm_loss(wrapped(x), y)  # noqa: E731
    elif variant == "zero2_per_block":  # zero2 as it was before #31
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
    elif variant == "fsdp_units_of_2":
        blocks = list(model.blocks.values())
        for pair in (blocks[i : i + 2] for i in range(0, len(blocks), 2)):
            fully_shard(pair, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh)
    elif variant in ("zero2", "fsdp", "fsdp_prefetch_2", "fsdp_async"):
        args = ParallelArgs(reshard_after_forward="never" if variant == "zero2" else "default")
        shard.apply(model, mesh, args, Layout(dp_shard=mesh.size()), Workload(cfg, PER_RANK_BATCH_SIZE))
        if variant in ("fsdp_prefetch_2", "fsdp_async"):
            ahead, blocks = (2 if variant == "fsdp_prefetch_2" else 1), list(model.blocks.values())
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + ahead])
                block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - ahead) : i])))
            model._set_unshard_async_op(variant == "fsdp_async")
    elif variant in ("tp", "tp_unfused", "tp_compiled"):
        tp.apply(model, mesh, ParallelArgs())
        if variant == "tp_compiled":  # Inductor's C++ kernels per block: DTensor's dispatch traced away once
            for block in model.blocks.values():
                block.compile()
    elif variant == "tp_plain":
        split_plain(model)
        loss_of = lambda x, y: plain_tp_loss(model, x, y)  # noqa: E731
    optimizer = model.configure_optimizers(lr=1e-3, weight_decay=0.1)
    if variant == "tp_unfused":  # as before #31: one group per decay, PyTorch's CPU default
        decay = [p for group in optimizer.param_groups if group["weight_decay"] for p in group["params"]]
        rest = [p for group in optimizer.param_groups if not group["weight_decay"] for p in group["params"]]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                      lr=1e-3, betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
    return model, optimizer, loss_of


def timed_step(optimizer, loss_of, x, y) -> dict:
    marks = [(time.perf_counter(), time.thread_time())]
    loss = loss_of(x, y)
    marks.append((time.perf_counter(), time.thread_time()))
    loss.backward()
    marks.append((time.perf_counter(), time.thread_time()))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    marks.append((time.perf_counter(), time.thread_time()))
    row = {"loss": loss.item()}
    for phase, start, end in zip(("forward", "backward", "optimizer"), marks, marks[1:], strict=False):
        row[phase], row[phase + "_cpu"] = 1e3 * (end[0] - start[0]), 1e3 * (end[1] - start[1])
    row["step"], row["step_cpu"] = 1e3 * (marks[-1][0] - marks[0][0]), 1e3 * (marks[-1][1] - marks[0][1])
    return row


def collectives_only(model, zero3: bool) -> float:
    """A zero2 / fsdp step's communication alone, no model compute, through FSDP2's own unshard(): fsdp's
    root and blocks all-gathered (the blocks again for backward), zero2's one unit once; then one float32
    reduce-scatter per unit of its parameters' size. Milliseconds."""
    blocks = list(model.blocks.values()) if zero3 else []
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root_own = [p for p in model.parameters() if id(p) not in in_blocks]
    started = time.perf_counter()
    for unit in [model, *blocks, *blocks]:  # forward: root, blocks; backward: blocks again
        unit.unshard()
        unit.reshard()
    world = dist.get_world_size()
    for params in [root_own, *(list(block.parameters()) for block in blocks)]:
        shard_numel = sum(p.to_local().numel() for p in params)
        dist.reduce_scatter_tensor(torch.empty(shard_numel), torch.empty(shard_numel * world))
    return 1e3 * (time.perf_counter() - started)


def tp_collectives_only(cfg: GPTConfig) -> float:
    """tp's step's communication alone, no compute: the activation all-reduces (4 per block and 2 more) and
    the logits' all-gather, at train_gpt's default sizes. Milliseconds."""
    world = dist.get_world_size()
    activation = torch.zeros(PER_RANK_BATCH_SIZE, cfg.block_size, cfg.d_model)
    logits = torch.zeros(PER_RANK_BATCH_SIZE, cfg.block_size, cfg.vocab_size // world)
    gathered = torch.empty(world * PER_RANK_BATCH_SIZE, cfg.block_size, cfg.vocab_size // world)
    started = time.perf_counter()
    for _ in range(4 * cfg.n_layer + 2):
        dist.all_reduce(activation)
    dist.all_gather_into_tensor(gathered, logits)
    return 1e3 * (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (each variant in turn)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument(
        "--compile", action="store_true", help="also tp_compiled (needs a C++ compiler; ~20 s)"
    )
    parser.add_argument(
        "--variants", default="", help="comma-separated, from " + ", ".join(VARIANTS) + " (default: all; "
        "local and ddp always run: they are the reference and the ratio's denominator)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be >= 1, got {args.rounds}, {args.steps}")
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()] or list(VARIANTS)
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    variants = tuple(v for v in VARIANTS if v in {"local", "ddp", *chosen}) + ("tp_compiled",) * args.compile
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    cfg = GPTConfig()
    # every rank makes every rank's rows: a data-parallel variant takes its own 4, local and tp the first 4
    # (tp: the same on both ranks), and an untimed one-process reference all 8 (the data-parallel global batch)
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (world * PER_RANK_BATCH_SIZE, cfg.block_size), generator=generator)
            for _ in "xy")  # fmt: skip
    own, first = (
        slice(rank * PER_RANK_BATCH_SIZE, (rank + 1) * PER_RANK_BATCH_SIZE),
        slice(0, PER_RANK_BATCH_SIZE),
    )
    inputs = {v: (x[own], y[own]) if v in DATA_PARALLEL else (x[first], y[first]) for v in variants}
    inputs["reference"] = (x, y)
    built = {v: build(v, cfg, mesh) for v in (*variants, "reference")}
    rows = {v: [] for v in built}
    comm_only = {"zero2": [], "fsdp": [], "tp": []}
    for v in built:  # warm-up: every variant sees the same 3 updates before timing
        for _ in range(3):
            timed_step(*built[v][1:], *inputs[v])
    for _ in range(args.rounds):
        for v in built:
            dist.barrier()
            rows[v] += [timed_step(*built[v][1:], *inputs[v]) for _ in range(args.steps)]
        dist.barrier()
        for v in ("zero2", "fsdp"):
            if v in built:
                comm_only[v] += [collectives_only(built[v][0], zero3=v == "fsdp") for _ in range(args.steps)]
        comm_only["tp"] += [tp_collectives_only(cfg) for _ in range(args.steps)]
    # the same data and updates: a data-parallel variant's last loss (the mean of its ranks') is the
    # reference's, a tp variant's is local's
    last = torch.tensor([rows[v][-1]["loss"] for v in variants])
    mean_of_ranks = last.clone()
    dist.all_reduce(mean_of_ranks)
    mean_of_ranks /= world
    difference = {v: abs(float(mean_of_ranks[i]) - rows["reference"][-1]["loss"]) if v in DATA_PARALLEL
                  else abs(float(last[i]) - rows["local"][-1]["loss"]) for i, v in enumerate(variants)}  # fmt: skip
    worst = max(difference.values())
    if rank == 0:
        median = lambda v, key: statistics.median(r[key] for r in rows[v])  # noqa: E731
        tokens = {
            v: PER_RANK_BATCH_SIZE * cfg.block_size * (world if v in DATA_PARALLEL else 1) for v in variants
        }
        rate = {v: tokens[v] / median(v, "step") for v in variants}
        print(f"torchrun {world} ranks, 1 thread each, fused AdamW; {args.rounds} rounds x {args.steps} steps "
              f"interleaved; median ms on rank 0 (the training thread's CPU ms)\n")  # fmt: skip
        print("| variant | tokens per step | step | forward | backward | optimizer | tokens/s / ddp's |")
        print("|---|---|---|---|---|---|---|")
        for v in variants:
            cells = [
                f"{median(v, p):.1f} ({median(v, p + '_cpu'):.1f})"
                for p in ("step", "forward", "backward", "optimizer")
            ]
            print(f"| {v} | {tokens[v]} | {' | '.join(cells)} | {rate[v] / rate['ddp']:.2f} |")
        alone = ", ".join(f"{v} {statistics.median(ms):.1f}" for v, ms in comm_only.items() if ms)
        print(f"\na step's collectives alone, no compute (zero2, fsdp: through FSDP2's buffers), ms: {alone}")
        print(f"loss after {3 + args.rounds * args.steps} updates against one process's on the same rows: largest "
              f"difference {worst:.1e} ({'equal' if worst < 1e-4 else 'NOT EQUAL'} within 1e-4)")  # fmt: skip
    gc.collect()  # the models (DDP, FSDP2) hold the group: gone before it is torn down
    dist.barrier()
    dist.destroy_process_group()
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
