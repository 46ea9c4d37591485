"""train_gpt: a small GPT on real text, trained by every parallelism strategy the field uses. Does each
train exactly what one process would, hold what its theory says it holds, and send what it says it sends?

The model is common/gpt.py (nanoGPT-style, 4 blocks of width 128, ~1M parameters); the text is CPython's
own reference prose (pydoc topics) or --text_files, tokenized by a BPE trained here (common/text.py).
AdamW, warm-up + cosine learning rate, clipping by the GLOBAL gradient norm, optional bf16.
--strategy picks one module of strategies/ (how it is applied, what each rank holds and sends by theory,
its mistakes): none, ddp, zero2, fsdp, tp, fsdp_tp, pp (pipeline stages, --pp_schedule, --pp_microbatches),
cp (each sequence split over the ranks, attention over all-gathered keys and values), or DeepSpeed's
ZeRO-1/2/3, which the accelerate config chooses (deepspeed_zero1/2/3; --strategy auto). This file is the
same for all of them. --activation_checkpointing full|selective trades kept activations for recompute
(common/activations.py).

Checks (each has a --wrong_variant that fails it; strategies/checks.py):
- matches_single_process  the loss at every one of the first --parity_steps steps and every parameter
                          after them equal one process on the same global batches (why not all steps:
                          AdamW amplifies float rounding ~10x every few steps, README);
- grad_norm_is_global     the norm clipping used equals the one-process gradient norm at those steps;
- memory_per_rank         bytes of parameters, gradients and optimizer state each rank holds (and of
                          parameters between forward and backward) equal the strategy's theory;
- communication_volume    bytes of every collective of one step's forward and backward (the third step:
                          the first two carry one-time work), counted, equal the strategy's theory;
- loss_decreased          validation loss falls by --min_loss_drop (a resumed run's: at all);
- resume_restored_state   (resumed runs) the full state right after loading is, by digest, the saved one.
Checkpoints (--checkpoint_every N, --resume_from_checkpoint latest|PATH) are PyTorch's distributed
checkpoint, verified before use (common/checkpoint.py); the data position is in samples, so a checkpoint
of any strategy on N ranks continues under any strategy on M. At the end: a short generated sample.

Run it (2 CPU ranks; the same commands on GPUs with accelerate_configs/multi_gpu_ddp.yaml):
    python experiments/train_gpt.py                                     # --strategy none, 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy fsdp
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml experiments/train_gpt.py   # DeepSpeed
    torchrun --nproc_per_node 3 experiments/train_gpt.py --strategy fsdp --d_model 96   # 3 uneven shards
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 4 experiments/train_gpt.py \\
        --strategy fsdp_tp --dp_size 2 --tp_size 2      # 4 ranks on 2 cores: slow, but every check runs
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy pp \\
        --pp_schedule zbv          # 2 stage-ranks, 2 stages each in a V; --dp_size 2 on 4 ranks: 2 pipelines
Every strategy side by side: python -m benchmarks.compare_strategies. Where a step's time goes:
--profile_steps 5 (torch.profiler traces per rank); against this machine's peak: python -m benchmarks.performance
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.activations import MODES
from common.checkpoint import ResumableArgs
from common.config import flag, parse_config, require, require_positive, run_cli
from common.data import iterate_sample_stream, shard_rows
from common.gpt import (
    PER_RANK_BATCH_SIZE,
    GPTConfig,
    build_gpt,
    count_parameters,
    require_trainable,
)
from common.optim import cosine_lr, set_lr
from common.profiling import StepProfiler, report_profile
from common.run import start_run
from common.runtime import deepspeed_stage, launched_world_size
from common.text import load_corpus
from common.training import TrainLoop
from strategies import STRATEGIES, WRONG_VARIANTS, pp, strategies_with
from strategies.checks import (
    Probe,
    check_communication,
    check_memory,
    compare_with_one_process,
    peak_rss_bytes,
)
from strategies.fsdp import set_gradient_sync

EXPERIMENT = "train_gpt"
# Tokens per evaluation forward (at least a training micro-batch): the mean over every validation token is
# the same in any batches, and fewer, larger forwards pay each strategy's per-forward collectives (tp's
# all-reduces, fsdp's all-gathers) less often: a tiny tp run took 13.0 s evaluating 4 rows at a time, 7.9 s
# at 64 (measured). Its logits are this x vocabulary floats.
EVAL_TOKENS = 4096
MODEL = GPTConfig()  # the default model


@dataclass
class Config(ResumableArgs):
    sweep_metrics = ("loss", "tokens_per_s", "val_loss")
    # Checkpoints are DCP (any strategy reads any other's) and the data position is in samples: a resume
    # may change the strategy and the world size.
    reshardable = True
    layout_flags = (
        "strategy",
        "dp_size",
        "tp_size",
        "pp_schedule",
        "pp_microbatches",
        "cp_load_balance",
        "sequence_parallel",
    )
    # How close a check wants its figures; they change no result, so a resume may change them.
    tolerances = ("loss_atol", "param_atol", "grad_norm_rtol", "loss_atol_bf16", "param_atol_bf16", "grad_norm_rtol_bf16",
                  "memory_rtol")  # fmt: skip
    # --text_files is known by its content (the corpus's and its tokenizer's sha256, in every checkpoint)
    result_neutral = (*ResumableArgs.result_neutral, *tolerances, "parity_steps", "parity_steps_bf16", "min_loss_drop",
                      "sample_tokens", "profile_steps", "text_files", "activation_checkpointing")  # fmt: skip

    strategy: str = flag("auto", "one of strategies/: " + ", ".join(STRATEGIES) + "; auto: the DeepSpeed stage of a "
                         "DeepSpeed accelerate config, else none for one process, ddp for several",
                         choices=("auto", *STRATEGIES))  # fmt: skip
    dp_size: int = flag(0, "fsdp_tp: data-parallel groups (0: world size / --tp_size); pp: copies of the pipeline "
                        "(0: 1, every rank a stage-rank); cp: groups splitting one sequence (0: 1)")  # fmt: skip
    tp_size: int = flag(0, "tp, fsdp_tp: ranks per tensor-parallel group (0: tp every rank, fsdp_tp 2)")
    pp_schedule: str = flag("1f1b", "pp: the pipeline schedule (gpipe, 1f1b: one stage per rank; interleaved_*, zbv, "
                            "dualpipev: two)", choices=tuple(pp.SCHEDULES))  # fmt: skip
    pp_microbatches: int = flag(4, "pp: micro-batches per step, each --per_rank_batch_size / this blocks")
    sequence_parallel: bool = flag(False, "tp: Megatron's sequence parallelism: LayerNorms and residuals on 1/N of "
                                   "the tokens, all-reduces replaced by reduce-scatter + all-gather")  # fmt: skip
    cp_load_balance: bool = flag(True, "cp: each rank holds a head and a tail chunk of the sequence (equal causal "
                                 "attention work); false: neighbouring chunks (the last rank does the most)")  # fmt: skip
    text_files: str = flag("", "comma-separated text files to train on (default: CPython's pydoc topics)")
    vocab_size: int = flag(MODEL.vocab_size, "BPE vocabulary trained on the corpus")
    block_size: int = flag(MODEL.block_size, "context length in tokens")
    n_layer: int = flag(MODEL.n_layer, "transformer blocks")
    n_head: int = flag(MODEL.n_head, "attention heads (must divide d_model)")
    d_model: int = flag(MODEL.d_model, "model width")
    tie_weights: bool = flag(MODEL.tie_weights, "share the token embedding with the output head")
    activation_checkpointing: str = flag("none", "each block keeps only its input (full) or that and its matmul and "
                                         "attention outputs (selective) for backward, and recomputes the rest "
                                         "(common/activations.py)", choices=MODES)  # fmt: skip
    val_fraction: float = flag(0.1, "share of the token stream held out for validation")
    per_rank_batch_size: int = flag(PER_RANK_BATCH_SIZE, "blocks per data-parallel rank per micro-batch; "
                                    "global batch = this x data-parallel ranks x accumulation")  # fmt: skip
    gradient_accumulation_steps: int = flag(1, "micro-batches per optimizer step (Accelerate's accumulate())")
    max_steps: int = flag(300, "optimizer steps")
    log_every: int = flag(25, "steps between console lines / metrics.jsonl records")
    lr: float = flag(3e-3, "peak AdamW learning rate")
    min_lr_ratio: float = flag(0.1, "the cosine schedule ends at lr x this")
    warmup_steps: int = flag(20, "linear warm-up steps")
    lr_decay_steps: int = flag(0, "steps over which the cosine decays to lr x min_lr_ratio, then stays there "
                               "(nanoGPT's lr_decay_iters; 0: --max_steps). A checkpoint records it: to train a "
                               "resumed run longer, keep its value")  # fmt: skip
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices (not on biases, norms)")
    grad_clip: float = flag(1.0, "clip gradients to this global norm (0: off)")
    mixed_precision: str = flag("no", "no or bf16 (Accelerate's autocast for none/ddp; FSDP2's MixedPrecisionPolicy "
                                "for zero2/fsdp)", choices=("no", "bf16"))  # fmt: skip
    # Parity with one process, float32: measured ~1e-6 (loss) and ~1e-5 (parameters) over 15 steps. Why 15:
    # fsdp_tp rounds differently in every forward (split matmuls, partial sums all-reduced) and AdamW
    # amplifies it: its loss difference was <= 9.5e-07 up to step 18, then 4.3e-06 and 9.1e-06 at 19-20.
    parity_steps: int = flag(15, "float32: steps compared with the one-process run (0: none)")
    loss_atol: float = flag(1e-5, "float32: largest |distributed - one process| loss in those steps")
    param_atol: float = flag(1e-4, "float32: largest |distributed - one process| parameter after them")
    grad_norm_rtol: float = flag(
        1e-3, "float32: largest relative |clipping norm - one-process gradient norm|"
    )
    # bf16 rounds to ~3 digits, and the differences grow faster: measured ~1e-3 over 12 steps, 0.1 at step 19.
    parity_steps_bf16: int = flag(10, "bf16: steps compared with the one-process run (0: none)")
    loss_atol_bf16: float = flag(5e-3, "bf16: largest |distributed - one process| loss in those steps")
    param_atol_bf16: float = flag(1e-2, "bf16: largest |distributed - one process| parameter after them")
    grad_norm_rtol_bf16: float = flag(
        1e-2, "bf16: largest relative |clipping norm - one-process gradient norm|"
    )
    memory_rtol: float = flag(0.01, "allowed relative difference of bytes held per rank from the theory")
    min_loss_drop: float = flag(0.3, "validation loss must fall by more than this (nats) from the initialisation; "
                                "a resumed run's must fall")  # fmt: skip
    sample_tokens: int = flag(40, "tokens of text generated at the end (0: none)")
    profile_steps: int = flag(0, "torch.profiler traces this many steps (0: off) after the one-time work (the "
                              "first 3 steps and the --parity_steps snapshot) and one warm-up step: "
                              "<output_dir>/profile/rank<r>.json (ui.perfetto.dev), each step split into "
                              "compute / communication / overlapped / idle, and profile/timeline.png")  # fmt: skip
    wrong_variant: str = flag("", "a deliberate mistake that a check must catch: " + ", ".join(WRONG_VARIANTS),
                              choices=("", *WRONG_VARIANTS))  # fmt: skip

    def validate(self) -> None:
        super().validate()
        require_positive(self, "vocab_size", "block_size", "n_layer", "n_head", "d_model", "per_rank_batch_size",
                         "pp_microbatches", "gradient_accumulation_steps", "lr", *self.tolerances)  # fmt: skip
        require(
            self.d_model % self.n_head == 0, f"--n_head {self.n_head} must divide --d_model {self.d_model}"
        )
        require(0 < self.val_fraction < 0.5, f"--val_fraction must be in (0, 0.5), got {self.val_fraction}")
        non_negative = min(self.warmup_steps, self.lr_decay_steps, self.grad_clip, self.weight_decay) >= 0
        require(0 <= self.min_lr_ratio <= 1 and non_negative, "--min_lr_ratio must be in [0, 1]; --warmup_steps, "
                "--lr_decay_steps, --grad_clip, --weight_decay >= 0")  # fmt: skip
        require(
            self.vocab_size >= 260, f"--vocab_size must be >= 260 (256 bytes + merges), got {self.vocab_size}"
        )
        world_size = launched_world_size(self)
        self.strategy = resolve_strategy(self.strategy, world_size)  # config.json records what really ran
        layout = self.layout(world_size)  # the strategy's refusals of the job's shape
        STRATEGIES[self.strategy].refuse(self, layout)
        require(
            not self.wrong_variant.startswith("resume_") or self.resume_from_checkpoint,
            f"--wrong_variant {self.wrong_variant} is a mistake made when resuming: add --resume_from_checkpoint",
        )
        require(not self.sequence_parallel or self.strategy == "tp",
                f"--sequence_parallel is tensor parallelism's (--strategy tp), not {self.strategy}")  # fmt: skip
        require(not self.wrong_variant or self.strategy in strategies_with(self.wrong_variant),
                f"--wrong_variant {self.wrong_variant} is a mistake only under --strategy "
                f"{', '.join(strategies_with(self.wrong_variant))}, not {self.strategy}")  # fmt: skip
        most = self.max_steps - self.steps_before_profiling() - 1
        require(self.profile_steps == 0 or 0 < self.profile_steps <= most,
                f"--profile_steps {self.profile_steps}: must be 0 (off) or 1..{most} with --max_steps {self.max_steps}: "
                f"profiling starts after {self.steps_before_profiling()} steps of one-time work (the first 3, the "
                "--parity_steps snapshot) and one warm-up step")  # fmt: skip
        require(0 <= self.parity()["steps"] <= self.max_steps,
                f"--parity_steps{'_bf16' * (self.mixed_precision == 'bf16')} must be in [0, --max_steps], "
                f"got {self.parity()['steps']}")  # fmt: skip
        sizes = ("d_model", "n_layer", "vocab_size", "block_size", "per_rank_batch_size")
        require_trainable(
            self.model_config(),
            self.per_rank_batch_size,
            " ".join(f"--{n} {getattr(self, n)}" for n in sizes),
        )

    def model_config(self, vocab_size: int = 0) -> GPTConfig:
        """The model of these flags (the vocabulary the tokenizer really has, once it is trained)."""
        return GPTConfig(vocab_size or self.vocab_size, self.block_size, self.n_layer, self.n_head, self.d_model,
                         self.tie_weights)  # fmt: skip

    def layout(self, world_size: int):
        return STRATEGIES[self.strategy].layout(world_size, self.dp_size, self.tp_size)

    def trajectory(self, world_size: int) -> dict:
        """As RunArgs', except that a mistake made only while resuming (resume_*) is not the checkpoint's,
        and the learning-rate schedule's length is the one it runs with (--lr_decay_steps 0 follows
        --max_steps: a resume that grows --max_steps would stretch the schedule mid-run, so it differs)."""
        trajectory = super().trajectory(world_size)
        if self.wrong_variant.startswith("resume_"):
            trajectory["wrong_variant"] = ""
        trajectory["lr_decay_steps"] = self.lr_decay_steps or self.max_steps
        return trajectory

    def refuse_resume(self, meta: dict, world_size: int) -> None:
        """A checkpoint in a strategy's own format (DeepSpeed's) resumes only under that strategy at the same
        world size; DCP checkpoints resume under any DCP strategy at any world size."""
        saved = meta["layout"].get("strategy")
        owner = next(
            (
                s
                for s in (saved, self.strategy)
                if getattr(STRATEGIES.get(s), "CHECKPOINT_FORMAT", "dcp") != "dcp"
            ),
            None,
        )
        require(owner is None or (saved == self.strategy and meta["world_size"] == world_size),
                f"the checkpoint was written by {saved} on {meta['world_size']} rank(s), not {self.strategy} on {world_size}: "
                f"{owner}'s checkpoints are its own format, resumed only by {owner} on as many ranks (a converter to "
                "PyTorch's distributed checkpoint: not built)")  # fmt: skip

    def resume_hint(self, difference: str) -> str:
        """Said after a refused resume's difference, where the fix is not obvious."""
        if difference.startswith("--lr_decay_steps"):
            return (" (the cosine schedule's length, which --max_steps sets while --lr_decay_steps is 0; to train "
                    f"longer on the checkpoint's schedule pass --lr_decay_steps {difference.split()[1]})")  # fmt: skip
        return ""

    def steps_before_profiling(self) -> int:
        """Steps of one-time work, left out of --profile_steps: the first 3 (after the evaluation FSDP2's root
        stays gathered; DDP rebuilds its buckets in the 2nd; the 3rd is counted) and the --parity_steps snapshot."""
        return max(3, self.parity()["steps"])

    def parity(self) -> dict:
        """How many steps are compared with one process, and within what, for this run's precision."""
        suffix = "_bf16" if self.mixed_precision == "bf16" else ""
        names = (("steps", "parity_steps"), ("loss_atol", "loss_atol"), ("param_atol", "param_atol"),
                 ("grad_norm_rtol", "grad_norm_rtol"))  # fmt: skip
        return {name: getattr(self, f"{flag_name}{suffix}") for name, flag_name in names}


def resolve_strategy(asked: str, world_size: int) -> str:
    """--strategy auto, and the one refusal an accelerate config makes: a DeepSpeed config means DeepSpeed."""
    stage = deepspeed_stage()
    if asked == "auto":
        return f"deepspeed_zero{stage}" if stage else ("none" if world_size == 1 else "ddp")
    require(stage is None or asked == f"deepspeed_zero{stage}",
            f"--strategy {asked}: this launch's accelerate config is DeepSpeed ZeRO-{stage}, which runs "
            f"deepspeed_zero{stage}; pass --strategy auto or deepspeed_zero{stage}, or launch with another config")  # fmt: skip
    return asked


def lr_at(step: int, cfg: Config) -> float:
    return cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps or cfg.max_steps, cfg.min_lr_ratio)


def run(cfg: Config) -> int:
    strategy = STRATEGIES[cfg.strategy]
    # The corpus first, before the run starts: its content hashes tie every checkpoint to this data (a resume
    # on other text is refused before anything is written). The token cache is built once, under a file lock.
    corpus = load_corpus(cfg.text_files, cfg.vocab_size, cfg.block_size, cfg.val_fraction, cfg.dist_timeout_s)
    autocast = cfg.mixed_precision if strategy.AUTOCAST else "no"  # or the strategy's own (FSDP2's policy)
    accumulation = cfg.gradient_accumulation_steps
    with (
        start_run(cfg, EXPERIMENT, data_identity=corpus["identity"], gradient_accumulation_steps=accumulation,
                  mixed_precision=autocast) as session,
        strategy.quiet(),  # what the strategy says that is expected
    ):  # fmt: skip
        accelerator = session.accelerator
        rank, layout = accelerator.process_index, cfg.layout(accelerator.num_processes)
        gpt_cfg = cfg.model_config(corpus["vocab_size"])

        # The data: one stream of samples; each data-parallel rank takes its rows of every global micro-batch
        # (4 blocks per rank x 2 data-parallel ranks = 8 blocks of 64 tokens). The position is in samples, so
        # a resume at another world size (another global batch) continues at the same place.
        start_sample = 0 if cfg.wrong_variant == "resume_without_data_position" else session.samples_seen
        forgot_the_sampler = cfg.wrong_variant == "same_data_on_every_rank"
        data_rank = 0 if forgot_the_sampler else layout.dp_rank(rank)
        global_rows = cfg.per_rank_batch_size * layout.dp
        stream = iterate_sample_stream(*corpus["train"], global_rows, cfg.seed, start_sample)
        batches = (shard_rows(batch, data_rank, layout.dp) for batch in stream)
        val_shard = shard_rows(corpus["val"], layout.dp_rank(rank), layout.dp)

        # The model: the same initial weights on every rank and in the reference (unless seed_per_rank); then
        # the strategy decides who holds what, and AdamW steps on whatever each rank holds.
        model = build_gpt(gpt_cfg, cfg.seed + rank * (cfg.wrong_variant == "seed_per_rank"))
        model.set_activation_checkpointing(cfg.activation_checkpointing)  # memory for recompute, any strategy
        initial_state, n_parameters = copy.deepcopy(model.state_dict()), count_parameters(model)
        model, optimizer = strategy.apply(model, layout, accelerator, cfg)  # AdamW on what each rank holds
        checkpointer = strategy.checkpointer(model, optimizer, accelerator, cfg)
        # tokens/s is the steady state's: the first steps, the parity snapshot and any profiled steps are left out
        one_time_steps = cfg.steps_before_profiling() + (1 + cfg.profile_steps if cfg.profile_steps else 0)
        loop = TrainLoop(session, model, optimizer, global_rows, checkpointer, tokens_per_sample=cfg.block_size,
                         one_time_steps=one_time_steps)  # fmt: skip
        eval_rows = max(cfg.per_rank_batch_size, EVAL_TOKENS // cfg.block_size)
        val_loss_before = evaluate(model, val_shard, eval_rows, accelerator)  # after any resume
        session.print(
            f"{n_parameters:,} parameters, {corpus['tokens']:,} tokens of {corpus['name']}, {cfg.strategy} on "
            + (
                f"{layout.pp} pipeline stage-ranks ({cfg.pp_schedule}, m = {cfg.pp_microbatches}) x "
                if layout.pp > 1
                else ""
            )
            + f"{layout.dp} data-parallel x {layout.tp} tensor-parallel rank(s), validation loss {val_loss_before:.3f}"
        )

        # The loop. The probe keeps what the checks need: bytes held, each step's loss and gradient norm, the
        # state at --parity_steps, the collectives of one steady step (strategies/checks.py)
        probe = Probe(accelerator, strategy, checkpointer, cfg, session.start_step)
        profile = os.path.join(session.output_dir, "profile")
        profiler = StepProfiler(
            cfg.profile_steps, profile, rank, accelerator.device.type, cfg.steps_before_profiling()
        )
        with profiler:
            for x, y in loop.micro_batches(batches):
                step = loop.step + 1
                # Accelerate's accumulate(): DDP's no_sync and loss / k on all but a step's last micro-batch
                with accelerator.accumulate(model):
                    set_gradient_sync(model, accelerator.sync_gradients)  # FSDP2's no_sync
                    set_lr(optimizer, lr_at(step, cfg))  # before backward: DeepSpeed steps inside it
                    with probe.watch("forward", step):
                        loss = strategy.forward(model, x, y)
                    probe.after_forward(model)
                    with probe.watch("backward", step):
                        strategy.backward(model, loss, accelerator)
                    with probe.watch("optimizer", step):
                        if accelerator.sync_gradients:
                            probe.grad_norms.append(strategy.clip(model, cfg))  # by the GLOBAL norm
                        optimizer.step()
                    probe.after_micro_batch(model, optimizer, loss, step)
                    optimizer.zero_grad()
                loop.record(loss, **probe.latest(optimizer))
                if accelerator.sync_gradients:
                    profiler.step()
        if cfg.profile_steps:
            title = f"{cfg.strategy} on {layout.world_size} rank(s): each rank's median profiled step"
            skipped = f"--profile_steps {cfg.profile_steps}: nothing profiled; this run trained too few steps"
            report_profile(session, profiler.breakdown(), title, skipped)
        strategy.report(session, model, cfg)  # what this strategy measures beyond the checks (pp: its bubble)

        # The checks
        val_loss = evaluate(model, val_shard, eval_rows, accelerator)
        step_losses = accelerator.reduce(torch.stack(probe.step_losses), "mean").tolist()  # global, per step
        final_state = checkpointer.full_state()  # every tensor whole, on the main process (a collective)
        held = probe.held | {"peak_rss_bytes": peak_rss_bytes()}
        every_rank = accelerator.gather_for_metrics([held], use_gather_object=True)
        corpus_facts = ("name", "sha256", "characters", "tokens", "characters_per_token", "vocab_size")
        session.metrics.update(
            loop.metrics(final_state),
            val_loss_before=val_loss_before,
            val_loss=val_loss,
            step_losses=step_losses,
            grad_norms=probe.grad_norms,
            bytes_per_rank=every_rank,
            step_time_ms=probe.median_step_time_ms(),
            dp_size=layout.dp,
            tp_size=layout.tp,
            pp_size=layout.pp,
            parameters=n_parameters,
            corpus={k: corpus[k] for k in corpus_facts},
        )
        # from where THIS run started: the initialisation, or a checkpoint that has learned (it must only fall)
        resumed = session.checkpoint is not None
        min_drop = 0.0 if resumed else cfg.min_loss_drop
        session.check(
            "loss_decreased",
            val_loss < val_loss_before - min_drop,
            f"validation loss {val_loss_before:.3f} -> {val_loss:.3f} (from "
            f"{'the loaded checkpoint' if resumed else 'the initialisation'}), must fall by more than {min_drop}",
        )
        if session.is_main:
            theory_model = build_gpt(gpt_cfg, cfg.seed)  # the undistributed model the theory is written for
            check_memory(session, strategy, layout, cfg, theory_model, every_rank, cfg.memory_rtol)
            if cfg.strategy != "none":
                check_communication(session, strategy, layout, cfg, theory_model, probe.collectives)
            if cfg.strategy != "none" and probe.at_parity_step is not None:
                # the reference replays the same global batches, from where the data stream really was
                reference_batches = iterate_sample_stream(
                    *corpus["train"], global_rows, cfg.seed, session.samples_seen
                )
                start_state = loop.resumed_full_state or (initial_state, None)
                compare_with_one_process(session, cfg, gpt_cfg, start_state, reference_batches, probe,
                                         step_losses, lambda step: lr_at(step, cfg))  # fmt: skip
            session.metrics["sample"] = generate_sample(
                cfg, gpt_cfg, final_state[0], corpus, accelerator.device
            )
            session.print(f"sample: {session.metrics['sample']!r}")
        session.log(loop.step, {**loop.last_interval, "val_loss": val_loss})
    return session.exit_code


def evaluate(
    model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor], batch_size: int, accelerator
) -> float:
    """Mean validation loss over every rank's shard (the shards are equal, so every rank runs the same number
    of forwards: FSDP all-gathers in each)."""
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for start in range(0, len(shard[0]), batch_size):
            x, y = (t[start : start + batch_size].to(accelerator.device) for t in shard)
            _, loss = model(x, y)
            total += torch.stack(
                [loss.double() * y.numel(), torch.tensor(float(y.numel()), dtype=torch.float64)]
            )
    total = accelerator.reduce(total, "sum")
    return (total[0] / total[1]).item()


def generate_sample(cfg: Config, gpt_cfg: GPTConfig, state: dict, corpus: dict, device) -> str:
    """A few tokens from the trained model, prompted with the start of the validation text."""
    if not cfg.sample_tokens:
        return ""
    model = build_gpt(gpt_cfg, cfg.seed).to(device)
    model.load_state_dict(state)
    prompt = corpus["val"][0][0][:8].unsqueeze(0).to(device)
    tokens = model.generate(
        prompt, cfg.sample_tokens, generator=torch.Generator(device=device).manual_seed(cfg.seed)
    )
    return corpus["tokenizer"].decode(tokens[0].tolist())


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
