"""A step-time predictor for any layout on any hardware profile (planning/hardware.yaml): each op priced by the
profile's op model (planning/op_model.py), an alpha-beta time per collective, the pipeline as its schedule runs it
(planning/timeline.py), put together under overlap assumptions written out below. It is a PREDICTION, labelled
as one wherever it is shown, and set beside published runs (docs/at_scale.md) and beside the runs this machine
really measures (benchmarks/at_scale_calibration.py).

Per micro-batch, on each pipeline stage:
  compute      the ops a fake rank recorded (predict_step's `traced`), each priced by the op model; or, for the
               thousands of layouts a planner weighs, the same op model over a closed-form list: every op of the
               stage's blocks (and the embedding, the head and the loss on the end stages): the matmuls (2 m k n
               FLOPs; bytes: the operands and the output), attention's two matmuls (causal: half of 4 T^2 d per
               sequence, as a flash kernel skips the masked half), and the memory-bound rest (norms, residual
               adds, the MLP's activation, rope) as so many reads and writes of the activations. Backward: twice
               the forward (weights' and inputs' gradients); full activation checkpointing runs the forward again.
  exposed      tensor parallelism's, context parallelism's and expert parallelism's collectives wait in every
               micro-batch (Megatron's TP waits for each all-reduce; our CP gathers K and V before attention; a MoE
               block waits for its tokens). A mixture of experts is priced on a uniform routing
               (strategies/ep.uniform_routing), its FLOPs the active parameters'.
Per step:
  pipeline     the stages' forwards and backwards in the schedule's order, each waiting for its neighbour's
               output and the send (planning/timeline.py: GPipe, 1F1B, interleaved 1F1B, and zbv and interleaved
               zero-bubble in torch's own order, a backward split into its input's and its weights' halves), m micro-batches when
               p = 1; the bubble what it adds to the slowest stage's own work;
  data-parallel  FSDP's all-gathers and reduce-scatters and the replicas' all-reduces, overlapped with the
               step's compute where the hardware overlaps (NCCL streams): only what exceeds the compute is
               exposed; on hardware that does not (gloo on CPU), all of it;
  optimizer    AdamW, memory-bound: each parameter held reads its value, gradient and two moments and writes
               three of them back (28 bytes per float32 parameter); or its recorded ops.
Each collective: latency x its ring steps + bytes x the nccl-tests bus factor / the link's bandwidth, over the
link its group spans: ranks are numbered tp fastest (strategies/layout.py), a node holds gpus_per_node
consecutive ranks, so a group whose ranks fit in one node uses the intra-node link. A profile measured on its
own collectives (this_machine: gloo's alpha-beta fit per kind on 2 ranks, after compute) uses its fit per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from common.comm_counter import bus_factor
from common.config import require
from common.gpt import GPTConfig, parameter_count
from common.moe import active_parameter_count
from planning.op_model import OpModel, op_model_from
from planning.ops import OpCall
from planning.timeline import rank_of_stage, simulate, step_seconds
from strategies.layout import DIMS, Layout, Traffic, Workload, stream_dtype
from strategies.pp import SCHEDULES
from strategies.replicate import replicates_whole_model
from strategies.theory import gathered_bytes, held_bytes, stage_theories, theory_of

PROFILES = Path(__file__).with_name("hardware.yaml")
# reads and writes of the activation per token, per block, in units of d (the rest of the block's ops): two
# norms (read, write: 4), two residual adds (two reads, one write: 6), rope on q and k (2 reads and writes of
# q and k: counted on d); and of the MLP's hidden width: the activation (GELU: 2; SwiGLU: silu 2 + product 3)
ELEMENTWISE_D = 12
ELEMENTWISE_HIDDEN = {"gelu": 2, "swiglu": 5}
ADAMW_BYTES_PER_PARAMETER = 28
# the clipping reads each float32 gradient for its squared sum, then reads and writes it to scale it
CLIP_BYTES_PER_PARAMETER = 12
# a MoE's row (an assignment of a token to an expert) of width d: gathered in expert order (read, write: 2),
# regrouped by local expert under ep (2), weighed by the router (2), added back to its token (index_add: 3)
ELEMENTWISE_MOE_D = 9


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one way
    latency: float  # s per message step


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    peak_flops: dict  # precision -> FLOP/s
    memory_bytes: float
    memory_bandwidth: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    overlaps_communication: bool
    ops: OpModel  # what an op costs (planning/op_model.py); a profile without `ops:`: the roofline at its datasheet's
    fitted: dict | None = (
        None  # kind -> Link measured for a whole call (this_machine): latency + bytes / bandwidth
    )
    cores: int | None = None  # a CPU's: ranks beyond it share a core, their compute slowed by ranks / cores
    # a CPU's step of two processes sharing one core against one alone: 2.0 if time-slicing cost nothing (the
    # switches and the caches each process refills cost more, measured: benchmarks/op_costs.shared_core_ratio)
    shared_core_ratio: float = 2.0
    # as `fitted`, measured with twice as many ranks as cores: each call with a partner other than its rank's
    # last call's; and each with the same one
    fitted_shared: dict | None = None
    fitted_shared_same_group: dict | None = None
    # a pipeline's receive posted after its data was sent: what it waits for the sender's side to answer
    late_receive_s: float = 0.0


def load_hardware(name: str) -> Hardware:
    import yaml

    profiles = yaml.safe_load(PROFILES.read_text())
    require(name in profiles, f"--hardware {name!r} is not a profile in planning/hardware.yaml; known: "
            f"{', '.join(profiles)}")  # fmt: skip
    return hardware_from(name, profiles[name])


def hardware_from(name: str, p: dict) -> Hardware:
    """A profile's YAML mapping as a Hardware (units: TFLOP/s, GB, GB/s, us)."""
    link = lambda spec: Link(spec["bandwidth_gbps"] * 1e9, spec["latency_us"] * 1e-6)  # noqa: E731
    fitted = {kind: link(spec) for kind, spec in p["fitted"].items()} if p.get("fitted") else None
    fitted_shared = {kind: link(spec) for kind, spec in (p.get("fitted_shared") or {}).items()} or None
    same_group = {
        kind: link(spec) for kind, spec in (p.get("fitted_shared_same_group") or {}).items()
    } or None
    ops = p.get("ops") or {}
    peak, bandwidth = {k: v * 1e12 for k, v in p["peak_tflops"].items()}, p["memory_bandwidth_gbps"] * 1e9
    return Hardware(name, p["description"], peak, p["memory_gb"] * 2**30, bandwidth, p["gpus_per_node"],
                    link(p["intra_node"]), link(p["inter_node"]), p["overlaps_communication"],
                    op_model_from(p, peak, bandwidth), fitted, p.get("cores"), ops.get("shared_core_ratio", 2.0),
                    fitted_shared, same_group, ops.get("late_receive_us", 0.0) * 1e-6)  # fmt: skip


def hardware_names() -> list[str]:
    import yaml

    return list(yaml.safe_load(PROFILES.read_text()))


# ------------------------------------------------------------------------------------------------ compute
DTYPE_OF = {"bf16": "bfloat16", "fp32": "float32"}


def matmul_seconds(m: int, k: int, n: int, element: int, hw: Hardware, precision: str) -> float:
    flops, moved = 2 * m * k * n, element * (m * k + k * n + m * n)
    return hw.ops.seconds(OpCall("mm", "gemm", DTYPE_OF[precision], (m, k, n), flops, moved))


def attention_seconds(rows: int, cfg, layout: Layout, element: int, hw: Hardware, precision: str) -> float:
    """Causal attention's forward over this rank's rows: each of its heads (n_head / tp) and query tokens
    (block_size / cp) against the sequence's keys up to it, QK^T and AV (flash: the masked half skipped)."""
    heads, queries, width = (
        rows * cfg.n_head // layout.tp,
        cfg.block_size // layout.cp,
        cfg.d_model // cfg.n_head,
    )
    flops = 4.0 * heads * queries * cfg.block_size * width * 0.5
    moved = element * 4 * heads * queries * width
    call = OpCall("scaled_dot_product_attention", "attention", DTYPE_OF[precision],
                  (heads, queries, cfg.block_size, width), flops, moved, causal=True)  # fmt: skip
    return hw.ops.seconds(call)


def memory_seconds(bytes_moved: float, hw: Hardware) -> float:
    """Memory-bound ops' bytes at the bandwidth the op model reaches."""
    return bytes_moved / hw.ops.bandwidth(int(bytes_moved)) if bytes_moved else 0.0


def block_forward_seconds(work: Workload, layout: Layout, args, hw: Hardware, tokens: int) -> float:
    """One block's forward over this rank's `tokens` (micro-batch rows x its share of the sequence)."""
    cfg, precision = work.model, "bf16" if work.mixed_precision == "bf16" else "fp32"
    element, tp, d = (2 if precision == "bf16" else 4), layout.tp, cfg.d_model
    kv = cfg.kv_heads * (d // cfg.n_head)
    seconds = sum(matmul_seconds(tokens, k, n // tp if split_out else n, element, hw, precision)
                  for k, n, split_out in ((d, d, True), (d, kv, True), (d, kv, True)))  # fmt: skip
    seconds += matmul_seconds(tokens, d // tp, d, element, hw, precision)  # output projection (row-parallel)
    up = 3 if cfg.mlp == "swiglu" else 2  # gate, up, down; or up, down
    if cfg.n_experts:
        seconds += moe_forward_seconds(cfg, layout, hw, tokens, element, precision)
    else:
        seconds += (up - 1) * matmul_seconds(tokens, d, cfg.hidden // tp, element, hw, precision)
        seconds += matmul_seconds(tokens, cfg.hidden // tp, d, element, hw, precision)
    seconds += attention_seconds(tokens // (cfg.block_size // layout.cp), cfg, layout, element, hw, precision)
    sequence_split = tp if args.sequence_parallel else 1
    hidden_rows = tokens * cfg.hidden / tp if not cfg.n_experts else 0  # the MoE's: moe_forward_seconds
    rest = element * (tokens * ELEMENTWISE_D * d / sequence_split + ELEMENTWISE_HIDDEN[cfg.mlp] * hidden_rows)
    return seconds + memory_seconds(rest, hw)


def moe_forward_seconds(
    cfg, layout: Layout, hw: Hardware, tokens: int, element: int, precision: str
) -> float:
    """A MoE block's MLP over `tokens` (whole on every tp rank: strategies/tp.py leaves it so), routing uniform
    (ep.uniform_routing): the router (tokens x d x E), the experts' grouped GEMMs over the tokens x top_k rows a
    rank receives (each of its E / ep experts' weights read once), the shared experts' MLP over every token; the
    memory-bound rest: the activation over the rows' hidden width, the rows gathered in expert order and the
    outputs weighed and added back (ELEMENTWISE_MOE_D reads and writes of a row)."""
    d, hidden, rows = cfg.d_model, cfg.hidden, tokens * cfg.top_k
    matrices = 3 if cfg.mlp == "swiglu" else 2
    local_experts = cfg.n_experts // layout.ep
    seconds = matmul_seconds(tokens, d, cfg.n_experts, element, hw, precision)
    grouped_flops = 2 * rows * d * hidden
    grouped_bytes = element * (rows * d + local_experts * d * hidden + rows * hidden)
    grouped = OpCall(
        "_grouped_mm", "gemm", DTYPE_OF[precision], (rows, d, hidden), grouped_flops, grouped_bytes
    )
    seconds += matrices * hw.ops.seconds(grouped)
    shared = cfg.n_shared_experts * hidden
    if shared:
        seconds += matrices * matmul_seconds(tokens, d, shared, element, hw, precision)
    rest = element * (
        ELEMENTWISE_HIDDEN[cfg.mlp] * (rows * hidden + tokens * shared) + ELEMENTWISE_MOE_D * rows * d
    )
    return seconds + memory_seconds(rest, hw)


def ends_forward_seconds(
    work: Workload, layout: Layout, hw: Hardware, tokens: int, first: bool, last: bool
) -> float:
    """The embedding (a gather: memory-bound) on the first stage; the head and the loss on the last."""
    cfg, precision = work.model, "bf16" if work.mixed_precision == "bf16" else "fp32"
    element = 2 if precision == "bf16" else 4
    seconds = memory_seconds(element * tokens * cfg.d_model, hw) if first else 0.0
    if last:
        vocab = math.ceil(cfg.vocab_size / layout.tp)
        seconds += matmul_seconds(tokens, cfg.d_model, vocab, element, hw, precision)
        seconds += memory_seconds(4 * 3 * tokens * vocab, hw)  # log-softmax and its gradient, float32
    return seconds


# ------------------------------------------------------------------------------------------------ memory
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
        "selective": selective_block_bytes(cfg, layout, args, t, e, stream_e, mlp),
    }[args.activation_checkpointing]
    ends = 0.0
    if last:  # the final norm, the head's input and the loss's float32 logits
        # under autocast the head keeps the bf16 copies of its input and of its (vocab-parallel) weight, not the
        # norm's float32 output (measured: the last stage's activations 15 % over this estimate without them)
        head_input = t * d * (2 if autocast else stream_e)
        head_weight = cfg.vocab_size * d / tp * 2 if autocast else 0.0
        ends = norm_kept + head_input + head_weight + t * cfg.vocab_size * 4
    return blocks * per_block + ends


def selective_block_bytes(cfg, layout: Layout, args, t: float, e: int, stream_e: int, mlp: float) -> float:
    """A block's bytes kept under selective checkpointing (strategies/activation_checkpointing.py): its input,
    and the output of every op the policy saves, whether backward reads it or not, in the matmuls' dtype e (bf16
    under autocast, where nothing else is kept: the casts are recomputed):
      q, k, v (k and v kv_heads wide) and attention's output with its log-sum-exp (float32);
      fc_in's (SwiGLU: the gate's and up's);
      o_proj's and fc_out's, which under tp are each rank's full-width partial sums (t d) and the all-reduce's
      result (t d) again, or under sequence parallelism the reduce-scatter's (t d / n); and then the two
      all-gathers of the norms' outputs (t d, the residual stream's dtype).
    A MoE MLP: half of what it keeps without checkpointing (not measured)."""
    tp, d, heads = layout.tp, cfg.d_model, cfg.n_head
    sp = args.sequence_parallel and tp > 1
    kv_width = cfg.kv_heads * (d // heads)
    row_parallel = t * d * e + ((t * d / tp if sp else t * d) * e if tp > 1 else 0)
    kept = t * d / (tp if sp else 1) * stream_e  # the block's input
    kept += (d + 2 * kv_width) * t / tp * e + t * d / tp * e + heads / tp * t * 4 + row_parallel
    if cfg.n_experts:
        kept += mlp / 2
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
    rank's blocks (planning/timeline.order)."""
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

    held, gathered = (
        held_bytes(reference, layout, rank, args, work),
        gathered_bytes(reference, layout, rank, args, work),
    )
    holding = theory_of(reference, layout, rank, args, work)  # its blocks and ends
    m = args.pp_microbatches if layout.pp > 1 else 1
    flying = in_flight(args.pp_schedule, layout.pp, layout.coordinate(rank, "pp"), m)
    activations = flying * activation_bytes(work, layout, args, holding.blocks, holding.first, holding.last)
    gathered_element = 2 if work.mixed_precision == "bf16" and layout.shard_dims else 4
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


# ------------------------------------------------------------------------------------------ communication
def link_of(layout: Layout, dims: tuple[str, ...], hw: Hardware) -> Link:
    """The link a group over `dims` crosses: intra-node when its ranks (tp fastest) fit in one node."""
    inner = [d for d in DIMS if DIMS.index(d) > max(DIMS.index(x) for x in dims)]
    span = math.prod(getattr(layout, d) for d in (*inner, *dims))
    return hw.intra_node if span <= hw.gpus_per_node else hw.inter_node


def ring_steps(kind: str, n: int) -> int:
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}.get(kind, 1)


def collective_seconds(kind: str, size: float, ranks: int, link: Link, calls: int = 1) -> float:
    """alpha-beta: calls x latency x ring steps + bytes x bus factor / bandwidth (nothing for what is received)."""
    if kind == "recv" or ranks == 1 or not size:
        return 0.0
    return calls * link.latency * ring_steps(kind, ranks) + size * bus_factor(kind, ranks) / link.bandwidth


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
    cores, each call at the fits measured so: `switched` (per kind, the share of its calls on a group other than
    the rank's previous call's, as fake ranks count them; all, if not known) at `fitted_shared`, the rest at
    `fitted_shared_same_group`."""
    shared = hw.fitted_shared if hw.cores and layout.world_size > hw.cores and hw.fitted_shared else None
    same_group = (hw.fitted_shared_same_group or {}) if shared else {}
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


# --------------------------------------------------------------------------------------------- the step
EXPOSED = ("tp", "cp", "pp", "ep")  # on the critical path of every micro-batch
# --pp_schedule -> the timeline that prices it: the zero-bubble schedules in torch's own order, their backward
# split in two (planning/timeline.py); dualpipev (its forwards and backwards of two micro-batches overlapped) as
# 1F1B, an upper bound
TIMELINE_OF = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved_1f1b": "interleaved_1f1b",
               "interleaved_zero_bubble": "interleaved_zero_bubble", "zbv": "zbv"}  # fmt: skip


def stages_per_rank(schedule: str) -> int:
    """The model chunks a stage rank holds under `schedule` (strategies/pp.py's SCHEDULES) as the timeline runs
    it: interleaving's and the zero-bubble schedules', else one."""
    return SCHEDULES[schedule][1] if TIMELINE_OF.get(schedule, "1f1b") != "1f1b" else 1


def predict_step(
    reference, layout: Layout, args, work: Workload, hw: Hardware, calls: dict | None = None, traced=None
) -> dict:
    """The predicted seconds of one optimizer step, term by term (the module docstring), for the undistributed
    GPT `reference` (its shapes; a meta-device model will do) under `layout`. With `traced` (fake ranks' results,
    planning/fake_ranks.run_ranks: the ops each rank recorded), a stage's compute and optimizer are its recorded
    ops priced by the hardware's op model (planning/op_model.py) instead of the closed form."""

    per_stage = stage_theories(reference, layout, args, work)  # each pipeline stage's first rank, by theory
    m = args.pp_microbatches if layout.pp > 1 else work.micro_batches
    rows = work.rows // m if layout.pp > 1 else work.rows
    tokens = rows * work.model.block_size // layout.cp
    block = block_forward_seconds(work, layout, args, hw, tokens)
    recompute = 1 if args.activation_checkpointing == "full" else 0
    shard = math.prod(getattr(layout, d) for d in layout.shard_dims)
    recorded = {layout.coordinate(r["rank"], "pp"): r["ops"] for r in traced or []}
    clipped = {layout.coordinate(r["rank"], "pp"): r.get("clip_collectives") for r in traced or []}
    switched = {layout.coordinate(r["rank"], "pp"): switched_shares(r["counted"]) for r in traced or []}
    # ranks beyond the cores are time-sliced: each core's work is its ranks' work, each switch between them dearer
    # than nothing (hw.shared_core_ratio); a rank that waits gives its core to another
    cores = hw.cores or layout.world_size
    sliced = hw.shared_core_ratio / 2 if layout.world_size > cores else 1.0
    shared_core = max(1.0, layout.world_size / cores) * sliced
    # every rank a replica of the whole model: a launch runs DDP, whose reducer is C++; a fake rank, which
    # Accelerate did not launch, runs PyTorch's replicate (FSDP2's hooks): not priced
    ddp = replicates_whole_model(layout)
    stages = []
    for t in per_stage:
        ops = recorded.get(layout.coordinate(t.rank, "pp"))
        comm = traffic_seconds(t.traffic, layout, hw, calls, switched.get(layout.coordinate(t.rank, "pp")))
        held = sum(math.prod(shape) for _, shape in t.held)
        if ops:  # the rank's own ops, over the step's m micro-batches, priced one after another
            # (a fake replica's FSDP2 hooks and DTensor parameters are not the launch's DDP: left out)
            counted = {
                key: {} if ddp else ops.get(key, {})
                for key in ("dtensor_calls", "fsdp_events", "dtensor_tensors", "in_fsdp_hooks")
            }
            phases = {phase: hw.ops.phase_seconds(phase, own_calls(ops, phase, ddp),
                                                  counted["dtensor_calls"].get(phase, 0),
                                                  ops["redistributes"].get(phase, 0),
                                                  counted["fsdp_events"].get(phase, 0),
                                                  counted["dtensor_tensors"].get(phase, 0),
                                                  ops.get("functional_collectives", {}).get(phase, 0),
                                                  counted["in_fsdp_hooks"].get(phase, []))
                      for phase in ("forward", "backward", "clip", "step")}  # fmt: skip
            forward_s, backward_s, optimizer = phases["forward"] / m, phases["backward"] / m, phases["step"]
            clipping = phases["clip"]
        else:
            forward_s = t.blocks * block + ends_forward_seconds(work, layout, hw, tokens, t.first, t.last)
            backward_s = forward_s * (2 + recompute)
            optimizer = memory_seconds(ADAMW_BYTES_PER_PARAMETER * held / shard, hw)
            clipping = memory_seconds(CLIP_BYTES_PER_PARAMETER * held / shard, hw)
        clip_s = clipping * shared_core + clip_collectives_seconds(clipped.get(layout.coordinate(t.rank, "pp")),
                                                                   layout, hw)  # fmt: skip
        exposed = {dim: comm.get(dim, 0.0) / m for dim in EXPOSED}  # per micro-batch, half in each direction
        waits = sum(exposed[dim] for dim in EXPOSED if dim != "pp") / 2
        # forward and backward at one core a rank (the schedule's order); compute: its share of the cores
        stages.append({"forward": forward_s + waits, "backward": backward_s + waits, "exposed": exposed,
                       "compute": forward_s + backward_s, "waits": 2 * waits, "data_parallel": sum(s for dim, s
                       in comm.items() if dim not in (*EXPOSED, "pp_step")), "pp_step": comm.get("pp_step", 0.0),
                       "optimizer": optimizer * shared_core, "clip": clip_s, "rank": t.rank})  # fmt: skip
    slowest = max(stages, key=lambda s: s["forward"] + s["backward"])
    # the cores' bound: every rank's compute over the cores (each stage has world / pp ranks), at least the
    # slowest stage's at a core a rank; with ranks beyond the cores, a rank waiting in the pipeline's bubble
    # lends its core to another stage's (measured: pp 2 x dp_shard 2 on 2 cores kept 1.75 cores busy while
    # its ranks idled 0.40 of the step)
    ranks_per_core = layout.world_size / layout.pp / cores
    compute_s = m * max(slowest["compute"], sum(s["compute"] for s in stages) * ranks_per_core * sliced)
    work_s = compute_s + m * slowest["waits"]
    sends_s = 0.0
    if layout.pp > 1:  # the schedule's own order of forwards and backwards (planning/timeline.py)
        schedule, v = TIMELINE_OF.get(args.pp_schedule, "1f1b"), stages_per_rank(args.pp_schedule)
        # Megatron's interleaving goes p micro-batches at a time
        if m % layout.pp and schedule == "interleaved_1f1b":
            schedule, v = "1f1b", 1
        by_chunk = lambda key: [stages[rank_of_stage(c, layout.pp, schedule)][key] / v  # noqa: E731
                                for c in range(layout.pp * v)]  # fmt: skip
        send_s = max(s["exposed"]["pp"] for s in stages) / 2
        # a split backward's weight half: a third of it when the backward runs the forward again first
        weight_share = 1 / 3 if args.activation_checkpointing == "full" else 1 / 2
        timing = (by_chunk("forward"), by_chunk("backward"), v, send_s, weight_share, hw.late_receive_s)
        pipeline_s = step_seconds(schedule, layout.pp, m, *timing)
        if layout.world_size > cores:
            # ranks beyond the cores: the cores' work holds every send and receive of a rank and each receive it
            # posts late (the measured exchange on 4 ranks of 2 cores, hw.fitted_shared's "send"; a CPU's gloo
            # burns it: pp 2 x dp_shard 2 kept 1.75 cores busy, 108 core-ms a 62 ms step, its compute 72)
            probe = min(m, 4 * layout.pp)  # the late receives of a few rounds, per micro-batch
            late = simulate(schedule, layout.pp, probe, *timing)["late_receives"]
            sends_s = m * max(s["exposed"]["pp"] for s in stages) + max(late) * m / probe * hw.late_receive_s
        else:
            # the sends on the critical path: each hop between chunks (p v - 1 of them) once forward (the first
            # micro-batch) and once back (the last); the bubble what is left (a send other work hides costs
            # nothing)
            sends_s = 2 * (layout.pp * v - 1) * send_s
        pipeline_s = max(pipeline_s, work_s + sends_s)
        bubble_s = pipeline_s - work_s - sends_s
    else:
        pipeline_s, bubble_s = work_s, 0.0
    data_parallel_s, optimizer_s = slowest["data_parallel"], slowest["optimizer"]
    exposed_dp_s = max(0.0, data_parallel_s - compute_s) if hw.overlaps_communication else data_parallel_s
    pp_step_s = max(s["pp_step"] for s in stages)  # after the schedule, every stage waiting on it
    clip_s = max(s["clip"] for s in stages)  # its all-reduce over the stages waits for the slowest
    step_s = pipeline_s + pp_step_s + exposed_dp_s + clip_s + optimizer_s
    terms = slowest["exposed"]
    global_tokens = work.rows * layout.dp * work.micro_batches * work.model.block_size
    return {
        "step_s": step_s,
        "terms_s": {
            "compute": compute_s,
            "tp": m * terms["tp"],
            "cp": m * terms["cp"],
            "pp_sends": sends_s,
            "ep_all_to_all": m * terms["ep"],
            "bubble": bubble_s,
            "pp_once_a_step": pp_step_s,
            "data_parallel_exposed": exposed_dp_s,
            "data_parallel_total": data_parallel_s,
            "clip": clip_s,
            "optimizer": optimizer_s,
        },
        "slowest_rank": slowest["rank"],
        "priced": "recorded ops" if recorded else "closed form",
        "tokens_per_s": global_tokens / step_s,
        "global_tokens": global_tokens,
    }


def model_flops_per_token(cfg, recompute: bool = False) -> float:
    """Model FLOPs per token trained: PaLM's convention (appendix B; nanoGPT's estimate_mfu), 6 N + 12 L T d for a
    forward and a backward, N the parameters that multiply (not the position table, not an untied embedding's
    lookup; the attention over the whole context). With `recompute`, Megatron-LM's (Narayanan et al. 2021,
    eq. 3: 96 B s l h^2 (1 + s / 6h + V / 16 l h)), which counts the blocks' forward again, not the head's."""

    head = cfg.vocab_size * cfg.d_model
    # a mixture of experts: the parameters a token uses (common/moe.active_parameter_count)
    n = active_parameter_count(cfg, parameter_count(cfg))
    n -= cfg.block_size * cfg.d_model if cfg.positions == "learned" else 0
    n -= 0 if cfg.tie_weights else head  # the token embedding is a lookup; its matmul is the head's
    attention = 4 * cfg.n_layer * cfg.block_size * cfg.d_model  # a forward's QK^T and AV per token
    flops = 3 * (2 * n + attention)
    return flops + (2 * (n - head) + attention if recompute else 0)
