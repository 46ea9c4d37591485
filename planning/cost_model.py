"""A step-time predictor for any layout on any hardware profile (planning/hardware.yaml): each op priced by the
profile's op model (planning/op_model.py), an alpha-beta time per collective, the pipeline as its schedule runs it
(strategies/pp_schedules.py's timeline), put together under overlap assumptions written out below. It is a PREDICTION, labelled
as one wherever it is shown, and set beside published runs (docs/at_scale.md) and beside the runs this machine
really measures (benchmarks/at_scale_calibration.py).

Per micro-batch, on each pipeline stage:
  compute      an op list priced by the op model, one op after another: the ops a fake rank recorded
               (predict_step's `traced`), or, for the thousands of layouts a planner weighs, the closed form's
               (planning/compute_ops.stage_ops): the same modules' ops traced at the rank's shapes, without a
               process group, as eager PyTorch runs them or as fused kernels would (`kernels`); full activation
               checkpointing runs each block's forward again in the backward.
  exposed      tensor parallelism's, context parallelism's and expert parallelism's collectives wait in every
               micro-batch (Megatron's TP waits for each all-reduce; our CP gathers K and V before attention; a MoE
               block waits for its tokens). A mixture of experts is priced on a uniform routing
               (strategies/ep.uniform_routing), its FLOPs the active parameters'.
Per step:
  pipeline     the stages' forwards and backwards in the schedule's order, each waiting for its neighbour's
               output and the send (strategies/pp_schedules.simulate: GPipe, 1F1B, interleaved 1F1B, and zbv and interleaved
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

from common.gpt import parameter_count
from common.moe import active_parameter_count
from planning.communication import clip_collectives_seconds, own_calls, switched_shares, traffic_seconds
from planning.compute_ops import stage_ops
from planning.hardware import Hardware
from strategies import registry
from strategies.layout import Layout, Workload
from strategies.piece import Plan
from strategies.pp_schedules import TIMELINE_OF, holder, simulate, stages_per_rank, step_seconds

ADAMW_BYTES_PER_PARAMETER = 28
# the clipping reads each float32 gradient for its squared sum, then reads and writes it to scale it
CLIP_BYTES_PER_PARAMETER = 12


def memory_seconds(bytes_moved: float, hw: Hardware) -> float:
    """Memory-bound bytes (the optimizer's, the clipping's) at the bandwidth the op model reaches."""
    return bytes_moved / hw.ops.bandwidth(int(bytes_moved)) if bytes_moved else 0.0


# --------------------------------------------------------------------------------------------- the step
EXPOSED = ("tp", "cp", "pp", "ep")  # on the critical path of every micro-batch


def predict_step(
    theories: list,
    layout: Layout,
    args,
    work: Workload,
    hw: Hardware,
    calls: dict | None = None,
    traced=None,
    kernels: str = "eager",
    attention: str = "flash",
) -> dict:
    """The predicted seconds of one optimizer step, term by term (the module docstring), of `layout` as its theory
    says each pipeline stage's first rank holds and sends (`theories`: strategies/theory.stage_theories, made by the
    caller once for every pricing of the layout: at_scale prices it from recorded ops and from the closed form).
    With `traced` (fake ranks' results, planning/fake_ranks.run_ranks: the ops each rank recorded), a stage's
    compute and optimizer are its recorded ops priced by the hardware's op model (planning/op_model.py) instead of
    the closed form's (planning/compute_ops.stage_ops: the same modules' ops at the rank's shapes, with `kernels`
    eager or fused and `attention` flash or materialised), priced by the same op model."""
    m = args.pp_microbatches if layout.pp > 1 else work.micro_batches
    rows = work.rows // m if layout.pp > 1 else work.rows
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
    ddp = "whole_model_replicas" in Plan(args, layout, work, None, registry.PIECES).traits
    stages = []
    for t in theories:
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
            ops = stage_ops(
                work.model,
                layout,
                args,
                work,
                rows,
                t.blocks,
                t.first,
                t.last,
                kernels,
                m,
                attention,
                t.held,
            )
            forward_s = hw.ops.phase_seconds("forward", ops["forward"])
            backward_s = hw.ops.phase_seconds("backward", ops["backward"])
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
    if layout.pp > 1:  # the schedule's own order of forwards and backwards (pp_schedules.step_seconds)
        schedule, v = TIMELINE_OF.get(args.pp_schedule, "1f1b"), stages_per_rank(args.pp_schedule)
        # Megatron's interleaving goes p micro-batches at a time
        if m % layout.pp and schedule == "interleaved_1f1b":
            schedule, v = "1f1b", 1
        by_chunk = lambda key: [stages[holder(c, layout.pp, schedule)][key] / v  # noqa: E731
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


def model_flops_per_token(cfg, recompute: bool = False, causal: bool = False) -> float:
    """Model FLOPs per token trained: PaLM's convention (appendix B; nanoGPT's estimate_mfu), 6 N + 12 L T d for a
    forward and a backward, N the parameters that multiply (not the position table, not an untied embedding's
    lookup; the attention over the whole context). With `recompute`, Megatron-LM's (Narayanan et al. 2021,
    eq. 3: 96 B s l h^2 (1 + s / 6h + V / 16 l h)), which counts the blocks' forward again, not the head's. With
    `causal`, the attention a causal model needs: half of it, the masked half left out (FlashAttention's count),
    so that an MFU never passes the hardware's ceiling (PaLM's whole attention, at a 32K-token context, read 93 % of
    an A100's peak where its matmuls reach 86 %)."""

    head = cfg.vocab_size * cfg.d_model
    # a mixture of experts: the parameters a token uses (common/moe.active_parameter_count)
    n = active_parameter_count(cfg, parameter_count(cfg))
    n -= cfg.block_size * cfg.d_model if cfg.positions == "learned" else 0
    n -= 0 if cfg.tie_weights else head  # the token embedding is a lookup; its matmul is the head's
    attention = 4 * cfg.n_layer * cfg.block_size * cfg.d_model  # a forward's QK^T and AV per token
    attention //= 2 if causal else 1
    flops = 3 * (2 * n + attention)
    return flops + (2 * (n - head) + attention if recompute else 0)
