"""The closed form's compute: the op list a pipeline stage's rank runs in one micro-batch's forward and backward,
made without a process group, so that the planner's thousands of layouts and at_scale's recorded ops are priced
the same way, by one op model (planning/op_model.py's OpModel.phase_seconds).

How. The model's own modules (common/gpt.py's Block, its embedding, its final norm, head and loss) are built on
fake tensors at the rank's local shapes and run forward and backward under the planning/ops.OpRecorder a fake
rank records with, in the run's precision (autocast over float32 weights; bf16 weights under FSDP's policy):
  tp      each Linear holds its shard (q, k, v and the MLP's input split by output, o and the MLP's output by
          input; the head by vocabulary, its logits gathered whole for the loss: strategies/tp.py);
  cp      the rank's share of the tokens (a head and a tail chunk), its attention strategies/cp.py's (the fused
          kernel per pair of chunks, merged by log-sum-exp), K and V gathered as concatenations;
  sp      (tp's sequence parallelism) the norms and residual adds over T / tp tokens, the rest over T;
  pp      the stage's blocks, the embedding on the first stage, the norm, head and loss on the last;
  FSDP    its copies into and out of the all-gather and reduce-scatter buffers (torch.ops.fsdp, memory-bound),
          in bytes of the parameters it gathers (the rule read off fake ranks at dp_shard 2 and 4, each copy a
          multiple of the unsharded bf16 bytes B: copy-in B (2 + 2 / dp), split 3 B, the shard's cast 4 B / dp;
          the gradients' chunk_cat 5 B);
  full activation checkpointing: the backward runs each block's forward again, up to its last saved tensor.
A block of a mixture of experts runs its own MoE as a rank of ep does (its E / ep experts; the routing uniform, as a
fake rank assumes, fake tensors holding none; strategies/ep's all-to-all, what its collectives return new tensors).
A transformers model (--hf_config) is traced as the project's GPT of its shape: its own modules dispatch other ops
(docs/your_model.md).

`kernels` says which kernels the run assumes (planning/kernels.py):
  eager   the ops our eager modules dispatch (RMSNorm as pow, mean, rsqrt and multiplies in float32; SwiGLU as
          silu and a multiply; rope as a dozen ops; autocast's casts): what a fake rank records;
  fused   what fused kernels run (Megatron-LM's and Meta's: a norm, an activation, a rotary embedding each one
          kernel that reads its inputs and writes its outputs once; weights held in bf16, so no casts; a pipeline's
          weight gradients accumulated in float32 by their GEMMs): each such module's eager ops replaced by one op
          of those bytes;
and `attention` which attention kernel: flash (the ranks') or materialised (before FlashAttention).
Not in the list: collectives (planning/communication.py), DTensor's and FSDP's Python (the op model's overheads, from
a fake rank's counts only), the optimizer and clipping (per parameter: planning/cost_model.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

import torch
from torch import nn

from planning.kernels import ATTENTION, KERNELS, fused, fused_final_norm, materialised
from planning.ops import OpCall, op_name
from planning.tracing import built, dense, record
from strategies.activation_checkpointing import SAVED_BY_SELECTIVE
from strategies.ep import AllToAll, is_expert
from strategies.layout import stream_dtype
from strategies.replicate import replicates_whole_model

# the ops whose outputs selective checkpointing saves, by the name an OpCall has
SAVED_BY_SELECTIVE_NAMES = {op_name(op)[1] for op in SAVED_BY_SELECTIVE}
# FSDP's split and gradient copies, x the unsharded bf16 bytes (the module docstring; its copy-in: B (2 + 2 / dp))
FSDP_SPLIT, FSDP_GRADIENT_COPY = 3, 5


def stage_ops(cfg, layout, args, work, rows: int, blocks: int, first: bool, last: bool, kernels: str = "eager",
              microbatches: int = 1, attention: str = "flash",
              held: list = ()) -> dict[str, list[tuple[OpCall, int]]]:  # fmt: skip
    """{"forward": [(OpCall, count)], "backward": [...]}: one micro-batch of `rows` sequences on a rank of a stage
    holding `blocks` blocks (and the ends `first` and `last` say). `held`: the parameters the rank holds before
    data parallelism (a Theory's, (name, shape)): what FSDP gathers of them (fsdp_gathered: all before the forward,
    the blocks' again before the backward; the ends, the root's group, stay gathered; under a pipeline's
    `microbatches`, once a step, a micro-batch's share), and without FSDP the float32 gradients a pipeline
    accumulates and PyTorch's replicate copies (_add_unsharded_gradient_copies). `attention`: the attention kernel
    (flash, or materialised: planning/kernels.materialised)."""
    if kernels not in KERNELS or attention not in ATTENTION:
        raise ValueError(f"kernels {kernels!r}, attention {attention!r}: one of {KERNELS} and of {ATTENTION}")
    # bf16 weights under FSDP's policy, whose bf16 stream they start; else float32 ones, under autocast in bf16
    bf16_weights = stream_dtype(layout, work) == torch.bfloat16
    autocast = work.mixed_precision == "bf16" and not bf16_weights
    key = (_shape_key(cfg), rows, layout.tp, layout.cp, bool(getattr(args, "sequence_parallel", False)), layout.ep,
           autocast, bf16_weights, kernels)  # fmt: skip
    # a fake rank's data-parallel ranks (FSDP, or PyTorch's replicate for DDP) hold parameters that are no leaves
    wrapped = layout.world_size // (layout.tp * layout.pp * layout.ep) > 1
    block, ends = _at_rows(_block_ops, key, ()), _at_rows(_ends_ops, key, (first, last, wrapped))
    checkpointing = getattr(args, "activation_checkpointing", "none")
    phases = {}
    for phase in ("forward", "backward"):
        counts = Counter()
        for call, n in block[phase]:
            counts[call] += n * blocks
        if phase == "backward" and checkpointing != "none":
            for call, n in _recomputed(block["forward"], cfg, rows, layout, args, work, checkpointing):
                counts[call] += n * blocks
        for call, n in ends[phase]:
            counts[call] += n
        phases[phase] = counts
    # autocast's casts of the weights, once in its region: a pipeline's step runs every micro-batch's forward and
    # backward in one (a micro-batch's share of them here), a step without one its forward, and its backward
    # (outside it) again for a checkpointed block's recompute (measured on fake ranks)
    share = microbatches if layout.pp > 1 else 1
    for call, n in [(c, n * blocks) for c, n in block["weight_casts"]] + ends["weight_casts"]:
        phases["forward"][dataclasses.replace(call, bytes=call.bytes // share)] += n
    if checkpointing != "none" and layout.pp == 1:
        for call, n in block["weight_casts"]:
            phases["backward"][call] += n * blocks
    gathered = fsdp_gathered(held, layout, work)
    # under tp the first stage's embedding gradient arrives whole (tp's vocabulary split: DTensor's choice) and is
    # summed so, by FSDP or autograd, until tp.align_gradients keeps the rank's rows (a copy of them)
    whole = (cfg.vocab_size - math.ceil(cfg.vocab_size / layout.tp)) * cfg.d_model if first else 0
    if not gathered[0] and held:
        _add_unsharded_gradient_copies(phases, layout, held, whole, microbatches, kernels == "fused")
    if gathered[0]:
        # (a tied weight on a stage with the head: its rows kept with the head's gradient, _vocabulary_parallel_ops)
        sliced_here = first and layout.tp > 1 and not (last and cfg.tie_weights)
        rows_kept = math.ceil(cfg.vocab_size / layout.tp) * cfg.d_model if sliced_here else 0
        element = stream_dtype(layout, work).itemsize  # FSDP's parameter dtype
        if layout.pp > 1:
            fused_accumulation = kernels == "fused"
            _add_fsdp_copies_pipelined(phases, gathered[0], layout.size(layout.shard_dims), microbatches,
                                       fused_accumulation, whole * element)  # fmt: skip
            # the float32 sum's rows, once a step
            kept = OpCall("clone", "memory", "float32", (), 0.0, int(2 * 4 * rows_kept / microbatches))
        else:
            kept = OpCall(
                "clone", "memory", "bfloat16" if element == 2 else "float32", (), 0.0, 2 * element * rows_kept
            )
        if rows_kept:
            phases["backward"][kept] += 1
        if layout.pp == 1:
            # the backward gathers again what the forward resharded: the blocks (ZeRO-3, the default), every unit
            # (always), nothing (never: ZeRO-2)
            reshard = getattr(args, "reshard_after_forward", "default")
            again = {"default": gathered[1], "always": gathered[0], "never": 0}[reshard]
            _add_fsdp_copies(phases, gathered[0], again, layout.size(layout.shard_dims))
    if attention == "materialised":
        phases = {phase: materialised(counts) for phase, counts in phases.items()}
    return {phase: list(counts.items()) for phase, counts in phases.items()}


# per (trace, its key but the rows, its extra arguments): {rows: the op list traced at those rows}
_TRACED: dict = {}


def _at_rows(trace, key: tuple, extra: tuple) -> dict[str, list]:
    """`trace`'s op list at the key's rows. Every op of a step is affine in the rows (a batch's tokens; the weights'
    part the same), so once two row counts of a shape are traced, each op's shape, FLOPs and bytes at any other
    follow from them, exactly: a planner's layouts differ in rows most, and pay at most two traces a shape. Traced
    directly while fewer than two are, or where two traces do not pair op by op."""
    rows, points = key[1], _TRACED.setdefault((trace, key[0], *key[2:], *extra), {})
    if rows not in points and len(points) >= 2:
        (r1, one), (r2, two) = list(points.items())[:2]
        if all(len(one[p]) == len(two[p]) and all(n1 == n2 and a.name == b.name for (a, n1), (b, n2)
                                                  in zip(one[p], two[p], strict=True)) for p in one):  # fmt: skip

            def grown(x1, x2):
                step = (x2 - x1) * (rows - r1) / (r2 - r1)
                return x1 + (round(step) if isinstance(x1, int) else step)

            def op_at_rows(a: OpCall, b: OpCall) -> OpCall:
                shape = tuple(grown(u, v) for u, v in zip(a.shape, b.shape, strict=True))
                return OpCall(a.name, a.kind, a.dtype, shape, grown(a.flops, b.flops), grown(a.bytes, b.bytes),
                              a.causal, a.backward)  # fmt: skip

            # kept: a planner asks again for the rows it priced (one stage's, then the other stages')
            points[rows] = {phase: [(op_at_rows(a, b), n) for (a, n), (b, _) in zip(one[phase], two[phase], strict=True)]
                            for phase in one}  # fmt: skip
    if rows not in points:
        points[rows] = trace(*key, *extra)
    return points[rows]


def fsdp_gathered(held: list, layout, work) -> tuple[int, int]:
    """What FSDP gathers for a stage and for its blocks, in bytes: the parameters the
    stage's rank holds before data parallelism (a Theory's `held`), in the dtype FSDP gathers them, less the
    experts ep splits (FSDP leaves them out); (0, 0) without FSDP."""
    if not layout.shard_dims:
        return 0, 0
    element = stream_dtype(layout, work).itemsize  # FSDP's parameter dtype: the stream's
    kept = [(name, math.prod(shape)) for name, shape in held if not (layout.ep > 1 and is_expert(name))]
    return (
        sum(n for _, n in kept) * element,
        sum(n for name, n in kept if name.startswith("blocks.")) * element,
    )


def _recomputed(forward: list, cfg, rows: int, layout, args, work, mode: str = "full") -> list:
    """The forward a checkpointed block runs again in its backward: all of it but its MLP's output matmul and the
    residual add after it, whose outputs nothing saved needs (torch.utils.checkpoint stops its recompute at the
    last saved tensor: measured on fake ranks); under selective checkpointing, less the ops whose outputs its
    policy saved (the matmuls and attention: strategies/activation_checkpointing.SAVED_BY_SELECTIVE)."""
    sp = layout.tp if getattr(args, "sequence_parallel", False) else 1
    tokens = rows * cfg.block_size // layout.cp
    stream = stream_dtype(layout, work).itemsize
    branch = 2 if work.mixed_precision == "bf16" else 4
    last_matmul = (tokens, cfg.hidden // layout.tp, cfg.d_model)
    residual_add = (2 * stream + branch) * tokens // sp * cfg.d_model
    skipped = [next((c for c, _ in forward if c.kind == "gemm" and c.shape == last_matmul), None),
               next((c for c, _ in forward if c.name == "add" and c.bytes == residual_add), None)]  # fmt: skip
    if mode == "selective":
        forward = [(c, n) for c, n in forward if c.name not in SAVED_BY_SELECTIVE_NAMES]
    return [(c, n - skipped.count(c)) for c, n in forward if n - skipped.count(c) > 0]


def _add_unsharded_gradient_copies(
    phases: dict, layout, held: list, whole_embedding: int, m: int, fused_accumulation: bool
) -> None:
    """Float32 gradients without FSDP (read off fake ranks at 2 and 4 micro-batches: pp, pp x tp, pp x dp_replicate,
    tp x dp_replicate), in bytes a parameter held: under a pipeline autograd adds each micro-batch's gradient after
    the first into the one it holds (add_, 12), the whole-vocabulary embedding gradient of a first stage under tp
    too; fused kernels accumulate in their weight-gradient GEMMs instead (as under FSDP). PyTorch's replicate
    (dp_replicate where a rank is not a replica of the whole model: that is a launch's DDP, its reducer C++ and
    not priced), once a step: a copy_ before the forward and the gradients' copies into and out of the
    all-reduce's buffer (chunk_cat, copy_), 12 each, of the parameters but ep's experts (ep holds those). Per
    micro-batch: a step's over m."""
    replicated = sum(math.prod(shape) for name, shape in held if not (layout.ep > 1 and is_expert(name)))
    elements = sum(math.prod(shape) for _, shape in held)
    if layout.pp > 1 and not fused_accumulation and m > 1:
        phases["backward"][
            OpCall("add_", "memory", "float32", (), 0.0, int(12 * (elements + whole_embedding) * (m - 1) / m))
        ] += 1
    if layout.replicate_dims and not replicates_whole_model(layout):
        once = int(12 * replicated / (m if layout.pp > 1 else 1))
        phases["forward"][OpCall("copy_", "memory", "float32", (), 0.0, once)] += 1
        for name in ("chunk_cat", "copy_"):
            phases["backward"][OpCall(name, "memory", "float32", (), 0.0, once)] += 1


def _add_fsdp_copies(phases: dict, gathered: int, again: int, shards: int) -> None:
    """FSDP's copies per micro-batch: an unshard before the forward and, before the backward, of what it resharded
    after the forward (`again` bytes), the gradients' copy into the reduce-scatter's buffer. Fused or not: FSDP's."""
    for phase, b in (("forward", gathered), ("backward", again)):
        if not b:
            continue
        for name, moved in (("all_gather_copy_in", b * (2 + 2 / shards)), ("split_with_sizes_copy", FSDP_SPLIT * b),
                            ("_foreach_copy_", 4 * b / shards)):  # fmt: skip
            phases[phase][OpCall(name, "memory", "bfloat16", (), 0.0, int(moved))] += 1
    phases["backward"][OpCall("chunk_cat", "memory", "bfloat16", (), 0.0, FSDP_GRADIENT_COPY * gathered)] += 1


def _add_fsdp_copies_pipelined(
    phases: dict, gathered: int, shards: int, m: int, fused_accumulation: bool, whole_embedding: int = 0
) -> None:
    """FSDP under a pipeline (read off fake ranks at 2 and 4 micro-batches): one unshard a step, before the first
    forward (it reshards after the last backward); the first micro-batch's gradients cast to float32 (3 B), each
    later one's added into that float32 sum (add_: 5 B), one reduce-scatter's float32 copy-in (6 B); B the
    unsharded bf16 bytes, and the cast and the add_ also over `whole_embedding` (a first stage's embedding gradient
    beyond the tp rank's rows, whole until tp slices it). Per micro-batch: a step's over m. With fused kernels the
    weight-gradient GEMMs accumulate into the float32 sum themselves (Megatron-LM's gradient_accumulation_fusion):
    no cast, no add_."""
    b = gathered
    for name, moved in (("all_gather_copy_in", b * (2 + 2 / shards)), ("split_with_sizes_copy", FSDP_SPLIT * b),
                        ("_foreach_copy_", 4 * b / shards)):  # fmt: skip
        phases["forward"][OpCall(name, "memory", "bfloat16", (), 0.0, int(moved / m))] += 1
    accumulated = 0 if fused_accumulation else 1
    summed = (b + whole_embedding) * accumulated
    for name, dtype, moved in (("_to_copy", "bfloat16", 3 * summed), ("add_", "float32", 5 * summed * (m - 1)),
                               ("chunk_cat", "float32", 6 * b)):  # fmt: skip
        if moved:
            phases["backward"][OpCall(name, "memory", dtype, (), 0.0, int(moved / m))] += 1


def _shape_key(cfg) -> tuple:
    return (cfg.vocab_size, cfg.block_size, cfg.n_head, cfg.d_model, cfg.kv_heads, cfg.hidden, cfg.mlp, cfg.norm,
            cfg.positions, cfg.bias, cfg.tie_weights, cfg.rope_theta, cfg.n_experts, cfg.top_k,
            cfg.n_shared_experts, cfg.router, cfg.route_norm, cfg.aux_loss_coef, cfg.expert_matmul)  # fmt: skip


def _config(shape: tuple):
    from common.gpt import GPTConfig

    (vocab, block_size, n_head, d, kv, hidden, mlp, norm, positions, bias, tie, theta, experts, top_k,
     shared, router, route_norm, aux_loss_coef, expert_matmul) = shape  # fmt: skip
    return GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=1, n_head=n_head, d_model=d,
                     n_kv_head=kv, d_ff=hidden, mlp=mlp, norm=norm, positions=positions, bias=bias,
                     tie_weights=tie, rope_theta=theta, n_experts=experts, top_k=top_k,
                     n_shared_experts=shared, router=router, route_norm=route_norm, aux_loss_coef=aux_loss_coef,
                     expert_matmul=expert_matmul)  # fmt: skip


def _shard(linear: nn.Linear, out_parts: int = 1, in_parts: int = 1) -> None:
    """The Linear's tp shard: its weight (out, in) split by output (column-parallel) or by input (row-parallel)."""
    out_features, in_features = linear.weight.shape
    dtype = linear.weight.dtype
    linear.weight = nn.Parameter(torch.empty(out_features // out_parts, in_features // in_parts, dtype=dtype))
    if linear.bias is not None and out_parts > 1:
        linear.bias = nn.Parameter(torch.empty(out_features // out_parts, dtype=dtype))


def _block_ops(shape, rows, tp, cp, sp, ep, autocast, bf16_weights, kernels) -> dict[str, list]:
    """One block's ops, forward and backward, at the rank's shapes (the module docstring)."""
    from common.gpt import Block

    cfg = _config(shape)
    weights = torch.bfloat16 if bf16_weights else torch.float32
    tokens, sp_tokens = cfg.block_size // cp, cfg.block_size // cp // (tp if sp else 1)

    def run(recorder):
        with torch.device("cpu"):
            block = built(lambda: Block(cfg), weights)
        attn, mlp = block.attn, block.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            _shard(lin, out_parts=tp)
        _shard(attn.o_proj, in_parts=tp)
        if cfg.n_experts:  # whole on every tp rank (strategies/tp.py leaves it so)
            _as_expert_parallel_rank(mlp, ep, torch.float32 if ep > 1 and bf16_weights else weights)
        else:
            for lin in (mlp.fc_in, *([mlp.fc_gate] if mlp.fc_gate else [])):
                _shard(lin, out_parts=tp)
            _shard(mlp.fc_out, in_parts=tp)
        if cp > 1:
            attn.attend, attn.positions = _context_parallel_attention(cp), _chunk_positions(cp)
        recorder.calls.clear()  # the modules' construction is not the step
        x = torch.empty(rows, sp_tokens, cfg.d_model, dtype=weights, requires_grad=True)
        # autocast casts each weight once in its region: the next forward finds them cached (without autocast
        # the two forwards run the same ops: one is traced)
        if autocast:
            recorder.phase = "first"
            _block_forward(block, x, tp if sp else 1)
        recorder.phase = "forward"
        out = _block_forward(block, x, tp if sp else 1)
        recorder.phase = "backward"
        out.backward(torch.empty_like(out))

    calls = _with_weight_casts(record(run, autocast))
    if cp > 1:  # the K and V all-gathers' backward: each gradient laid out for its reduce-scatter (a cat)
        kv = rows * cfg.kv_heads // tp * cfg.block_size * (cfg.d_model // cfg.n_head)
        element = 2 if (autocast or bf16_weights) else 4
        calls["backward"] = calls["backward"] + [(OpCall("cat", "memory", str(weights if element == 4 else
                                                  torch.bfloat16).removeprefix("torch."), (), 0.0,
                                                  2 * element * kv), 2)]  # fmt: skip
    if kernels == "fused":
        calls = fused(calls, cfg, rows, tokens, sp_tokens, tp, weights, autocast)
    return calls


def _block_forward(block, x, sequence_split: int):
    """Block.forward, with sequence parallelism's gathers (the tokens' shards concatenated) and scatters (this
    rank's shard kept) around the attention and the MLP."""

    def gathered(h):
        # the other ranks' shards are new tensors (a collective's output): no gradient summed over them
        others = [torch.empty_like(h) for _ in range(sequence_split - 1)]
        return torch.cat([h, *others], dim=1) if sequence_split > 1 else h

    def scattered(h):
        return h.narrow(1, 0, h.shape[1] // sequence_split) if sequence_split > 1 else h

    x = x + scattered(block.attn(gathered(block.ln_1(x))))
    return x + scattered(block.mlp(gathered(block.ln_2(x))))


def _as_expert_parallel_rank(moe, ep: int, expert_weights) -> None:
    """A MoE MLP as a rank of ep runs it: its E / ep experts' weights (in `expert_weights`: FSDP's bf16 policy leaves
    ep's experts float32), the routing uniform (planning/fake_ranks.uniform_order, what a fake rank assumes) and,
    under ep, strategies/ep's all-to-all with new tensors for what its collectives return (_TracedAllToAll)."""
    from planning.fake_ranks import uniform_order

    local = moe.n_experts // ep
    for name in ("w_in", "w_gate", "w_out"):
        weight = getattr(moe, name)
        if weight is not None:
            setattr(moe, name, nn.Parameter(torch.empty(local, *weight.shape[1:], dtype=expert_weights)))
    moe.order = functools.partial(uniform_order, moe)
    if ep > 1:
        moe.exchange = _TracedAllToAll(ep)


class _TracedAllToAll(AllToAll):
    """strategies/ep.AllToAll without a process group: every rank routes alike, and what its all-to-alls return
    are new tensors of the rows it receives (a collective's output: no op of this rank's)."""

    def __init__(self, ep: int):
        super().__init__(None, ep, "")
        self.assume_same_routing = True

    def rank(self) -> int:
        return 0

    def counts_from_peers(self, sent_counts: torch.Tensor) -> torch.Tensor:
        return sent_counts

    def rows_from_peers(self, rows: torch.Tensor, receive: list[int], send: list[int]) -> torch.Tensor:
        return _Received.apply(rows, sum(receive))


class _Received(torch.autograd.Function):
    """`rows` sent, as many received: new tensors both ways (the gradient sent back too)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: int) -> torch.Tensor:
        ctx.sent = rows.shape
        return rows.new_empty(received, *rows.shape[1:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.new_empty(ctx.sent), None


def _with_weight_casts(recorded: dict) -> dict[str, list]:
    """A trace's forward and backward, and apart (`weight_casts`) what a first forward ran that the one after did not:
    autocast's casts of the weights, which it caches for the rest of its region (none without autocast)."""
    calls = dense(recorded)
    first = recorded.get("first", Counter())
    cached = first - recorded.get("forward", Counter())
    calls["weight_casts"] = [(c, n) for c, n in cached.items() if c.kind != "view"]
    return calls


def _context_parallel_attention(cp: int):
    """strategies/cp.py's attention of the first cp rank (each holds a head and a tail chunk: the same work), its
    all-gathers of K and V the rank's own chunks beside new tensors (a collective's output: no gradient summed)."""
    from common.gpt import grouped
    from strategies.cp import ChunkedAttention, chunks_of, plan_for

    mine, holders = chunks_of(0, cp, True), [chunks_of(r, cp, True) for r in range(cp)]

    def attend(q, k, v):
        gathered = [
            torch.cat([t.contiguous(), *(torch.empty_like(t) for _ in range(cp - 1))], dim=2) for t in (k, v)
        ]
        k_all, v_all = grouped(q, gathered[0]), grouped(q, gathered[1])
        return ChunkedAttention.apply(
            q.contiguous(), k_all, v_all, plan_for(mine, holders, q.shape[2] // 2), False
        )

    return attend


def _chunk_positions(cp: int):
    from strategies.cp import ChunkPositions, chunks_of

    return ChunkPositions(chunks_of(0, cp, True))


def _ends_ops(
    shape, rows, tp, cp, sp, ep, autocast, bf16_weights, kernels, first, last, wrapped
) -> dict[str, list]:
    """The first stage's embedding (and learned positions), the last stage's norm, head and loss: the GPT's own
    modules, the embedding and the head split by vocabulary under tp, the logits gathered whole for the loss."""
    from common.gpt import GPT, lm_loss

    cfg = _config(shape)
    weights = torch.bfloat16 if bf16_weights else torch.float32
    tokens = cfg.block_size // cp
    if not (first or last):
        return {"forward": [], "backward": [], "weight_casts": []}

    def run(recorder):
        import dataclasses

        with torch.device("cpu"):
            gpt = built(lambda: GPT(dataclasses.replace(cfg, n_layer=0)), weights)
        # a tied head without tp keeps its tie where a fake rank's data-parallel wrapping (FSDP, replicate) makes
        # the weight no leaf, so that autograd sums its two gradients in an add (a plain rank's recorded none)
        if tp > 1 or not wrapped:
            _shard(gpt.head, out_parts=tp)
            gpt.tok_emb.weight = nn.Parameter(
                torch.empty(-(-cfg.vocab_size // tp), cfg.d_model, dtype=weights)
            )
        recorder.calls.clear()
        if first:
            x = gpt.tok_emb(torch.zeros(rows, tokens, dtype=torch.long))
            if gpt.pos_emb is not None:
                x = x + gpt.pos_emb(torch.arange(tokens))
        else:
            x = torch.empty(rows, tokens, cfg.d_model, dtype=weights, requires_grad=True)
        if last:
            if autocast:  # the head's weight cast, cached for the forward after (as a block's)
                recorder.phase = "first"
                gpt.head(gpt.ln_f(x))
            recorder.phase = "forward"
            logits = gpt.head(gpt.ln_f(x))
            others = [torch.empty_like(logits) for _ in range(tp - 1)]  # the other ranks' shards
            logits = torch.cat([logits, *others], dim=-1) if tp > 1 else logits
            out = lm_loss(logits, torch.zeros(rows, tokens, dtype=torch.long))
        else:
            out = x
        recorder.phase = "backward"
        out.backward(torch.empty_like(out) if out.dim() else None)

    calls = _with_weight_casts(record(run, autocast))
    for phase, ops in _vocabulary_parallel_ops(
        cfg, rows * tokens, tp, first, last, weights, autocast
    ).items():
        calls[phase] = calls[phase] + [(op, 1) for op in ops]
    if kernels == "fused" and last:
        calls = fused_final_norm(calls, cfg, rows, tokens, weights, autocast)
    return calls


def _vocabulary_parallel_ops(
    cfg, tokens: int, tp: int, first: bool, last: bool, weights, autocast: bool
) -> dict:
    """What tp's vocabulary split adds to the plain modules traced (strategies/tp.py, as a fake rank records it):
    the embedding's lookups outside the rank's rows zeroed (index_put_, forward), and its backward handing the
    whole vocabulary's gradient (DTensor's choice: tp.align_gradients slices it after) where the plain one writes
    the rank's rows; the gathered logits' gradient cut back to the rank's shard (a clone); a tied weight's
    gradient sliced (a clone) and summed with the head's."""
    ops = {"forward": [], "backward": []}
    if tp == 1:
        return ops
    e, d = weights.itemsize, cfg.d_model
    dtype, logits_e = str(weights).removeprefix("torch."), 2 if (autocast or weights == torch.bfloat16) else 4
    shard = math.ceil(cfg.vocab_size / tp)
    if first:
        ops["forward"].append(OpCall("index_put_", "memory", dtype, (), 0.0, 2 * e * tokens * d + tokens + e))
        whole = (cfg.vocab_size - shard) * d * e  # the rows beyond the rank's, written by the backward too
        ops["backward"].append(OpCall("embedding_dense_backward", "memory", dtype, (), 0.0, whole))
    if last:
        logits = "bfloat16" if logits_e == 2 else "float32"
        ops["backward"].append(OpCall("clone", "memory", logits, (), 0.0, 2 * logits_e * tokens * shard))
    if first and last and cfg.tie_weights:
        ops["backward"].append(OpCall("clone", "memory", dtype, (), 0.0, 2 * e * shard * d))
        ops["backward"].append(OpCall("add", "memory", dtype, (), 0.0, 3 * e * shard * d))
    return ops
