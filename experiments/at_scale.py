"""at_scale: what one rank of a 1,024- or 16,384-GPU job holds, sends and costs, on a laptop, by the real code.

One process plays, one after another, each rank of an N-rank job whose work differs (PyTorch's fake process
group: every collective returns at once, nothing is sent), on fake tensors (shapes and dtypes, no memory): the
project's GPT at a published shape, the same `parallelize` train_gpt runs (strategies/), one whole optimizer
step. What each rank holds and sends is measured as train_gpt measures it and checked against the same closed
forms, to the byte; the step is predicted on a hardware profile (planning/cost_model.py: a prediction, labelled
as one).

    python experiments/at_scale.py                         # GPT-3 175B on 1,024 ranks: pp 16 x dp_shard 8 x tp 8
    python experiments/at_scale.py --model llama3_405b --world_size 16384 --dp_shard 128 --tp 8 --pp 16
    python experiments/at_scale.py --model llama3_8b --world_size 64 --dp_shard 8 --tp 8 --hardware a100_80gb
    python experiments/at_scale.py --model custom --n_layer 4 --d_model 64 --n_head 4 --vocab_size 512 \\
        --block_size 64 --world_size 8 --dp_shard 2 --tp 2 --pp 2
    python experiments/at_scale.py --model olmoe_1b_7b --world_size 256 --dp_shard 32 --ep 8 --per_rank_batch_size 1

    python experiments/at_scale.py --model deepseek_v3 --world_size 2048 --pp 16 --dp_replicate 2 --ep 64

A mixture of experts (olmoe_1b_7b, deepseek_v3) routes its tokens by values fake tensors do not hold: at scale
every rank's routing is assumed uniform (said in its report), and its step is predicted on that routing too.

Per rank run (by default the first rank of each pipeline stage whose theory differs, and the world's last):
  1. the GPT built on the meta device and parallelized there (tensor parallelism, FSDP, the pipeline cut: the
     meshes hold real rank numbers), then its parameters made fake (to_empty under FakeTensorMode);
  2. train_gpt's own step (strategies/job.Job.train_step), a pipeline's micro-batches in the order of the one
     schedule model (strategies/pp_schedules.order: 1F1B runs min(p - s - 1, m) warm-up forwards on stage s,
     GPipe all m) run by the pipeline itself, FSDP told which backward is the step's last. torch's schedule cannot
     run on fake tensors (its warm-up vote reads a value), so the pipeline's point-to-point sends are the
     theory's, not counted;
  3. the clipping and AdamW's step, as train_gpt's.
Measured: the bytes of parameters, gradients and AdamW state at the step's end, and of the parameters held while
the micro-batches run (FSDP's gathered copies); the bytes each micro-batch's forward keeps for backward
(common/activations.py) and the most in flight at once; the gradients FSDP accumulates unsharded over a
pipeline's micro-batches; every collective (common/comm_counter.py). Peak = those at the moment they coexist
(the first backward). Not measured: transient buffers (an all-gather's staging copy, the loss's softmax):
torch's memory trackers refuse a pipeline's several forwards before a backward, and FSDPMemTracker counted
AdamW's state of sharded parameters at 129x its size (measured here; docs/at_scale.md).

Checks, on every rank run: memory_per_rank (parameters, gradients, AdamW state, gathered parameters equal the
theory, to the byte) and communication_volume (each kind of collective's bytes equal the theory, to the byte).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("at_scale.py")


from common.config import RunArgs, flag, parse_config, require, run_cli
from common.gpt import GPTConfig, ModelFlags, count_parameters
from common.hf_model import HFModelFlags, experts_of
from common.run import start_run
from planning.cost_model import model_flops_per_token, predict_step
from planning.fake_ranks import every_stage, meta_gpt, ranks_that_differ, run_ranks
from planning.hardware import hardware_names, load_hardware
from planning.kernels import ATTENTION
from planning.published import MODELS, PUBLISHED_RUNS, model_named
from strategies.args import ParallelArgs
from strategies.layout import DIMS, Layout, Workload
from strategies.theory import stage_theories

EXPERIMENT = "at_scale"
DEFAULT_LAYOUT = {"pp": 16, "dp_shard": 8, "tp": 8}  # no layout given: 1,024 ranks
P2P_KINDS = ("send", "recv", "broadcast")  # a pipeline's, by theory only (the module docstring)


@dataclass
class Config(RunArgs, HFModelFlags, ModelFlags, ParallelArgs):
    vocabulary_from_config = True  # no tokenizer at scale: a transformers config's own
    # its replicas are PyTorch's replicate, which broadcasts no buffer (strategies/replicate.py)
    replicas_are_ddp = False
    model: str = flag("gpt3_175b", "a published shape (planning/published.py): " + ", ".join(MODELS) + ", changed "
                      "by the model flags given; custom: the project's GPT (train_gpt's), changed so")  # fmt: skip
    world_size: int = flag(0, "ranks of the job (0: the degrees' product); with no degree given, pp 16 x dp_shard "
                           "8 x tp 8 on 1,024")  # fmt: skip
    per_rank_batch_size: int = flag(0, "sequences per data-parallel rank per step (0: the model's published batch / "
                                    "the data-parallel ranks, at least one per pipeline stage)")  # fmt: skip
    pp_microbatches: int = flag(0, "with --pp: micro-batches per step (0: one sequence each)")
    mixed_precision: str = flag("bf16", "bf16 (autocast; under dp_shard FSDP's bf16 policy) or no (float32)",
                                choices=("no", "bf16"))  # fmt: skip
    hardware: str = flag(
        "h100_sxm", "the profile the memory and step are set against: " + ", ".join(hardware_names())
    )
    attention: str = flag("flash", "the attention kernel the closed form's fused step is priced with: flash "
                          "(FlashAttention's, as the ranks run: the masked half skipped) or materialised (before 2022: "
                          "the scores a batched GEMM, a fused scale-mask-softmax, a second GEMM; Megatron-LM 2021's)",
                          choices=ATTENTION)  # fmt: skip
    ranks: str = flag("", "ranks to run, comma-separated (default: the first of each pipeline stage whose theory "
                      "differs, and the world's last)")  # fmt: skip

    def validate(self) -> None:
        self.the_config_is_the_model()
        super().validate()
        require(self.model == "custom" or self.model in MODELS,
                f"--model {self.model!r} is not a shape this project knows; known: {', '.join(MODELS)}, custom")  # fmt: skip
        for name in ("world_size", "per_rank_batch_size", "pp_microbatches"):
            require(getattr(self, name) >= 0, f"--{name} must be >= 0, got {getattr(self, name)}")
        shape = self.shape()
        self.refuse_model(shape)
        # the GPT's experts route by a stand-in on fake tensors (planning/fake_ranks.uniform_order); a transformers
        # model's route by values, which fake tensors do not hold
        require(not experts_of(shape), f"--hf_config {self.hf_config}: a transformers mixture of "
                "experts on fake tensors is not built (its routing needs values they do not hold)")  # fmt: skip
        self.record_model(shape)  # config.json records the shape that ran
        if not self.world_size and all(getattr(self, dim) <= 1 for dim in DIMS) and self.strategy == "auto":
            for dim, degree in DEFAULT_LAYOUT.items():
                setattr(self, dim, degree)
        given = math.prod(max(1, getattr(self, dim)) for dim in DIMS)
        layout = self.resolve_layout(self.world_size or given)
        self.world_size = layout.world_size
        require(layout.pp == 1 or self.pp_schedule in ("gpipe", "1f1b"),
                f"--pp_schedule {self.pp_schedule} at scale: not built (one stage per rank: gpipe or 1f1b)")  # fmt: skip
        self.refuse_layout(layout, self.workload(), 0.0)
        load_hardware(self.hardware)
        for rank in self.rank_list():
            require(0 <= rank < layout.world_size, f"--ranks: {rank} is not a rank of {layout.world_size}")

    def shape(self) -> GPTConfig:
        """--model's shape, changed by the model flags given (custom: the project's GPT)."""
        return self.model_config(GPTConfig() if self.model == "custom" else model_named(self.model).shape)

    def layout(self) -> Layout:
        return Layout(**{dim: max(1, getattr(self, dim)) for dim in DIMS})

    def workload(self) -> Workload:
        """Rows per data-parallel rank (the published batch shared out by default); the pipeline's micro-batches
        (one sequence each by default) written back into the flags, as config.json records what ran."""
        layout, published = self.layout(), MODELS[self.model].global_batch if self.model in MODELS else 1
        rows = self.per_rank_batch_size or max(published // layout.dp, layout.pp if layout.pp > 1 else 1)
        if layout.pp > 1 and not self.pp_microbatches:
            self.pp_microbatches = rows
        return Workload(self.shape(), rows, 1, self.mixed_precision)

    def rank_list(self) -> list[int]:
        items = [r for r in self.ranks.replace(" ", "").split(",") if r]
        bad = [r for r in items if not r.isdigit()]
        require(not bad, f"--ranks {self.ranks!r}: {', '.join(map(repr, bad))} is not a rank (comma-separated whole "
                "numbers, e.g. 0,7,1023)")  # fmt: skip
        return [int(r) for r in items]


def ops_totals(ops: dict) -> dict:
    """A rank's recorded ops (planning/ops.py) as phase -> kind -> {calls, flops, bytes}."""
    totals: dict = {}
    for phase, calls in ops["calls"].items():
        for call, count in calls:
            kind = totals.setdefault(phase, {}).setdefault(call.kind, {"calls": 0, "flops": 0.0, "bytes": 0})
            kind["calls"] += count
            kind["flops"] += count * call.flops
            kind["bytes"] += count * call.bytes
    return totals | {"dtensor_calls": ops["dtensor_calls"], "dtensor_tensors": ops.get("dtensor_tensors", {}),
                     "redistributes": ops["redistributes"],
                     "fsdp_events": ops.get("fsdp_events", {})}  # fmt: skip


def peak_bytes(r: dict) -> int:
    """The bytes that coexist at the first backward: parameters (at rest and gathered), AdamW's state, the
    activations in flight, and the gradients: FSDP's unsharded sums under a pipeline, else the step's."""
    held = r["held"]
    gathered_extra = max(0, held["params_gathered"] - held["params"])
    grads = r["grads_accumulated_unsharded"] or held["grads"]
    return held["params"] + gathered_extra + held["optimizer"] + grads + r["activations_peak"]


def gb(size: float) -> str:  # GiB
    return f"{size / 2**30:,.2f}"


def estimate(size: float | None) -> str:
    return "–" if size is None else gb(size)


def run(cfg: Config) -> int:
    layout, work, chosen = cfg.layout(), cfg.workload(), cfg.rank_list()
    hardware, reference = load_hardware(cfg.hardware), meta_gpt(work.model)
    ranks = chosen or ranks_that_differ(
        reference, layout, cfg, work
    )  # the theory's arithmetic: nothing written
    # each stage's first rank's theory: what both predictions below price
    theories = stage_theories(reference, layout, cfg, work)
    # FSDP's bf16 is its policy's (strategies/shard.py), autocast the rest's: as train_gpt
    with start_run(
        cfg, EXPERIMENT, mixed_precision="no" if layout.shard_dims else cfg.mixed_precision
    ) as session:
        session.print(f"{cfg.hf_config or cfg.model}: {count_parameters(reference):,} parameters, {layout.describe()}, "
                      f"{work.rows} x {work.model.block_size} tokens per data-parallel rank per step"
                      + (f" in {cfg.pp_microbatches} micro-batches ({cfg.pp_schedule})" if layout.pp > 1 else "")
                      + f"; running ranks {ranks} on fake tensors")  # fmt: skip
        results = run_ranks(cfg, layout, work, ranks, session.is_main)
        check_ranks(session, results, layout)
        report(session, cfg, layout, work, hardware, reference, results, theories)
    return session.exit_code


def check_ranks(session, results: list[dict], layout: Layout) -> None:
    """Each rank run against its theory, to the byte: what it holds, and what it sends but the pipeline's sends."""
    wrong_memory = [f"rank {r['rank']}: " + ", ".join(f"{k} {r['held'][k]:,}/{r['theory'][k]:,}" for k in r["theory"])
                    for r in results if any(r["held"][k] != r["theory"][k] for k in r["theory"])]  # fmt: skip
    session.check("memory_per_rank", not wrong_memory,
                  "; ".join(wrong_memory) if wrong_memory else f"{len(results)} ranks: parameters, gradients, AdamW "
                  "state and the parameters gathered during the step equal their theory, to the byte")  # fmt: skip
    wrong_comm = []
    for r in results:
        expected = {
            k: v for k, v in r["sent_theory"]["by_kind"].items() if not (layout.pp > 1 and k in P2P_KINDS)
        }
        kinds = sorted(set(expected) | set(r["counted"]["bytes"]))
        if any(r["counted"]["bytes"].get(k, 0) != expected.get(k, 0) for k in kinds):
            wrong_comm.append(f"rank {r['rank']}: " + ", ".join(
                f"{k} {r['counted']['bytes'].get(k, 0):,}/{expected.get(k, 0):,}" for k in kinds))  # fmt: skip
    p2p = " (the pipeline's sends: by theory)" if layout.pp > 1 else ""
    session.check("communication_volume", not wrong_comm,
                  "; ".join(wrong_comm) if wrong_comm else f"{len(results)} ranks: every kind of collective's bytes "
                  f"per step equal their theory, to the byte{p2p}")  # fmt: skip


def report(
    session, cfg: Config, layout: Layout, work: Workload, hardware, reference, results: list[dict], theories
) -> None:
    """Per rank: the bytes by category and the peak against the hardware's memory; the predicted step; a
    published run of this model and layout beside it."""
    capacity = hardware.memory_bytes
    session.print(f"{'rank':>6} {'stage':>5} {'blocks':>6} {'params GiB':>10} {'grads GiB':>9} {'AdamW GiB':>9} "
                  f"{'gathered':>9} {'act/mb GiB':>10} {'(estimate)':>10} {'in flight':>9} {'peak GiB':>9} {'(estimate)':>10}  "
                  f"fits {hardware.name}")  # fmt: skip
    rows = []
    for r in results:
        peak = peak_bytes(r)
        rows.append({"rank": r["rank"], "stage": r["coordinates"].get("pp", 0), "blocks": r["blocks"],
                     "peak_bytes": peak, "fits": peak <= capacity})  # fmt: skip
        session.print(f"{r['rank']:>6} {rows[-1]['stage']:>5} {r['blocks']:>6} {gb(r['held']['params']):>10} "
                      f"{gb(r['grads_accumulated_unsharded'] or r['held']['grads']):>9} "
                      f"{gb(r['held']['optimizer']):>9} {gb(r['held']['params_gathered']):>9} "
                      f"{gb(r['activations_per_microbatch']):>10} {estimate(r['activations_estimate']):>10} "
                      f"{r['in_flight']:>9} {gb(peak):>9} {estimate(r['peak_estimate']):>10}  "
                      f"{'yes' if peak <= capacity else 'NO'} ({gb(capacity)} GiB)")  # fmt: skip
    # each rank's ops as their totals by phase and kind (the list itself: thousands of ops)
    summaries = [{**{k: v for k, v in r.items() if k != "ops"}, "ops": ops_totals(r["ops"])} for r in results]
    session.metrics.update(model=cfg.hf_config or cfg.model, parameters=count_parameters(reference), layout=layout.degrees(),
                           ranks=summaries, memory=rows, hardware=hardware.name,
                           fits=all(row["fits"] for row in rows))  # fmt: skip
    if work.model.n_experts:  # its routing, and so its all-to-alls and its experts' rows, assumed
        a2a = max(r["counted"]["bytes"].get("all_to_all", 0) for r in results)
        session.print(f"a mixture of experts, routing assumed uniform (fake tensors hold none): all-to-all "
                      f"{gb(a2a)} GiB a rank per step (counted = theory); the prediction assumes it too")  # fmt: skip
        session.metrics.update(all_to_all_bytes_per_rank=a2a)
    calls = results[0]["counted"]["calls"]
    # each stage's recorded ops, priced by the hardware's op model (planning/op_model.py)
    traced = every_stage(reference, layout, cfg, work, results)
    prediction = predict_step(theories, layout, cfg, work, hardware, calls, traced)
    # model FLOPs as the planner counts them (no recompute; the causal half of the attention, the work a causal
    # model needs: an MFU that can never pass the hardware's ceiling); a published run in its paper's count, below
    flops = model_flops_per_token(work.model, causal=True) * prediction["global_tokens"]
    tflops = flops / prediction["step_s"] / layout.world_size / 1e12
    precision = "bf16" if cfg.mixed_precision == "bf16" else "fp32"
    mfu = tflops * 1e12 / hardware.peak_flops[precision]
    terms = ", ".join(f"{k} {v:.3g}" for k, v in prediction["terms_s"].items() if v)
    session.print(f"PREDICTED on {hardware.name} ({precision}, priced from {prediction['priced']}): "
                  f"step {prediction['step_s']:.3g} s ({terms} s), "
                  f"{prediction['tokens_per_s']:,.0f} tokens/s, {tflops:.0f} TFLOP/s per GPU, MFU {mfu:.0%}")  # fmt: skip
    # the same step from the closed form's ops (planning/compute_ops.py): the same modules traced at each stage's
    # shapes, eager as the ranks ran them (it should agree with the recorded ops), and fused as the published
    # systems run them (a norm, an activation, a rotary embedding one kernel each; no casts)
    closed = predict_step(theories, layout, cfg, work, hardware, calls, kernels="eager")
    fused = predict_step(
        theories, layout, cfg, work, hardware, calls, kernels="fused", attention=cfg.attention
    )
    closed_tflops, fused_tflops = (flops / p["step_s"] / layout.world_size / 1e12 for p in (closed, fused))
    session.print(f"PREDICTED from the closed form, eager kernels: step {closed['step_s']:.3g} s, {closed_tflops:.0f} "
                  f"TFLOP/s per GPU (its compute {closed['terms_s']['compute'] / prediction['terms_s']['compute']:.3f} of "
                  f"the recorded ops'); fused kernels ({cfg.attention} attention): step {fused['step_s']:.3g} s, "
                  f"{fused_tflops:.0f} TFLOP/s per GPU")  # fmt: skip
    published = [p for p in PUBLISHED_RUNS if p.model == cfg.model and p.world_size == layout.world_size and
                 {d: n for d, n in layout.degrees().items() if n > 1} == p.degrees]  # fmt: skip
    for p in published:  # in the paper's own count of FLOPs
        theirs = model_flops_per_token(work.model, p.recompute_counted) * prediction["global_tokens"]
        ours, as_fused = (
            theirs / s / layout.world_size / 1e12 for s in (prediction["step_s"], fused["step_s"])
        )
        session.print(f"PUBLISHED ({p.source}): {p.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {p.mfu:.0%}; predicted in "
                      f"its count {ours:.0f} TFLOP/s from the recorded ops ({ours / p.tflops_per_gpu:.2f} of it), "
                      f"{as_fused:.0f} with fused kernels ({as_fused / p.tflops_per_gpu:.2f})")  # fmt: skip
    session.metrics.update(prediction=prediction | {"tflops_per_gpu": tflops, "mfu": mfu},
                           prediction_closed_form=closed | {"tflops_per_gpu": closed_tflops},
                           prediction_fused=fused | {"tflops_per_gpu": fused_tflops},
                           published=[p.__dict__ for p in published])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
