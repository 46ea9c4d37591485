"""train_gpt: a small GPT on real text, by DDP or by sharded data parallelism (ZeRO-2 / ZeRO-3 with
FSDP2). Does each train exactly what one process would, and hold what the theory says it holds?

The model is common/gpt.py (nanoGPT-style, 4 layers of d_model 128 by default, ~1M parameters); the
text is CPython's own reference prose (pydoc topics) or --text_files, tokenized by a BPE trained here
(common/text.py). AdamW, warmup + cosine learning rate (stepped once per optimizer step), gradient
clipping by the GLOBAL norm, optional bf16. --strategy:
  none   one process: the reference, and the baseline;
  ddp    Accelerate's prepare: every rank holds everything, gradients all-reduced (averaged);
  zero2  FSDP2 `fully_shard(reshard_after_forward=False)`: gradients reduce-scattered, optimizer
         state and parameters sharded at rest, each block's full parameters kept from forward to
         backward (ZeRO-2's memory: full parameters while computing, sharded gradients + optimizer);
  fsdp   FSDP2 `fully_shard` (ZeRO-3): each block's parameters all-gathered just before use and
         freed right after, in forward and again in backward.
Why PyTorch's fully_shard and not Accelerate's FSDP plugin: Accelerate 1.16 cannot do FSDP on CPU;
it silently falls back to DDP (measured). fully_shard on a DeviceMesh of the accelerator's device
type (gloo on CPU, NCCL on GPU) runs inside the process group Accelerate made: one code path.

Checks (each with a wrong variant, --wrong_variant, that fails it):
- matches_single_process  over the first --parity_steps steps (bf16: --parity_steps_bf16), the loss at every step and every
                          parameter after them equal a one-process run on the same global batches
                          (--loss_atol, --param_atol); same_data_on_every_rank (the forgotten
                          sampler) fails it. Why not over all steps: AdamW at this learning rate
                          amplifies float rounding (sums in another order) about 10x every few
                          steps (measured, README); equality is judged where it still means something;
- grad_norm_is_global     the norm clipping uses equals the one-process gradient norm at each of
                          those steps; local_grad_norm (each rank clips by its own shard) fails it;
- memory_per_rank         bytes of parameters, gradients and optimizer state each rank holds at rest,
                          and of parameters between forward and backward, equal the theory within
                          --memory_rtol; unwrapped_root (fully_shard on the blocks only) fails it;
- loss_decreased          validation loss falls by at least --min_loss_drop.
At the end the main process prints a short sample of generated text (also in summary.json).

Run it (2 CPU ranks; the same commands on GPUs with accelerate_configs/multi_gpu_ddp.yaml):
    python experiments/train_gpt.py                                     # --strategy none, 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy ddp
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy zero2
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/train_gpt.py --strategy fsdp
    torchrun --nproc_per_node 3 experiments/train_gpt.py --strategy fsdp --d_model 96   # 3 uneven shards
"""

from __future__ import annotations

import copy
import math
import os
import resource
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common.config import flag, parse_config, require, require_positive, run_cli
from common.data import concatenate_rank_batches, iterate_batches
from common.gpt import GPT, GPTConfig, build_gpt, count_parameters
from common.reliability import ResumableArgs
from common.run import start_run
from common.runtime import launched_world_size
from common.sharding import shard_gpt, sync_gradients_this_micro_batch
from common.text import load_corpus, shard_rows
from common.training import TrainLoop

EXPERIMENT = "train_gpt"
STRATEGIES = ("none", "ddp", "zero2", "fsdp")
WRONG_VARIANTS = ("", "same_data_on_every_rank", "local_grad_norm", "unwrapped_root")


@dataclass
class Config(ResumableArgs):
    sweep_metrics = ("loss", "tokens_per_s", "val_loss")
    # How close a check wants its figures; they change no result, so a resume may change them.
    tolerances = ("loss_atol", "param_atol", "grad_norm_rtol", "loss_atol_bf16", "param_atol_bf16", "grad_norm_rtol_bf16",
                  "memory_rtol")  # fmt: skip
    result_neutral = (*ResumableArgs.result_neutral, *tolerances, "parity_steps", "parity_steps_bf16", "min_loss_drop",
                      "sample_tokens")  # fmt: skip

    strategy: str = flag(
        "none", "none (one process), ddp, zero2 or fsdp (see the docstring)", choices=STRATEGIES
    )
    text_files: str = flag(
        "", "comma-separated text files to train on (default: CPython's pydoc topics, ~465k characters)"
    )
    vocab_size: int = flag(2048, "BPE vocabulary trained on the corpus")
    block_size: int = flag(64, "context length in tokens")
    n_layer: int = flag(4, "transformer blocks")
    n_head: int = flag(4, "attention heads (must divide d_model)")
    d_model: int = flag(128, "model width")
    tie_weights: bool = flag(True, "share the token embedding with the output head")
    val_fraction: float = flag(0.1, "share of the token stream held out for validation")
    per_rank_batch_size: int = flag(
        4, "blocks per rank per micro-batch; global batch = this x ranks x accumulation"
    )
    gradient_accumulation_steps: int = flag(1, "micro-batches per optimizer step (Accelerate's accumulate())")
    max_steps: int = flag(300, "optimizer steps")
    log_every: int = flag(25, "steps between console lines / metrics.jsonl records")
    lr: float = flag(3e-3, "peak AdamW learning rate")
    min_lr_ratio: float = flag(0.1, "the cosine schedule ends at lr x this")
    warmup_steps: int = flag(20, "linear warm-up steps")
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices (not on biases, norms)")
    grad_clip: float = flag(1.0, "clip gradients to this global norm (0: off)")
    mixed_precision: str = flag(
        "no",
        "no or bf16 (autocast for none/ddp; FSDP2's MixedPrecisionPolicy for zero2/fsdp)",
        choices=("no", "bf16"),
    )
    # Parity with one process, float32: measured ~1e-6 (loss) and ~1e-5 (parameters) over 20 steps.
    parity_steps: int = flag(20, "float32: steps compared with the one-process run (0: none)")
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
    min_loss_drop: float = flag(0.3, "validation loss must fall by at least this (nats)")
    sample_tokens: int = flag(40, "tokens of text generated at the end (0: none)")
    wrong_variant: str = flag(
        "",
        "a deliberate mistake that a check must catch: " + ", ".join(WRONG_VARIANTS[1:]),
        choices=WRONG_VARIANTS,
    )

    def validate(self) -> None:
        super().validate()
        require_positive(
            self,
            "vocab_size",
            "block_size",
            "n_layer",
            "n_head",
            "d_model",
            "per_rank_batch_size",
            "gradient_accumulation_steps",
            "lr",
            *self.tolerances,
        )
        require(
            self.d_model % self.n_head == 0, f"--n_head {self.n_head} must divide --d_model {self.d_model}"
        )
        require(0 < self.val_fraction < 0.5, f"--val_fraction must be in (0, 0.5), got {self.val_fraction}")
        require(
            0 <= self.min_lr_ratio <= 1
            and self.warmup_steps >= 0
            and self.grad_clip >= 0
            and self.weight_decay >= 0,
            "--min_lr_ratio must be in [0, 1]; --warmup_steps, --grad_clip, --weight_decay >= 0",
        )
        require(
            self.vocab_size >= 260, f"--vocab_size must be >= 260 (256 bytes + merges), got {self.vocab_size}"
        )
        world_size = launched_world_size(self)
        require(
            (self.strategy == "none") == (world_size == 1),
            f"--strategy {self.strategy} with {world_size} rank(s): 'none' is one process, the others need >= 2 ranks "
            "(accelerate_configs/cpu_ddp.yaml)",
        )
        require(
            not (
                self.strategy in ("zero2", "fsdp") and (self.checkpoint_every or self.resume_from_checkpoint)
            ),
            "--checkpoint_every / --resume_from_checkpoint: sharded checkpoints (torch.distributed.checkpoint) are not "
            "built yet; use --strategy ddp or none to checkpoint",
        )
        require(
            not self.wrong_variant or self.strategy != "none",
            "--wrong_variant needs a distributed --strategy",
        )
        require(
            0 <= self.parity()["steps"] <= self.max_steps,
            f"--parity_steps{'_bf16' * (self.mixed_precision == 'bf16')} must be in [0, --max_steps], "
            f"got {self.parity()['steps']}",
        )

    def parity(self) -> dict:
        """How many steps are compared with one process, and within what, for this run's precision."""
        suffix = "_bf16" if self.mixed_precision == "bf16" else ""
        return {
            name: getattr(self, f"{flag_name}{suffix}")
            for name, flag_name in (
                ("steps", "parity_steps"),
                ("loss_atol", "loss_atol"),
                ("param_atol", "param_atol"),
                ("grad_norm_rtol", "grad_norm_rtol"),
            )
        }


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to --lr, then cosine down to lr x min_lr_ratio at max_steps (step counts from 1)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW as nanoGPT sets it up: weight decay on matrices and embeddings, none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def distribute(model: GPT, cfg: Config, accelerator) -> torch.nn.Module:
    """The strategy. none: one process. ddp: Accelerate's prepare. zero2/fsdp: FSDP2 (common/sharding.py)."""
    if cfg.strategy in ("none", "ddp"):
        return model.to(accelerator.device) if cfg.strategy == "none" else accelerator.prepare(model)
    return shard_gpt(
        model,
        accelerator,
        zero3=cfg.strategy == "fsdp",
        bf16=cfg.mixed_precision == "bf16",
        wrap_root=cfg.wrong_variant != "unwrapped_root",
    )


def clip_by_global_norm(model: torch.nn.Module, max_norm: float, local_only: bool = False) -> float:
    """Clip to the norm of the WHOLE gradient. Sharded gradients (DTensors) hold 1/N of it on each rank:
    their squared sums are all-reduced before the square root. Replicated ones (DDP, or parameters
    outside any shard) are the same on every rank and count once. `local_only` is the classic mistake."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    replicated = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for grad in grads:
        if isinstance(grad, DTensor):
            sharded += grad.to_local().float().pow(2).sum()
        else:
            replicated += grad.float().pow(2).sum()
    if dist.is_initialized() and not local_only and any(isinstance(g, DTensor) for g in grads):
        dist.all_reduce(sharded)
    norm = (sharded + replicated).sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
    return norm.item()


def bytes_held(model: torch.nn.Module, optimizer=None) -> dict:
    """Bytes this rank really holds (a DTensor's local shard, not its global size)."""

    def local(tensor) -> int:
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return tensor.numel() * tensor.element_size()

    unique = {id(p): p for p in model.parameters()}.values()
    held = {
        "params": sum(local(p) for p in unique),
        "grads": sum(local(p.grad) for p in unique if p.grad is not None),
    }
    if optimizer is not None:
        held["optimizer"] = sum(
            local(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )
    return held


def expected_bytes(reference: GPT, cfg: Config, rank: int, world_size: int) -> dict:
    """The theory, per rank. Replicated (none, ddp): every byte everywhere. Sharded (FSDP2): each tensor
    split on dim 0 as torch.chunk does, rank r holding chunk r (128 rows on 3 ranks: 43, 43, 42).
    AdamW keeps exp_avg and exp_avg_sq shaped like the parameter, plus a 4-byte step count per tensor.
    Between forward and backward: DDP and ZeRO-2 hold every parameter; ZeRO-3 holds the blocks' shards
    and the root's parameters in full (FSDP2 does not reshard the root after forward: its backward
    comes at once). Under bf16, FSDP2 gathers parameters as bf16 copies (2 bytes); DDP's autocast
    keeps float32 parameters and casts per operation."""
    unique = {id(p): (name, p) for name, p in reference.named_parameters()}.values()
    sharded = cfg.strategy in ("zero2", "fsdp")

    def size(param: torch.Tensor, is_sharded: bool) -> int:
        if not is_sharded:
            return param.numel() * param.element_size()
        rows = torch.chunk(torch.empty(param.shape[0], device="meta"), world_size)
        return (rows[rank].shape[0] if rank < len(rows) else 0) * param[0].numel() * param.element_size()

    params = sum(size(p, sharded) for _, p in unique)
    gathered_bytes = 2 if sharded and cfg.mixed_precision == "bf16" else 4  # per element, once all-gathered
    window = 0
    for name, param in unique:
        stays_sharded = cfg.strategy == "fsdp" and name.startswith("blocks.")
        window += (
            size(param, True)
            if stays_sharded
            else param.numel() * (gathered_bytes if sharded else param.element_size())
        )
    return {
        "params": params,
        "grads": params,
        "optimizer": 2 * params + 4 * len(unique),
        "params_between_forward_and_backward": window,
    }


def evaluate(
    model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor], batch_size: int, accelerator
) -> float:
    """Mean validation loss over every rank's shard (the shards are equal, so every rank runs the same
    number of forwards: FSDP all-gathers in each)."""
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


def full_state(model: torch.nn.Module, accelerator) -> dict:
    """Every parameter in full on the main process (a collective: every rank calls it). Sharded
    parameters are all-gathered; DDP's are already full."""
    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        return {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train_reference(
    cfg: Config, gpt_cfg: GPTConfig, initial_state: dict, global_batches, accelerator
) -> dict:
    """The same training in ONE process, for --parity_steps steps: each step one batch holding every
    rank's micro-batches (the global batch), one mean loss over all its tokens, the same AdamW,
    schedule and clipping."""
    model = GPT(gpt_cfg).to(accelerator.device)
    model.load_state_dict(initial_state)
    optimizer = make_optimizer(model, cfg)
    losses, norms = [], []
    for step in range(1, cfg.parity()["steps"] + 1):
        micro_batches = [next(global_batches) for _ in range(cfg.gradient_accumulation_steps)]
        x, y = (torch.cat(parts).to(accelerator.device) for parts in zip(*micro_batches, strict=True))
        with torch.autocast(
            accelerator.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16"
        ):
            _, loss = model(x, y)
        loss.backward()
        norms.append(clip_by_global_norm(model, cfg.grad_clip))
        set_lr(optimizer, lr_at(step, cfg))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {"losses": losses, "grad_norms": norms, "state": state}


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def run(cfg: Config) -> int:
    precision = cfg.mixed_precision if cfg.strategy in ("none", "ddp") else "no"  # zero2/fsdp: FSDP2's policy
    with start_run(
        cfg,
        EXPERIMENT,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=precision,
    ) as run:
        accelerator = run.accelerator
        rank, world_size = accelerator.process_index, accelerator.num_processes
        with accelerator.main_process_first():  # the tokenizer is trained once, then read from the cache
            corpus = load_corpus(cfg.text_files, cfg.vocab_size, cfg.block_size, cfg.val_fraction)
        gpt_cfg = GPTConfig(
            corpus["vocab_size"], cfg.block_size, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.tie_weights
        )
        train_shards = [shard_rows(corpus["train"], r, world_size) for r in range(world_size)]
        data_rank = 0 if cfg.wrong_variant == "same_data_on_every_rank" else rank  # the forgotten sampler
        batches = iterate_batches(
            *train_shards[data_rank],
            cfg.per_rank_batch_size,
            cfg.seed,
            start_batch=run.start_step * cfg.gradient_accumulation_steps,
        )
        val_shard = shard_rows(corpus["val"], rank, world_size)

        model = build_gpt(gpt_cfg, cfg.seed)  # the same initial weights on every rank and in the reference
        initial_state = copy.deepcopy(model.state_dict())
        n_parameters = count_parameters(model)
        model = distribute(model, cfg, accelerator)
        optimizer = accelerator.prepare(make_optimizer(model, cfg))  # steps only on a step's last micro-batch
        val_loss_before = evaluate(model, val_shard, cfg.per_rank_batch_size, accelerator)
        run.print(
            f"{n_parameters:,} parameters, {corpus['tokens']:,} tokens of {corpus['name']}, {cfg.strategy} "
            f"on {world_size} rank(s), validation loss {val_loss_before:.3f}"
        )

        # The idea: each rank trains on its own shard of the data; the strategy decides who holds what.
        tokens_per_micro_batch = cfg.per_rank_batch_size * cfg.block_size * world_size
        loop = TrainLoop(run, model, optimizer, global_micro_batch_size=tokens_per_micro_batch, unit="tokens")
        # bytes held, per-step loss and grad norm, the state at --parity_steps
        probe = Probe(cfg, accelerator)
        for x, y in loop.micro_batches(batches):
            # Accelerate's accumulate(): DDP's no_sync and loss / k on all but the last micro-batch of a step
            with accelerator.accumulate(model):
                sync_gradients_this_micro_batch(model, accelerator.sync_gradients)  # FSDP2's no_sync
                _, loss = model(x, y)
                probe.after_forward(model)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    probe.grad_norms.append(
                        clip_by_global_norm(model, cfg.grad_clip, cfg.wrong_variant == "local_grad_norm")
                    )
                    set_lr(optimizer, lr_at(loop.step + 1, cfg))
                optimizer.step()
                probe.after_step(model, optimizer, loss, loop.step + 1)
                optimizer.zero_grad()
            loop.record(loss, **probe.latest(optimizer))

        val_loss = evaluate(model, val_shard, cfg.per_rank_batch_size, accelerator)
        step_losses = accelerator.reduce(
            torch.stack(probe.step_losses), "mean"
        ).tolist()  # each step's global loss
        trained = full_state(model, accelerator)
        every_rank = accelerator.gather_for_metrics(
            [probe.held | {"peak_rss_bytes": peak_rss_bytes()}], use_gather_object=True
        )
        corpus_facts = {
            k: corpus[k]
            for k in ("name", "sha256", "characters", "tokens", "characters_per_token", "vocab_size")
        }
        run.metrics.update(
            loop.metrics(),
            val_loss_before=val_loss_before,
            val_loss=val_loss,
            step_losses=step_losses,
            grad_norms=probe.grad_norms,
            bytes_per_rank=every_rank,
            parameters=n_parameters,
            corpus=corpus_facts,
        )
        run.check(
            "loss_decreased",
            val_loss <= val_loss_before - cfg.min_loss_drop,
            f"validation loss {val_loss_before:.3f} -> {val_loss:.3f}, must fall by >= {cfg.min_loss_drop}",
        )
        if run.is_main:
            check_memory(run, cfg, build_gpt(gpt_cfg, cfg.seed), every_rank)
            if cfg.strategy != "none" and probe.at_parity_step is not None and run.start_step == 0:
                compare_with_one_process(
                    run,
                    cfg,
                    gpt_cfg,
                    initial_state,
                    train_shards,
                    probe.at_parity_step,
                    step_losses,
                    probe.grad_norms,
                )
            run.metrics["sample"] = generate_sample(cfg, gpt_cfg, trained, corpus, accelerator.device)
            run.print(f"sample: {run.metrics['sample']!r}")
        run.log(loop.step, {**loop.last_interval, "val_loss": val_loss})
    return run.exit_code


class Probe:
    """What the checks need from inside the loop, one call per place: the bytes this rank holds between
    forward and backward and at rest (first step), each step's loss and gradient norm, and the full
    state right after step --parity_steps (a collective for sharded models: every rank takes it)."""

    def __init__(self, cfg: Config, accelerator):
        self.cfg, self.accelerator = cfg, accelerator
        self.held: dict = {}
        self.step_losses, self.grad_norms, self.at_parity_step = [], [], None
        self.step_loss = torch.zeros((), device=accelerator.device)

    def latest(self, optimizer) -> dict:
        """The learning rate and gradient norm of the last optimizer step, for the logged interval."""
        return (
            {"lr": optimizer.param_groups[0]["lr"], "grad_norm": self.grad_norms[-1]}
            if self.grad_norms
            else {}
        )

    def after_forward(self, model) -> None:
        if not self.held:
            self.held["params_between_forward_and_backward"] = bytes_held(model)["params"]

    def after_step(self, model, optimizer, loss: torch.Tensor, step: int) -> None:
        self.step_loss += loss.detach() / self.cfg.gradient_accumulation_steps
        if not self.accelerator.sync_gradients:
            return
        if "params" not in self.held:
            self.held.update(bytes_held(model, optimizer))
        self.step_losses.append(self.step_loss.clone())
        self.step_loss.zero_()
        if step == self.cfg.parity()["steps"]:
            self.at_parity_step = full_state(model, self.accelerator)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def check_memory(run, cfg: Config, reference: GPT, every_rank: list[dict]) -> None:
    """Each rank's held bytes against expected_bytes, within --memory_rtol."""
    theories = [expected_bytes(reference, cfg, rank, len(every_rank)) for rank in range(len(every_rank))]
    worst = max(
        abs(held[kind] - theory[kind]) / theory[kind]
        for held, theory in zip(every_rank, theories, strict=True)
        for kind in theory
    )
    lines = [
        f"rank {rank}: " + ", ".join(f"{kind} {held[kind]:,}/{theory[kind]:,}" for kind in theory)
        for rank, (held, theory) in enumerate(zip(every_rank, theories, strict=True))
    ]
    run.metrics["bytes_theory"] = theories
    run.check(
        "memory_per_rank",
        worst <= cfg.memory_rtol,
        f"held/theory bytes: {'; '.join(lines)}; worst relative "
        f"difference {worst:.4f}, tolerance {cfg.memory_rtol}",
    )


def compare_with_one_process(
    run, cfg, gpt_cfg, initial_state, train_shards, at_parity_step, step_losses, grad_norms
) -> None:
    """The first --parity_steps steps against the same steps in one process."""
    global_batches = concatenate_rank_batches(train_shards, cfg.per_rank_batch_size, cfg.seed)
    reference = train_reference(cfg, gpt_cfg, initial_state, global_batches, run.accelerator)
    budget = cfg.parity()
    n = budget["steps"]
    loss_diff = max(abs(a - b) for a, b in zip(step_losses[:n], reference["losses"], strict=True))
    norm_diff = max(
        abs(a - b) / max(b, 1e-12) for a, b in zip(grad_norms[:n], reference["grad_norms"], strict=True)
    )
    param_diff = max(
        (at_parity_step[k].float() - reference["state"][k].float()).abs().max().item()
        for k in reference["state"]
    )
    run.metrics.update(
        loss_max_abs_diff=loss_diff,
        grad_norm_max_rel_diff=norm_diff,
        param_max_abs_diff=param_diff,
        reference_losses=reference["losses"],
    )
    run.parity_check(
        "matches_single_process",
        max(loss_diff / budget["loss_atol"], param_diff / budget["param_atol"]),
        1.0,
        f"over the first {n} steps: max |loss - one process| {loss_diff:.2e} (tolerance {budget['loss_atol']:.0e}), "
        f"max |parameter - one process| after them {param_diff:.2e} (tolerance {budget['param_atol']:.0e}); "
        "the larger share of its tolerance",
    )
    run.parity_check(
        "grad_norm_is_global",
        norm_diff,
        budget["grad_norm_rtol"],
        f"max relative |norm clipped by - one process's gradient norm| over the first {n} steps",
    )


def generate_sample(cfg: Config, gpt_cfg: GPTConfig, state: dict, corpus: dict, device) -> str:
    """A few tokens from the trained model, prompted with the start of the validation text."""
    if not cfg.sample_tokens:
        return ""
    model = GPT(gpt_cfg).to(device)
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
