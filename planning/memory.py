"""What a rank holds at its busiest moment, ESTIMATED from the theory: parameters, AdamW's state, FSDP's gathered
copies, the gradients and each micro-batch's activations in flight (experiments/at_scale.py measures the same
categories on fake ranks and prints both; tools/plan.py and the predictor read the estimate)."""

from __future__ import annotations

from common.gpt import GPTConfig, parameter_count
from strategies.layout import Layout, Workload, stream_dtype
from strategies.pp_schedules import stages_per_rank
from strategies.theory import theory_of


def activation_bytes(work: Workload, layout: Layout, args, blocks: int, first: bool, last: bool) -> float:
    """An ESTIMATE of the bytes one micro-batch's forward keeps for backward on a rank (experiments/at_scale.py
    measures them and prints both), per block in the manner of Korthikanti et al. 2022's Table 2 but for this
    GPT: t tokens on the rank, width d, MLP width h, n = tp, s = n under sequence parallelism (else 1), e the
    activations' element size (bf16: 2), the stream's element float32 under autocast, bf16 under FSDP's policy:
      norms     each its input (t d / s) and statistics, and its output (t d: the matmuls' input, gathered under
                sequence parallelism; not under autocast, where the matmul keeps its bf16 copy instead); RMSNorm
                its input in float32 (a bf16 stream's upcast) and x / rms, float32 too (8 t d / s)
      attention q, k, v (k and v repeated for grouped-query attention) and its output (4 t d / n; with rope one
                more copy, o_proj's input, and rope's cos and sin tables, float32: 8 T head_dim for a sequence
                of T positions on the rank), its log-sum-exp (heads / n x t, float32); no t^2 term: the
                fused kernel keeps no attention matrix; under context parallelism (c ranks) q, the whole
                sequence's K and V gathered and repeated for the query heads (2 c t d / n), its output and
                o_proj's copy of it
      MLP       GELU's input and output (2 t h / n); SwiGLU's gate, up, silu and product (4 t h / n)
      autocast  the bf16 copies of each matmul's float32 input and of the block's weights (its cache)
    Full checkpointing keeps each block's input alone; selective its input and its matmuls', attention's and
    tp's collectives' outputs (selective_block_bytes). The last
    stage adds its final norm, the head's input (under autocast its bf16 copy, and the bf16 copy of the head's
    weight, V d / n) and the loss's float32 logits (t V, gathered)."""
    cfg, tp = work.model, layout.tp
    m = args.pp_microbatches if layout.pp > 1 else 1
    t = (work.rows // m) * cfg.block_size // layout.cp
    s = tp if args.sequence_parallel else 1
    bf16 = work.mixed_precision == "bf16"
    autocast = bf16 and not layout.shard_dims
    e, stream_e = (2 if bf16 else 4), stream_dtype(layout, work).itemsize
    d, h, heads = cfg.d_model, cfg.hidden, cfg.n_head
    stats = (1 if cfg.norm == "rmsnorm" else 2) * 4 * t / s
    # a norm keeps its input and statistics; RMSNorm computes in float32 and keeps its input as float32 (under a
    # bf16 stream its upcast, not the bf16 input: measured) and x / rms; its output is the next matmul's saved
    # input, which under autocast keeps its bf16 copy instead (casts, below: measured, a block's activations 20 %
    # over this estimate with it)
    norm_kept = t * d / s * (8 if cfg.norm == "rmsnorm" else stream_e) + stats
    norm = norm_kept + (0 if autocast else t * d * stream_e)
    # rope: q and k turned are contiguous by head, so attention's output is too and o_proj's input is a copy of it;
    # each turn keeps its cos and sin (float32, a sequence's positions x head_dim / 2). Grouped K and V repeated
    # for the query heads are what attention keeps (q, k, v: t d / n each)
    rope = cfg.positions == "rope"
    # under cp (c ranks) attention keeps the whole sequence's K and V, gathered and repeated for the query heads
    # (2 c t d / n), q, its output and o_proj's copy of it, whatever the positions (measured)
    kept_by_attention = 4 + rope if layout.cp == 1 else 3 + 2 * layout.cp
    attention = kept_by_attention * t * d / tp * e + heads / tp * t * 4
    attention += rope * 4 * (cfg.block_size // layout.cp) * (d // heads // 2) * 4  # cos, sin for q and for k
    mlp = (4 if cfg.mlp == "swiglu" else 2) * t * h / tp * e
    mlp_input_casts = 2 if cfg.mlp == "swiglu" else 1
    if cfg.n_experts:
        mlp, mlp_input_casts = moe_activation_bytes(cfg, layout, t, e, stream_e, autocast)
    casts = 0.0
    if autocast:
        one_block = parameter_count(GPTConfig(**{**cfg.__dict__, "n_layer": 1})) - parameter_count(
            GPTConfig(**{**cfg.__dict__, "n_layer": 0})
        )
        # a rank casts the experts it holds (E / ep of them), whole on every tp rank
        experts = cfg.n_experts * (3 if cfg.mlp == "swiglu" else 2) * d * h
        one_block = (one_block - experts) / tp + experts / layout.ep
        casts = (3 + mlp_input_casts) * t * d * 2 + one_block * 2
    per_block = {
        "none": 2 * norm + attention + mlp + casts,
        "full": t * d / s * stream_e,
        "selective": selective_block_bytes(cfg, layout, args, t, e, stream_e),
    }[args.activation_checkpointing]
    ends = 0.0
    if last:  # the final norm, the head's input and the loss's float32 logits
        # under autocast the head keeps the bf16 copies of its input and of its (vocab-parallel) weight, not the
        # norm's float32 output (measured: the last stage's activations 15 % over this estimate without them)
        head_input = t * d * (2 if autocast else stream_e)
        head_weight = cfg.vocab_size * d / tp * 2 if autocast else 0.0
        ends = norm_kept + head_input + head_weight + t * cfg.vocab_size * 4
    return blocks * per_block + ends


def selective_block_bytes(cfg, layout: Layout, args, t: float, e: int, stream_e: int) -> float:
    """A block's bytes kept under selective checkpointing (strategies/activation_checkpointing.py): its input,
    and the output of every op the policy saves, whether backward reads it or not, in the matmuls' dtype e (bf16
    under autocast, where nothing else is kept: the casts are recomputed):
      q, k, v (k and v kv_heads wide) and attention's output with its log-sum-exp (float32);
      fc_in's (SwiGLU: the gate's and up's);
      o_proj's and fc_out's, which under tp are each rank's full-width partial sums (t d) and the all-reduce's
      result (t d) again, or under sequence parallelism the reduce-scatter's (t d / n); and then the two
      all-gathers of the norms' outputs (t d, the residual stream's dtype).
    A MoE MLP (its grouped GEMMs are recomputed): the router's scores (t E), the shared experts' matmul outputs
    (as a dense MLP's, over the t tokens), and under ep what its all-to-alls return: the R = t k rows dispatched (in
    the residual stream's dtype) and combined (in the matmuls')."""
    tp, d, heads = layout.tp, cfg.d_model, cfg.n_head
    sp = args.sequence_parallel and tp > 1
    kv_width = cfg.kv_heads * (d // heads)
    row_parallel = t * d * e + ((t * d / tp if sp else t * d) * e if tp > 1 else 0)
    kept = t * d / (tp if sp else 1) * stream_e  # the block's input
    kept += (d + 2 * kv_width) * t / tp * e + t * d / tp * e + heads / tp * t * 4 + row_parallel
    if cfg.n_experts:
        shared = cfg.n_shared_experts * cfg.hidden
        kept += (
            t * cfg.n_experts * e
            + (2 if cfg.mlp == "swiglu" else 1) * t * shared * e
            + (t * d * e if shared else 0)
        )
        kept += t * cfg.top_k * d * (stream_e + e) if layout.ep > 1 else 0
    else:
        kept += (2 if cfg.mlp == "swiglu" else 1) * t * cfg.hidden / tp * e + row_parallel
    return kept + (2 * t * d * stream_e if sp else 0)


def moe_activation_bytes(
    cfg, layout: Layout, t: float, e: int, stream_e: int, autocast: bool
) -> tuple[float, int]:
    """A MoE MLP's bytes kept for backward over t tokens (routing uniform: the rank's experts take the t x k rows
    R it sends), whole on every tp rank, and how many of its matmul inputs autocast casts (per t d); as
    common/moe.py and strategies/ep.py save them (listed with a saved-tensor hook under autocast and under FSDP's
    bf16 policy, 2026-12-05): the router's float32 scores (t E) and chosen experts (t k, int64); three int64
    indices a row (its token, its place in expert order, the combine's); the rows in expert order, the experts'
    outputs, their weighted copy (3 R d) and that copy in the residual stream's dtype (R d); SwiGLU's gate, up,
    silu and product (4 R h; GELU 2); each row's router weight; the shared experts as a dense MLP over the t
    tokens. Under FSDP's bf16 policy ep's experts (FSDP leaves them alone: float32) are cast to bf16 each
    forward, and the copies kept (under autocast: `casts`)."""
    rows, d, h = t * cfg.top_k, cfg.d_model, cfg.hidden
    per_hidden = 4 if cfg.mlp == "swiglu" else 2
    routed = t * cfg.n_experts * 4 + t * cfg.top_k * 8 + rows * (3 * 8 + e)
    routed += rows * d * (3 * e + stream_e) + per_hidden * rows * h * e
    shared = per_hidden * t * cfg.n_shared_experts * h * e
    expert_casts = 0
    if layout.ep > 1 and layout.shard_dims and e == 2:
        expert_casts = cfg.n_experts // layout.ep * (per_hidden // 2 + 1) * d * h * 2
    return routed + shared + expert_casts, 1 + ((per_hidden // 2) if cfg.n_shared_experts else 0)


def in_flight(schedule: str, pp_size: int, stage: int, m: int) -> float:
    """Micro-batches whose activations a stage rank holds at once, in units of a whole micro-batch through all its
    blocks: 1F1B's p - s on stage s (at most m), GPipe's m; interleaved over v chunks, Megatron's warm-up of
    2 (p - s - 1) + (v - 1) p chunk forwards and the one that starts the steady state, each chunk 1/v of the
    rank's blocks (strategies/pp_schedules.order)."""
    if pp_size == 1:
        return 1
    v = stages_per_rank(schedule)
    if v > 1:
        return min(2 * (pp_size - stage - 1) + (v - 1) * pp_size + 1, m * v) / v
    return m if schedule == "gpipe" else min(pp_size - stage, m)


def memory_estimate(reference, layout: Layout, args, work: Workload, rank: int) -> dict:
    """An ESTIMATE of a rank's bytes at its busiest moment (the first backward), from the theory: parameters,
    AdamW's state, FSDP's gathered copies, the gradients (under a pipeline FSDP sums them unsharded in float32
    over the micro-batches), and `activation_bytes` for each micro-batch in flight. experiments/at_scale.py
    measures the same categories."""

    holding = theory_of(reference, layout, rank, args, work)  # its pieces, its blocks and ends
    held, gathered = holding.held_bytes(), holding.gathered_bytes()
    m = args.pp_microbatches if layout.pp > 1 else 1
    flying = in_flight(args.pp_schedule, layout.pp, layout.coordinate(rank, "pp"), m)
    activations = flying * activation_bytes(work, layout, args, holding.blocks, holding.first, holding.last)
    gathered_element = stream_dtype(layout, work).itemsize  # FSDP's parameter dtype
    grads = gathered * 4 // gathered_element if layout.pp > 1 and layout.shard_dims else held["grads"]
    if (
        layout.pp > 1 and layout.tp > 1 and holding.first
    ):  # the embedding's gradient comes back whole (tp.py's
        grads += (
            4 * work.model.vocab_size * work.model.d_model * (layout.tp - 1) // layout.tp
        )  # align_gradients)
    parts = {
        "params": held["params"],
        "gathered": max(0, gathered - held["params"]),
        "optimizer": held["optimizer"],
        "grads": grads,
        "activations": activations,
    }
    return parts | {"peak": sum(parts.values()), "in_flight": flying}
