"""train_gpt: a small GPT on real text, trained under every parallelism the field uses, alone or composed. Does
each layout train exactly what one process would, hold what its theory says it holds, and send what it says
it sends?

The model is common/gpt.py (nanoGPT-style, 4 blocks of width 128, ~1M parameters); the text is CPython's own
reference prose (pydoc topics) or --text_files, tokenized by a BPE trained here (common/text.py). AdamW,
warm-up + cosine learning rate, clipping by the GLOBAL gradient norm, optional bf16. The layout is five
degrees, any combination, their product the ranks launched (strategies/): --dp_replicate (replicas), --dp_shard
(FSDP2: ZeRO-3, or ZeRO-2 with --reshard_after_forward never), --tp (Megatron tensor parallelism, and
--sequence_parallel), --pp (pipeline stages, --pp_schedule, --pp_microbatches), --cp (each sequence split over
ranks); --strategy ddp|zero2|fsdp|tp|fsdp_tp|pp|cp is a preset that fills in the degrees left unset, and
DeepSpeed's ZeRO-1/2/3 is chosen by its accelerate config. This file is the same for all of them.

Checks (each has a --wrong_variant that fails it; strategies/checks.py):
- matches_single_process  the loss at every one of the first --parity_steps steps and every parameter after
                          them equal one process on the same global batches (why not all steps: AdamW
                          amplifies float rounding ~10x every few steps, README);
- grad_norm_is_global     the norm clipping used equals the one-process gradient norm at those steps;
- memory_per_rank         bytes of parameters, gradients and optimizer state each rank holds (and of
                          parameters between forward and backward) equal that rank's theory;
- communication_volume    bytes of every collective of one steady step's forwards and backwards, counted on
                          every rank, equal that rank's theory;
- loss_decreased          validation loss falls by --min_loss_drop (a resumed run's: at all);
- resume_restored_state   (resumed runs) the full state right after loading is, by digest, the saved one.
Checkpoints (--checkpoint_every N, --resume_from_checkpoint latest|PATH) are PyTorch's distributed checkpoint,
verified before use (common/checkpoint/); the data position is in samples, so a checkpoint of any layout on
N ranks continues under any layout on M. At the end: a short generated sample.

Run it (CPU ranks; the same commands on GPUs with accelerate_configs/multi_gpu_ddp.yaml):
    python experiments/train_gpt.py                                     # one process: the reference
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy fsdp
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml experiments/train_gpt.py   # DeepSpeed
    torchrun --nproc_per_node 4 experiments/train_gpt.py --dp_shard 2 --tp 2        # 2-D: FSDP x TP
    torchrun --nproc_per_node 8 experiments/train_gpt.py --dp_shard 2 --tp 2 --pp 2 # 3-D (slow on 2 cores)
    torchrun --nproc_per_node 4 experiments/train_gpt.py --pp 2 --cp 2 --pp_schedule zbv
    torchrun --nproc_per_node 3 experiments/train_gpt.py --strategy fsdp --d_model 96   # 3 uneven shards
Many nodes: `accelerate launch --num_machines N --machine_rank R --main_process_ip HOST ...` or torchrun's
--nnodes (SLURM: one srun task per node), the same flags. Every layout side by side: python -m
benchmarks.compare_strategies. Where a step's time goes: --profile_steps 5; against this machine's peak:
python -m benchmarks.performance
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("train_gpt.py")

import torch

from common.checkpoint import ResumableArgs
from common.config import flag, parse_config, require, require_positive, run_cli
from common.data import iterate_sample_stream, padded_share, shard_rows
from common.device import planned_device_type
from common.gpt import (
    PER_RANK_BATCH_SIZE,
    ModelFlags,
    adamw,
    count_parameters,
    require_trainable,
    sample_text,
)
from common.hf_model import HFModelFlags, build_model, ours_from_hf
from common.moe import active_parameter_count
from common.optim import cosine_lr
from common.profiling import StepProfiler, report_profile
from common.run import start_run
from common.runtime import launched_world_size
from common.text import load_corpus, require_vocabulary
from common.training import TrainLoop
from common.weights import read_weights, refuse_other_model, refuse_unfit
from strategies.args import ParallelArgs
from strategies.checks import CheckArgs, Probe, check_layout
from strategies.layout import DIMS, Layout, Workload
from strategies.parallelize import parallelize, quiet

EXPERIMENT = "train_gpt"
# Tokens per evaluation forward (at least a training micro-batch): the mean over every validation token is the
# same in any batches, and fewer, larger forwards pay each layout's per-forward collectives (tp's all-reduces,
# fsdp's all-gathers) less often: a tiny tp run took 13.0 s evaluating 4 rows at a time, 7.9 s at 64 (measured).
EVAL_TOKENS = 4096


@dataclass
class Config(ResumableArgs, HFModelFlags, ModelFlags, ParallelArgs, CheckArgs):
    sweep_metrics = ("loss", "tokens_per_s", "val_loss")
    # Checkpoints are DCP (any layout reads any other's) and the data position is in samples: a resume may change
    # the layout and the world size. The global batch (samples per step) is part of the run; how it is made
    # (per-rank rows x accumulation x data-parallel ranks) is the layout's, and a resume may remake it.
    reshardable = True
    layout_flags = (*ParallelArgs.layout_flags, "per_rank_batch_size", "gradient_accumulation_steps")
    # --text_files is known by its content (the corpus's and its tokenizer's sha256, in every checkpoint)
    # how, not what: the checkpointing recomputes the same forward, --expert_matmul runs the same experts' GEMMs
    # (a checkpoint from before the flag existed resumes: it was refused, naming the missing flag)
    result_neutral = (*ResumableArgs.result_neutral, *CheckArgs.tolerances, "parity_steps", "parity_steps_bf16",
                      "min_loss_drop", "sample_tokens", "profile_steps", "text_files", "activation_checkpointing",
                      "expert_matmul")  # fmt: skip

    text_files: str = flag("", "comma-separated text files to train on (default: CPython's pydoc topics)")
    init_from: str = flag("", "a .safetensors file of full weights (tools.convert_checkpoint to-safetensors; with "
                          "--hf_config also transformers' save_pretrained model.safetensors) to start this new run "
                          "from: fine-tuning, with a fresh optimizer at step 0 (a resumed run continues from its "
                          "checkpoint instead)")  # fmt: skip
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
    mixed_precision: str = flag("", "no or bf16 (Accelerate's autocast; FSDP2's MixedPrecisionPolicy under "
                                "--dp_shard); unset: the launch config's (multi_gpu_ddp.yaml: bf16), else no",
                                choices=("", "no", "bf16"))  # fmt: skip
    sample_tokens: int = flag(40, "tokens of text generated at the end (0: none)")
    profile_steps: int = flag(0, "torch.profiler traces this many steps (0: off) after the one-time work (the first 3 "
                              "steps and the --parity_steps snapshot) and one warm-up step: <output_dir>/profile/"
                              "rank<r>.json (ui.perfetto.dev), each step split into compute / communication / "
                              "overlapped / idle, and profile/timeline.png")  # fmt: skip

    def validate(self) -> None:
        super().validate()
        # unset: what `accelerate launch` was told (its config's mixed_precision reaches every rank as
        # ACCELERATE_MIXED_PRECISION), resolved here so the layout's theory, the tolerances and config.json agree
        if not self.mixed_precision:
            launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
            require(launched in ("no", "bf16"), f"mixed_precision {launched} (the launch config's): train_gpt "
                    "trains in no or bf16; set mixed_precision: bf16 in the config or pass --mixed_precision")  # fmt: skip
            self.mixed_precision = launched
        require_positive(self, "per_rank_batch_size", "gradient_accumulation_steps", "lr", *self.tolerances)
        self.refuse_model(self.model_config())
        require(0 < self.val_fraction < 0.5, f"--val_fraction must be in (0, 0.5), got {self.val_fraction}")
        non_negative = min(self.warmup_steps, self.lr_decay_steps, self.grad_clip, self.weight_decay) >= 0
        require(0 <= self.min_lr_ratio <= 1 and non_negative, "--min_lr_ratio must be in [0, 1]; --warmup_steps, "
                "--lr_decay_steps, --grad_clip, --weight_decay >= 0")  # fmt: skip
        require_vocabulary(self.vocab_size)
        # --init_from readable, its digest verified, trained as this architecture: before anything starts (so a
        # sweep over --init_from refuses a bad file before any trial)
        if self.init_from:
            self.init_weights()
            refuse_other_model(self.init_from, dataclasses.asdict(self), f"--init_from {self.init_from}")
        layout = self.resolve_layout(launched_world_size(self))  # config.json records the degrees that ran
        self.refuse_layout(layout, self.workload(), self.grad_clip)
        require(not self.wrong_variant.startswith("resume_") or self.resume_from_checkpoint,
                f"--wrong_variant {self.wrong_variant} is a mistake made when resuming: add "
                "--resume_from_checkpoint")  # fmt: skip
        most = self.max_steps - self.steps_before_profiling() - 1
        require(self.profile_steps == 0 or 0 < self.profile_steps <= most,
                f"--profile_steps {self.profile_steps}: must be 0 (off) or 1..{most} with --max_steps {self.max_steps}: "
                f"profiling starts after {self.steps_before_profiling()} steps of one-time work (the first 3, the "
                "--parity_steps snapshot) and one warm-up step")  # fmt: skip
        require(0 <= self.budget()["steps"] <= self.max_steps,
                f"--parity_steps{'_bf16' * (self.mixed_precision == 'bf16')} must be in [0, --max_steps], "
                f"got {self.budget()['steps']}")  # fmt: skip
        sizes = " ".join(f"--{n} {getattr(self, n)}" for n in ("d_model", "n_layer", "vocab_size", "block_size",
                                                                "per_rank_batch_size"))  # fmt: skip
        require_trainable(self.model_config(), self.per_rank_batch_size, sizes)

    def init_weights(self) -> tuple[dict, str]:
        """--init_from's tensors under the model's names, and their digest: a file of tools.convert_checkpoint's,
        verified; with --hf_config also transformers' own (save_pretrained's model.safetensors), renamed."""
        weights, digest = read_weights(self.init_from, "--init_from", foreign=bool(self.hf_config))
        return (ours_from_hf(weights) if self.hf_config else weights), digest

    def workload(self, vocab_size: int = 0) -> Workload:
        """What this run asks of its layout (the pieces' theory and refusals need nothing else of it)."""
        return Workload(self.model_config(vocab_size=vocab_size), self.per_rank_batch_size, self.gradient_accumulation_steps,
                        self.mixed_precision, planned_device_type())  # fmt: skip

    def layout(self) -> Layout:
        return Layout(**{dim: max(1, getattr(self, dim)) for dim in DIMS})

    def make_optimizer(self, parameters) -> torch.optim.Optimizer:
        return adamw(parameters, self.lr, self.weight_decay)

    def lr_schedule(self):
        """step -> learning rate: warm-up, then cosine over --lr_decay_steps (0: --max_steps), then flat."""
        return functools.partial(cosine_lr, lr=self.lr, warmup_steps=self.warmup_steps, min_lr_ratio=self.min_lr_ratio,
                                 decay_steps=self.lr_decay_steps or self.max_steps)  # fmt: skip

    def trajectory(self, world_size: int) -> dict:
        """As RunArgs', except that a mistake made only while resuming (resume_*) is not the checkpoint's,
        and the learning-rate schedule's length is the one it runs with (--lr_decay_steps 0 follows
        --max_steps: a resume that grows --max_steps would stretch the schedule mid-run, so it differs)."""
        trajectory = super().trajectory(world_size)
        if self.wrong_variant.startswith("resume_"):
            trajectory["wrong_variant"] = ""
        trajectory["lr_decay_steps"] = self.lr_decay_steps or self.max_steps
        trajectory["global_batch_size"] = self.global_batch_size()
        return trajectory

    def global_batch_size(self) -> int:
        """Samples per optimizer step: per-rank rows x accumulation x data-parallel ranks (x the launches that share
        it: a fault-tolerant run's replica groups)."""
        launches = self.plan(self.layout(), self.workload()).launches
        return self.per_rank_batch_size * self.gradient_accumulation_steps * self.layout().dp * launches

    def resume_hint(self, difference: str) -> str:
        """Said after a refused resume's difference, where the fix is not obvious."""
        if difference.startswith("global_batch_size"):
            saved, rows = int(difference.split()[1]), self.per_rank_batch_size * self.layout().dp
            keep = f"; --gradient_accumulation_steps {saved // rows} keeps it" if saved % rows == 0 else ""
            return (f" (--per_rank_batch_size {self.per_rank_batch_size} x --gradient_accumulation_steps "
                    f"{self.gradient_accumulation_steps} x {self.layout().dp} data-parallel rank(s){keep})")  # fmt: skip
        if difference.startswith("--lr_decay_steps"):
            return (" (the cosine schedule's length, which --max_steps sets while --lr_decay_steps is 0; to train "
                    f"longer on the checkpoint's schedule pass --lr_decay_steps {difference.split()[1]})")  # fmt: skip
        return ""

    def steps_before_profiling(self) -> int:
        """Steps of one-time work, left out of --profile_steps: the first 3 (after the evaluation FSDP2's root
        stays gathered; DDP rebuilds its buckets in the 2nd: its 3rd is counted) and the --parity_steps snapshot."""
        return max(3, self.budget()["steps"])

    def budget(self) -> dict:
        """The parity steps and tolerances of this run's precision."""
        return self.parity(bf16=self.mixed_precision == "bf16")


def run(cfg: Config) -> int:
    layout, work, budget, variant = cfg.layout(), cfg.workload(), cfg.budget(), cfg.wrong_variant
    lr_at = cfg.lr_schedule()
    # The corpus first, before the run starts: its content hashes tie every checkpoint to this data (a resume on
    # other text is refused before anything is written). The token cache is built once, under a file lock.
    corpus = load_corpus(cfg.text_files, cfg.vocab_size, cfg.block_size, cfg.val_fraction, cfg.dist_timeout_s)
    model_cfg = dataclasses.replace(
        work.model, vocab_size=corpus["vocab_size"]
    )  # what the tokenizer really has
    work = dataclasses.replace(work, model=model_cfg)
    # exported weights to start from, verified and fitted to this model before anything is written
    init_weights, init_digest = cfg.init_weights() if cfg.init_from else ({}, "")
    if init_weights:
        with torch.device("meta"):
            refuse_unfit(init_weights, build_model(model_cfg, 0).state_dict(), f"--init_from {cfg.init_from}")
    with (
        start_run(cfg, EXPERIMENT, data_identity=corpus["identity"], gradient_accumulation_steps=work.micro_batches,
                  mixed_precision="no" if layout.shard_dims else cfg.mixed_precision) as session,  # FSDP2: its policy
        quiet(),  # what the parallelism says that is expected
    ):  # fmt: skip
        accelerator, rank = session.accelerator, session.accelerator.process_index

        # The data: one stream of samples; each data-parallel rank takes its rows of every global micro-batch
        # (4 blocks per rank x 2 data-parallel ranks = 8 blocks of 64 tokens); the tp, cp and pp ranks of a
        # data-parallel rank read the same rows. The position is in samples, so a resume at another world size
        # continues at the same place.
        skipped = session.samples_seen if variant == "resume_without_data_position" else 0
        data_rank = 0 if variant == "same_data_on_every_rank" else layout.dp_rank(rank)
        global_rows = cfg.per_rank_batch_size * layout.dp

        def batch_at(position: int, micro_batches: int) -> list:
            """A step's global micro-batches from sample `position` of the stream, this rank's rows of each."""
            stream = iterate_sample_stream(*corpus["train"], global_rows, cfg.seed, position - skipped)
            return [shard_rows(next(stream), data_rank, layout.dp) for _ in range(micro_batches)]

        # every validation row counts, on any layout: a data-parallel rank's share, padded to the others' size with
        # rows that score nothing (the loss is a property of the weights, not of the layout)
        val_rows = padded_share(corpus["val"], layout.dp_rank(rank), layout.dp)
        # the one-process reference replays the same global batches, from where the data stream really was
        replayed = functools.partial(
            iterate_sample_stream, *corpus["train"], global_rows, cfg.seed, session.samples_seen
        )

        # The model: the same initial weights on every rank and in the reference (unless seed_per_rank); then the
        # layout decides who holds what (strategies/parallelize.py), and AdamW steps on whatever each rank holds.
        gpt = build_model(model_cfg, cfg.seed + rank * (variant == "seed_per_rank"))
        # a new run from exported weights (a resume starts from its checkpoint's)
        if init_weights and not session.checkpoint:
            gpt.load_state_dict(init_weights)
            session.metrics["init_from"] = {"path": cfg.init_from, "weights_sha256": init_digest}
        initial_state, n_parameters = copy.deepcopy(gpt.state_dict()), count_parameters(gpt)
        job = parallelize(gpt, layout, cfg, work, accelerator, cfg.make_optimizer, cfg.grad_clip)
        checkpointer = job.checkpointer(restore_optimizer=variant != "resume_without_optimizer_state")
        # what the checks need, reported by the job as it runs: bytes held, losses and norms, the parity snapshot,
        # the collectives of one steady step (strategies/checks.py)
        probe = Probe(job, session.start_step, budget["steps"], cfg.max_steps)
        # tokens/s is the steady state's: the first steps, the parity snapshot and any profiled steps are left out
        one_time_steps = max(3, budget["steps"]) + (1 + cfg.profile_steps if cfg.profile_steps else 0)
        loop = TrainLoop(
            session,
            job.model,
            job.optimizer,
            global_rows,
            checkpointer,
            tokens_per_sample=cfg.block_size,
            one_time_steps=one_time_steps,
        )  # fmt: skip (it resumes the checkpoint, if any)
        eval_rows = max(cfg.per_rank_batch_size, EVAL_TOKENS // cfg.block_size)
        val_loss_before = job.evaluate_rows(val_rows, eval_rows)  # after any resume
        active = active_parameter_count(model_cfg, n_parameters)
        used = f" ({active:,} active a token)" if active < n_parameters else ""
        session.print(f"{n_parameters:,} parameters{used}, {corpus['tokens']:,} tokens of {corpus['name']}, {cfg.strategy}: "
                      f"{layout.describe()}, validation loss {val_loss_before:.3f}")  # fmt: skip

        profiler = StepProfiler(cfg.profile_steps, os.path.join(session.output_dir, "profile"), rank,
                                accelerator.device.type, max(3, budget["steps"]))  # fmt: skip
        with profiler:
            # the job owns a step: its micro-batches (Accelerate's accumulate()), the clipping, AdamW
            # (a fault-tolerant replica group: its share of each step, a step redone when a peer died in it)
            step_batch = functools.partial(batch_at, micro_batches=job.units_per_step)
            for micro_batches in loop.steps(step_batch, job.units_per_step, begin_step=job.begin_step):
                lr = lr_at(loop.step + 1)
                result = job.train_step(micro_batches, lr, local_only=variant == "local_grad_norm")
                loop.record_step(
                    result.losses, result.committed, lr=lr, grad_norm=result.grad_norm, **result.figures
                )
                if result.committed:
                    profiler.step()
        if cfg.profile_steps:
            report_profile(session, profiler.breakdown(), f"{layout.describe()}: each rank's median profiled step",
                           f"--profile_steps {cfg.profile_steps}: nothing profiled; this run trained too few steps")  # fmt: skip

        # The checks: the experiment's own (the loss falls), then the layout's (strategies/checks.py): every rank's
        # bytes held and sent against the composed theory, and the first steps against one process
        val_loss = job.evaluate_rows(val_rows, eval_rows)
        job.report(session)  # what the pieces measure beyond the checks (a pipeline's bubble, cp's balance)
        # from where THIS run started: the initialisation, or a checkpoint that has learned (it must only fall)
        start = ("the loaded checkpoint" if session.checkpoint else "the initial weights of --init_from" if init_weights
                 else "the initialisation")  # fmt: skip
        # from trained weights (a checkpoint's, --init_from's) the loss need only fall
        min_drop = 0.0 if session.checkpoint or init_weights else cfg.min_loss_drop
        session.check("loss_decreased", val_loss < val_loss_before - min_drop,
                      f"validation loss {val_loss_before:.3f} -> {val_loss:.3f} (from {start}), must fall by more "
                      f"than {min_drop}")  # fmt: skip
        replay = lambda: dict(start_state=loop.resumed_full_state or (initial_state, None), global_batches=replayed(),  # noqa: E731
                              lr_at=lr_at, make_optimizer=cfg.make_optimizer, max_norm=cfg.grad_clip,
                              accumulation=job.units_per_step, bf16=cfg.mixed_precision == "bf16",
                              exact_shares=layout.dp if job.exact else 0)  # fmt: skip
        check_layout(session, job, probe, model_cfg, budget, cfg.memory_rtol, replay)
        final_state = checkpointer.full_state()  # every tensor whole, on the main process (a collective)
        corpus_facts = {
            k: corpus[k]
            for k in ("name", "sha256", "characters", "tokens", "characters_per_token", "vocab_size")
        }
        session.metrics.update(loop.metrics(final_state), val_loss_before=val_loss_before, val_loss=val_loss,
                               parameters=n_parameters, corpus=corpus_facts,
                               active_parameters=active)  # fmt: skip
        if session.is_main:
            prompt = corpus["val"][0][0][:8]  # the start of the validation text
            session.metrics["sample"] = sample_text(build_model(model_cfg, cfg.seed), final_state[0], corpus["tokenizer"], prompt,
                                                    cfg.sample_tokens, cfg.seed, accelerator.device)  # fmt: skip
            session.print(f"sample: {session.metrics['sample']!r}")
        session.log(loop.step, {**loop.last_interval, "val_loss": val_loss})
    return session.exit_code


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
