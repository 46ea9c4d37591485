"""Plan a training job: which layouts of a model fit on N GPUs of a hardware profile, ranked by predicted speed.

    python -m tools.plan --model llama3_70b --gpus 512 --hardware h100_sxm
    python -m tools.plan --model llama3_405b --gpus 16384 --hardware h100_sxm --top 5
    python -m tools.plan --model gpt3_175b --gpus 1024 --hardware a100_80gb --block_size 4096
    python -m tools.plan --model llama3_70b --gpus 512 --tp 8 --pp 4 --dp_shard 16   # this one layout, priced
    python -m tools.plan --model olmoe_1b_7b --gpus 64 --json                          # the fitting ones, as JSON
    python -m tools.plan --model llama3_8b --n_layer 48 --d_model 6144 --n_head 48 --gpus 256   # a shape of yours
    python -m tools.plan --model custom --n_layer 24 --d_model 2048 --n_head 16 --vocab_size 32000 \
        --block_size 4096 --global_batch 512 --gpus 64                               # from the project's GPT

A model is a published shape (--model) changed by the model flags given (train_gpt's: --n_layer --d_model --n_head
--n_kv_head --d_ff --vocab_size --block_size --n_experts --top_k, ...), or `custom`: the project's GPT changed so,
with --global_batch given.

A layout given by its degrees (--dp_replicate --dp_shard --tp --pp --cp --ep, the rest 1) is priced alone and
printed whether or not it fits (exit 1 if not, said in words). --json prints the layouts that fit, fastest first
(those the table lists; a given layout whether or not it fits), each with its degrees by name, tflops_per_gpu,
mfu, step_s, peak_gib and fits.

Every layout of the degrees whose product is --gpus (tp within a node and dividing the heads, pp at most the
blocks, cp for sequences of 32K tokens and more, for a mixture of experts ep dividing the experts, the
data-parallel rest sharded (FSDP) or replicated), each
with no, selective and full activation checkpointing (sequence parallelism where it can run), a pipeline also with
its first and last stages a block lighter (Llama 3's; --pp_fewer_blocks_at_ends given: that one), goes through the
same refusals train_gpt and experiments/at_scale.py apply (strategies/: a layout they cannot run is rejected
with their one line), then:
  memory  each pipeline stage's first rank's bytes at its busiest moment, by theory and estimate
          (planning/memory.memory_estimate: parameters, AdamW, FSDP's gathered copies and gradient sums, the
          activations in flight); it fits when every stage's is within the profile's memory;
  speed   the step predicted by planning/cost_model.predict_step (a PREDICTION: a roofline and alpha-beta
          collectives under stated overlap assumptions).
The fitting layouts are listed fastest first; the rest with why: which rank runs out and by how much, or which
refusal. Check a plan at the real size with experiments/at_scale.py (the command is printed). A shape or a
profile it does not know is one line and exit 2; a request nothing fits says so in words, exit 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from common.config import UsageError, flag, parse_config, require, run_cli
from common.gpt import GPTConfig, ModelFlags, count_parameters
from common.hf_model import HFModelFlags, experts_of
from planning.cost_model import model_flops_per_token, predict_step
from planning.fake_ranks import meta_gpt
from planning.hardware import hardware_names, load_hardware
from planning.kernels import ATTENTION, KERNELS
from planning.memory import memory_estimate
from planning.published import MODELS, model_named
from strategies.args import ParallelArgs
from strategies.layout import DIMS, Layout, Workload
from strategies.pp_schedules import SCHEDULES, blocks_a_stage, stages_of, stages_per_rank
from strategies.shard import RESHARD
from strategies.theory import stage_theories


@dataclass
class PlanArgs(HFModelFlags, ModelFlags):
    vocabulary_from_config = True  # no tokenizer: a transformers config's own
    model: str = flag("llama3_70b", "a published shape, changed by the model flags given: " + ", ".join(MODELS)
                      + "; custom: the project's GPT (train_gpt's), changed so")  # fmt: skip
    gpus: int = flag(512, "GPUs of the job (the world size)")
    hardware: str = flag("h100_sxm", "the profile: " + ", ".join(hardware_names()))
    global_batch: int = flag(
        0, "sequences per optimizer step (0: the model's published batch; custom: required)"
    )
    mixed_precision: str = flag("bf16", "bf16 or no (float32)", choices=("bf16", "no"))
    top: int = flag(10, "fitting layouts to list")
    # one given layout instead of every one: any degree given prices that layout alone (the others 1)
    dp_replicate: int = flag(0, "price this one layout: data-parallel replicas (0: enumerate every layout)")
    dp_shard: int = flag(0, "price this one layout: FSDP ranks (0: enumerate)")
    tp: int = flag(0, "price this one layout: tensor-parallel degree (0: enumerate)")
    pp: int = flag(0, "price this one layout: pipeline stages (0: enumerate)")
    cp: int = flag(0, "price this one layout: context-parallel degree (0: enumerate)")
    ep: int = flag(0, "price this one layout: expert-parallel degree (0: enumerate)")
    activation_checkpointing: str = flag(
        "none",
        "with a given layout: none, full, or selective (its recompute priced: what its policy does not save); "
        "the search weighs all three",
        choices=("none", "full", "selective"),
    )
    pp_schedule: str = flag("1f1b", "with a given layout's --pp: the schedule priced (gpipe, 1f1b, interleaved_1f1b: "
                            "two stages a rank; zbv and interleaved_zero_bubble in torch's own order, their "
                            "backward split in input and weight halves; dualpipev as 1f1b)",
                            choices=tuple(SCHEDULES))  # fmt: skip
    pp_fewer_blocks_at_ends: int = flag(0, "with --pp (a given layout's or every pipeline enumerated): the first and "
                                        "the last stage hold this many blocks fewer than the others (Llama 3: 1); "
                                        "not given, the search weighs 0 and 1 for every pipeline")  # fmt: skip
    sequence_parallel: bool = flag(False, "with a given layout's --tp: Megatron's sequence parallelism (enumerated "
                                   "wherever the strategies run it, but under --pp: there, priced when given)")  # fmt: skip
    reshard_after_forward: str = flag("default", "with a given layout's --dp_shard: as train_gpt's (default: ZeRO-3; "
                                      "under --pp never, as Llama 3 ran)", choices=RESHARD)  # fmt: skip
    kernels: str = flag("fused", "the kernels the step is priced with (planning/compute_ops.py): fused (a norm, an "
                        "activation, a rotary embedding one kernel each, no casts: Megatron-LM's and Meta's) or eager "
                        "(the ops this project's modules dispatch, as a fake rank records them)", choices=KERNELS)  # fmt: skip
    attention: str = flag("flash", "the attention kernel priced: flash (FlashAttention's: the masked half skipped, no "
                          "score matrix) or materialised (before 2022: the scores a batched GEMM over the whole square, "
                          "a fused scale-mask-softmax, a second GEMM; Megatron-LM 2021's)", choices=ATTENTION)  # fmt: skip
    json: bool = flag(False, "print the layouts that fit (a given layout: whether or not it fits) as JSON, fastest "
                      "first: layout (its degrees by name), tflops_per_gpu, mfu, step_s, peak_gib, fits")  # fmt: skip

    def given(self) -> dict | None:
        """The degrees of the one layout asked for, or None (enumerate)."""
        if not any(getattr(self, d) for d in DIMS):
            return None
        return {d: getattr(self, d) or 1 for d in DIMS}

    def validate(self) -> None:
        self.the_config_is_the_model()
        require(self.model == "custom" or self.model in MODELS,
                f"--model {self.model!r} is not a shape this project knows; known: {', '.join(MODELS)}, custom")  # fmt: skip
        require(self.model != "custom" or self.global_batch > 0,
                "--model custom needs --global_batch (sequences a step: no published run says it)")  # fmt: skip
        self.refuse_model(self.shape())  # a shape no GPT can have: one line
        # the planner's memory and time read the model's shape as the GPT's (common/hf_model.gpt_config_of): a
        # transformers mixture of experts is not that shape
        require(not experts_of(self.shape()), f"--hf_config {self.hf_config}: a mixture of experts is not priced by the "
                "planner yet")  # fmt: skip
        load_hardware(self.hardware)
        for name in ("gpus", "top"):
            require(getattr(self, name) > 0, f"--{name} must be > 0, got {getattr(self, name)}")
        for name in (*DIMS, "pp_fewer_blocks_at_ends"):
            require(getattr(self, name) >= 0, f"--{name} must be >= 0, got {getattr(self, name)}")
        given = self.given()
        if given:
            product = math.prod(given.values())
            require(product == self.gpus, " x ".join(f"--{d} {n}" for d, n in given.items() if n > 1)
                    + f" = {product:,} GPU(s), but --gpus {self.gpus:,}: the degrees multiply to the GPUs")  # fmt: skip
        require(self.gpus <= MOST_GPUS, f"--gpus {self.gpus:,}: at most {MOST_GPUS:,} (the largest published runs use "
                "tens of thousands)")  # fmt: skip
        require(self.global_batch >= 0, f"--global_batch must be >= 0, got {self.global_batch}")

    def shape(self) -> GPTConfig:
        """--model's shape, changed by the model flags given (custom: the project's GPT)."""
        return self.model_config(GPTConfig() if self.model == "custom" else model_named(self.model).shape)

    def fewer_at_ends_searched(self) -> tuple[int, ...]:
        """The first and last stages' fewer blocks the search weighs for a pipeline: the one given, else an even
        split and Llama 3's (one block fewer at each end: section 3.3.2 of its paper)."""
        return (
            (self.pp_fewer_blocks_at_ends,)
            if "pp_fewer_blocks_at_ends" in getattr(self, "given_flags", ())
            else (0, 1)
        )

    def model_flags(self) -> str:
        """The model flags given, as at_scale takes them (the same shape checked at the real size)."""
        names = [f.name for f in (*dataclasses.fields(HFModelFlags), *dataclasses.fields(ModelFlags))]
        given = [name for name in names if name in getattr(self, "given_flags", ())]
        return "".join(f" --{name} {getattr(self, name)}" for name in given)


MOST_GPUS = 2**20


@dataclass
class Candidate(ParallelArgs):
    """One layout as the strategies see it: their flags (the degrees, the schedule, checkpointing)."""


def divisors(n: int) -> list[int]:
    """n's divisors, ascending, in sqrt(n) steps (a walk to n took minutes for --gpus 1000000000)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def nearest_buildable(cfg: GPTConfig, gpus: int, gpus_per_node: int, global_batch: int) -> int:
    """The GPU count nearest `gpus` (above first) that some layout can be built from."""
    for distance in range(1, gpus):
        for count in (gpus + distance, gpus - distance):
            if count > 0 and next(candidates(cfg, count, gpus_per_node, global_batch), None):
                return count
    return 1


def candidates(cfg: GPTConfig, gpus: int, gpus_per_node: int, global_batch: int, fewer_at_ends=(0,)):
    """Every (degrees, activation checkpointing, schedule, fewer blocks at a pipeline's ends) to consider: under a
    pipeline each of `fewer_at_ends` that makes a layout of its own (lighter_ends_tell)."""
    for tp in (
        d for d in divisors(gpus) if d <= gpus_per_node and cfg.n_head % d == 0 and cfg.kv_heads % d == 0
    ):
        for pp in (d for d in divisors(gpus // tp) if d <= cfg.n_layer):
            # context parallelism for long sequences only (Llama 3 split 131,072 tokens over 16, 8,192 over none)
            long = cfg.block_size >= 32_768
            for cp in (
                d for d in divisors(gpus // tp // pp) if cfg.block_size % (2 * d) == 0 and (d == 1 or long)
            ):
                dp = gpus // (tp * pp * cp)
                if global_batch % dp:
                    continue
                # a mixture of experts: ep of the data-parallel ranks split the experts (each a divisor of both)
                for ep in (d for d in divisors(dp) if cfg.n_experts % d == 0) if cfg.n_experts else (1,):
                    rest = dp // ep
                    # the pipeline's schedule: 1F1B, and interleaved (two stages a rank: half the bubble)
                    # where each rank's micro-batches come p at a time
                    rows = global_batch // dp
                    interleaved = pp > 1 and 2 * pp <= cfg.n_layer and rows % pp == 0
                    for schedule in ("1f1b", "interleaved_1f1b")[: 2 if interleaved else 1]:
                        ends = [
                            n
                            for n in fewer_at_ends
                            if n == 0 or (pp > 1 and lighter_ends_tell(cfg, pp, schedule, n))
                        ]
                        for data_parallel in ("dp_shard", "dp_replicate")[: 2 if rest > 1 else 1]:
                            for checkpointing, fewer in itertools.product(
                                ("none", "selective", "full"), ends
                            ):
                                degrees = {"tp": tp, "pp": pp, "cp": cp, data_parallel: rest, "ep": ep}
                                yield degrees, checkpointing, schedule, fewer


def lighter_ends_tell(cfg: GPTConfig, pp: int, schedule: str, fewer_at_ends: int) -> bool:
    """Whether a pipeline of `pp` ranks under `schedule` with its ends `fewer_at_ends` blocks lighter is a layout of its
    own: every stage still holds a block (pp refuses it otherwise), and some rank holds another number of blocks than
    under the even split (on 2 ranks, 16 and 16 blocks either way: the same memory and work, not listed twice)."""
    n_stages = pp * stages_per_rank(schedule)
    even, lighter = (blocks_a_stage(cfg.n_layer, n_stages, fewer) for fewer in (0, fewer_at_ends))

    def blocks_a_rank(sizes: list[int]) -> list[int]:
        return [sum(sizes[stage] for stage in stages_of(r, pp, schedule)) for r in range(pp)]

    return min(lighter) > 0 and blocks_a_rank(lighter) != blocks_a_rank(even)


def describe(
    degrees: dict,
    checkpointing: str,
    schedule: str = "1f1b",
    sequence_parallel: bool = False,
    fewer_at_ends: int = 0,
) -> str:
    on = [f"{d} {degrees[d]}" for d in DIMS if degrees.get(d, 1) > 1]
    text = " x ".join(on) or "one GPU"
    text += " (sp)" if sequence_parallel else ""
    text += f", {schedule}" if degrees.get("pp", 1) > 1 and schedule != "1f1b" else ""
    text += f", ends {fewer_at_ends} block(s) lighter" if degrees.get("pp", 1) > 1 and fewer_at_ends else ""
    return text + (f", {checkpointing} checkpointing" if checkpointing != "none" else "")


def evaluate(
    reference,
    cfg: GPTConfig,
    degrees: dict,
    checkpointing: str,
    args: PlanArgs,
    hardware,
    schedule: str = "1f1b",
    sequence_parallel: bool | None = None,
    reshard_after_forward: str = "default",
    price_all: bool = True,
    fewer_at_ends: int | None = None,
) -> dict:
    """A candidate's refusal, or its memory per stage and its predicted step. Sequence parallelism (None: wherever
    the strategies run it, but under a pipeline: tp without pp, cp, experts or full checkpointing). Under a pipeline
    it is priced when asked for (`--sequence_parallel`), not enumerated: the closed form put llama3_8b on 8 GPUs at
    pp 2 x dp_shard 2 x tp 2 with it at 62 % MFU, over the 60 % no published run of eager code reaches (the GPU
    profile prices every matmul at the best shape's efficiency). `fewer_at_ends`: a pipeline's first and last stages'
    fewer blocks (None: --pp_fewer_blocks_at_ends)."""
    layout = Layout(**{d: degrees.get(d, 1) for d in DIMS})
    rows = args.global_batch // layout.dp
    if sequence_parallel is None:
        sequence_parallel = (
            layout.tp > 1 and layout.pp == layout.cp == 1 and checkpointing != "full" and not cfg.n_experts
        )
    fewer_at_ends = args.pp_fewer_blocks_at_ends if fewer_at_ends is None else fewer_at_ends
    flags = Candidate(**{d: getattr(layout, d) for d in DIMS}, activation_checkpointing=checkpointing,
                      pp_microbatches=rows, sequence_parallel=sequence_parallel, pp_schedule=schedule,
                      reshard_after_forward=reshard_after_forward,
                      pp_fewer_blocks_at_ends=fewer_at_ends)  # fmt: skip
    work = Workload(cfg, rows, 1, args.mixed_precision)
    row = {"layout": describe(degrees, checkpointing, schedule, sequence_parallel, flags.pp_fewer_blocks_at_ends),
           "degrees": degrees,
           "checkpointing": checkpointing, "pp_schedule": schedule,
           "pp_fewer_blocks_at_ends": flags.pp_fewer_blocks_at_ends if layout.pp > 1 else 0}  # fmt: skip
    try:
        flags.refuse_layout(layout, work, 1.0)
    except UsageError as refusal:
        return row | {"refused": str(refusal)}
    stages = [layout.rank_at(pp=s) for s in range(layout.pp)]
    memory = {rank: memory_estimate(reference, layout, flags, work, rank)["peak"] for rank in stages}
    worst = max(memory, key=memory.get)
    fits = memory[worst] <= hardware.memory_bytes
    if not fits and not price_all:  # listed by how far over it is: no step to predict
        return row | {"peak_bytes": memory[worst], "worst_rank": worst, "worst_stage": layout.coordinate(worst, "pp"),
                      "fits": False}  # fmt: skip
    predicted = predict_step(
        stage_theories(reference, layout, flags, work),
        layout,
        flags,
        work,
        hardware,
        kernels=args.kernels,
        attention=args.attention,
    )
    tflops = (  # the FLOPs a causal model needs (its attention's unmasked half): what the hardware can reach
        model_flops_per_token(cfg, causal=True)
        * predicted["global_tokens"]
        / predicted["step_s"]
        / layout.world_size
        / 1e12
    )
    precision = "bf16" if args.mixed_precision == "bf16" else "fp32"
    return row | {
        "peak_bytes": memory[worst], "worst_rank": worst, "worst_stage": layout.coordinate(worst, "pp"),
        "fits": fits, "step_s": predicted["step_s"],
        "tokens_per_s": predicted["tokens_per_s"], "tflops_per_gpu": tflops,
        "mfu": tflops * 1e12 / hardware.peak_flops[precision], "microbatches": rows if layout.pp > 1 else 1,
        "sequence_parallel": flags.sequence_parallel,
    }  # fmt: skip


def as_json(row: dict) -> dict:
    """A priced layout as --json prints it."""
    return {"layout": {d: row["degrees"].get(d, 1) for d in DIMS}, "activation_checkpointing": row["checkpointing"],
            "pp_schedule": row["pp_schedule"], "pp_fewer_blocks_at_ends": row["pp_fewer_blocks_at_ends"],
            "sequence_parallel": row["sequence_parallel"],
            "tflops_per_gpu": row["tflops_per_gpu"], "mfu": row["mfu"], "step_s": row["step_s"],
            "peak_gib": row["peak_bytes"] / 2**30, "fits": row["fits"]}  # fmt: skip


def print_given(args: PlanArgs, row: dict, hardware) -> int:
    """The one layout asked for, priced; exit 0 if it fits, 1 if not (said in words)."""
    if args.json:
        print(json.dumps([as_json(row)], indent=1))
        return 0 if row["fits"] else 1
    capacity = hardware.memory_bytes / 2**30
    verdict = ("fits" if row["fits"] else f"does NOT fit: rank {row['worst_rank']} (stage {row['worst_stage']}) "
               f"needs {row['peak_bytes'] / 2**30 - capacity:,.1f} GiB more than the {capacity:.0f} GiB a GPU has")  # fmt: skip
    print(ceiling(hardware, args.mixed_precision))
    print(f"{args.model} on {args.gpus:,} x {hardware.name}, {row['layout']}: peak {row['peak_bytes'] / 2**30:,.1f} "
          f"GiB ({verdict}); PREDICTED ({args.kernels} kernels, {args.attention} attention) step {row['step_s']:.3g} s, "
          f"{row['tokens_per_s']:,.0f} tokens/s, "
          f"{row['tflops_per_gpu']:.0f} TFLOP/s per GPU, MFU {row['mfu']:.0%}")  # fmt: skip
    print(f"check it at the real size: {at_scale_command(args, row)}")
    return 0 if row["fits"] else 1


def ceiling(hardware, mixed_precision: str) -> str:
    """What bounds every layout's MFU on this profile: its op model's throughputs against the datasheet's peak."""
    ops = hardware.ops
    if ops.gemm_points:
        return f"{hardware.name}: ops priced as measured here (planning/hardware.yaml)"
    return (f"ceiling: {hardware.name}'s matmuls reach {ops.gemm_efficiency:.1%} of its {mixed_precision} peak, attention "
            f"{ops.attention_efficiency:.1%}, memory-bound ops {ops.memory_efficiency:.0%} of its bandwidth (published "
            f"measurements: planning/hardware.yaml names each); no layout's MFU can pass {ops.gemm_efficiency:.0%} "
            "(model FLOPs: 6N and the causal half of the attention, the work a causal model needs)")  # fmt: skip


def at_scale_command(args: PlanArgs, row: dict) -> str:
    degrees = " ".join(f"--{d} {n}" for d, n in row["degrees"].items() if n > 1)
    extra = f" --activation_checkpointing {row['checkpointing']}" if row["checkpointing"] != "none" else ""
    extra += " --sequence_parallel" if row["sequence_parallel"] else ""
    if row["pp_fewer_blocks_at_ends"]:
        extra += f" --pp_fewer_blocks_at_ends {row['pp_fewer_blocks_at_ends']}"
    # at_scale runs one stage a rank (gpipe, 1f1b): another schedule's layout is checked under 1f1b, said so
    extra += " --pp_schedule gpipe" if row["pp_schedule"] == "gpipe" else ""
    if (
        args.model == "custom" or args.global_batch != model_named(args.model).global_batch
    ):  # not the published batch
        extra += f" --per_rank_batch_size {args.global_batch // Layout(**row['degrees']).dp}"
    model = "" if args.hf_config else f" --model {args.model}"  # a transformers config is the model
    unrun = f" ({row['pp_schedule']} is priced, not run at scale: its layout under 1f1b)"
    return (
        f"python experiments/at_scale.py{model}{args.model_flags()} --world_size {args.gpus} {degrees}{extra} "
        f"--hardware {args.hardware}" + (unrun if row["pp_schedule"] not in ("gpipe", "1f1b") else "")
    )


def plan(args: PlanArgs) -> int:
    hardware = load_hardware(args.hardware)
    cfg = args.shape()
    args.global_batch = args.global_batch or model_named(args.model).global_batch
    reference = meta_gpt(cfg)
    given = args.given()
    if given:  # the one layout asked for: priced and printed whether or not it fits
        row = evaluate(reference, cfg, given, args.activation_checkpointing, args, hardware, args.pp_schedule,
                       args.sequence_parallel, args.reshard_after_forward)  # fmt: skip
        require("refused" not in row, f"{row['layout']}: {row.get('refused')}")
        return print_given(args, row, hardware)
    # a layout that does not fit is not priced: listed by how far over it is
    layouts = list(
        candidates(cfg, args.gpus, hardware.gpus_per_node, args.global_batch, args.fewer_at_ends_searched())
    )
    # no degrees multiply to --gpus under the rules (a prime past a node and the layers): that, not "nothing fits"
    require(layouts, f"--gpus {args.gpus:,}: no layout of {args.model} can be built from {args.gpus:,} GPUs (tp divides "
            f"its {cfg.n_head} heads within a node of {hardware.gpus_per_node}, pp at most its {cfg.n_layer} layers, the "
            f"data-parallel ranks divide its {args.global_batch:,} sequences a step); use a count those make up, e.g. "
            f"{nearest_buildable(cfg, args.gpus, hardware.gpus_per_node, args.global_batch):,}")  # fmt: skip
    rows = [evaluate(reference, cfg, degrees, checkpointing, args, hardware, schedule, price_all=False, fewer_at_ends=fewer)
            for degrees, checkpointing, schedule, fewer in layouts]  # fmt: skip
    fitting = sorted((r for r in rows if r.get("fits")), key=lambda r: -r["tokens_per_s"])
    # --json: only what fits. A layout that needs more memory than a GPU has is no plan (and priced, some of them
    # read 70 % MFU and more: nothing the hardware runs)
    if args.json:
        print(json.dumps([as_json(r) for r in fitting], indent=1))
        if not fitting:
            print(f"nothing fits: {args.model} on {args.gpus:,} x {hardware.name} (without --json: the nearest to "
                  "fitting, and why)", file=sys.stderr)  # fmt: skip
        return 0 if fitting else 1
    capacity = hardware.memory_bytes / 2**30
    print(f"{args.hf_config or args.model}: {count_parameters(reference):,} parameters, {cfg.block_size:,} tokens a sequence, "
          f"{args.global_batch:,} sequences a step, on {args.gpus:,} x {hardware.name} ({capacity:.0f} GiB each); "
          f"{len(rows)} layouts considered, {len(fitting)} fit. Memory: theory and estimate; speed: PREDICTED "
          f"({args.kernels} kernels, {args.attention} attention)")  # fmt: skip
    print(ceiling(hardware, args.mixed_precision))
    if fitting:
        width = max(62, *(len(r["layout"]) for r in fitting[: args.top]))  # the longest layout's words
        print(f"\n{'layout':<{width}} {'micro-batches':>13} {'peak GiB':>8} {'step s':>8} {'tokens/s':>12} "
              f"{'TFLOP/s':>8} {'MFU':>5}")  # fmt: skip
        for r in fitting[: args.top]:
            print(f"{r['layout']:<{width}} {r['microbatches']:>13} {r['peak_bytes'] / 2**30:>8.1f} {r['step_s']:>8.3g} "
                  f"{r['tokens_per_s']:>12,.0f} {r['tflops_per_gpu']:>8.0f} {r['mfu']:>5.0%}")  # fmt: skip
        print(f"\ncheck the first at the real size: {at_scale_command(args, fitting[0])}")
    too_big = sorted((r for r in rows if "fits" in r and not r["fits"]), key=lambda r: r["peak_bytes"])
    refused = [r for r in rows if "refused" in r]
    if too_big or refused:
        print(f"\nrejected: {len(too_big)} need more memory than a GPU has, {len(refused)} cannot run here; "
              "the nearest to fitting:")  # fmt: skip
        for r in too_big[:5]:
            print(f"  {r['layout']}: rank {r['worst_rank']} (stage {r['worst_stage']}) needs "
                  f"{r['peak_bytes'] / 2**30:,.1f} GiB, {r['peak_bytes'] / 2**30 - capacity:,.1f} GiB over")  # fmt: skip
        for reason in sorted({r["refused"] for r in refused})[:5]:
            print(f"  refused ({sum(r.get('refused') == reason for r in refused)} layouts): {reason}")
    if not fitting:
        states = 16 * count_parameters(reference) / args.gpus / 2**30
        least = ""
        if too_big:
            least = f" the least any layout needs is {too_big[0]['peak_bytes'] / 2**30:,.1f} GiB ({too_big[0]['layout']})"
        print(f"\nnothing fits: {args.model} on {args.gpus:,} x {hardware.name}:{least}, against {capacity:.0f} GiB a "
              f"GPU; the model states alone (16 bytes a parameter: weights, gradients, AdamW's two moments) are "
              f"{states:,.1f} GiB a GPU however they are split. Use more GPUs, or a smaller model or sequence.")  # fmt: skip
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return plan(parse_config(PlanArgs, argv, description=__doc__.split("\n")[0], prog="python -m tools.plan"))


if __name__ == "__main__":
    run_cli(main)
