"""loss_normalization: with padded sequences, must the loss be averaged over tokens, not micro-batches?

The GPT workload (common/gpt.py, common/text.py) with variable-length sequences: each sequence keeps
a random number of real tokens (--min_length .. --block_size) and the rest are padding, ignored by
the loss (target -100). So micro-batches and ranks hold different numbers of real tokens.

  naive           each micro-batch's loss is the MEAN over its own real tokens; DDP / FSDP average
                  over ranks, Accelerate's accumulate() over micro-batches. A token in a short
                  micro-batch then weighs more than one in a long one: the gradient is NOT the
                  gradient of the mean loss over the global batch (the 2024 gradient-accumulation
                  bug of Hugging Face transformers, `num_items_in_batch`).
  token_weighted  each rank sums its token losses and scales by world_size x k / global_tokens, where
                  global_tokens (all ranks, all k micro-batches of the step) is all-reduced once per
                  step: the framework's / world_size and / k then leave sum / global_tokens, exactly
                  the global mean.
  reference       ONE process, one batch holding every rank's micro-batches, the mean over all its
                  real tokens.

Checks (SGD, so that equality is exact up to float rounding; AdamW would amplify that rounding):
- token_weighted_matches_one_process: step-1 gradients and parameters after --max_steps within
  --parity_atol of the reference;
- naive_differs_from_one_process: the naive step-1 gradients differ by more than --naive_margin:
  the experiment proves the bug exists, with its size.
Gloo specifics measured here: torchtitan sets FSDP2's gradient divide factor to 1 and scales the loss
itself (`set_gradient_divide_factor(1.0)`), which on gloo fails ("Cannot use ReduceOp.PREMUL_SUM with
Gloo"); so FSDP2's own averaging is kept and the loss is scaled by world_size to undo it. And since
pytorch/pytorch#162338 ("Incorrect AVG reduction for GLOO") is open, the fsdp token_weighted check
is also the test that FSDP2's averaging over gloo is right in our pinned torch.

Run it (2 or 3 CPU ranks):
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/loss_normalization.py
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/loss_normalization.py --strategy fsdp
    torchrun --nproc_per_node 3 experiments/loss_normalization.py --gradient_accumulation_steps 4
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("loss_normalization.py")

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from common.config import RunArgs, flag, parse_config, require, require_positive, run_cli
from common.data import concatenate_rank_batches, iterate_batches, on_device, shard_rows
from common.gpt import GPTConfig, build_gpt
from common.reference import max_abs_difference, train_single_process
from common.run import start_run
from common.runtime import launched_world_size
from common.text import load_corpus, require_vocabulary
from strategies.args import ParallelArgs
from strategies.layout import Layout, Workload
from strategies.parallelize import parallelize
from strategies.shard import set_gradient_sync

EXPERIMENT = "loss_normalization"
PAD = -100  # F.cross_entropy's ignore_index


@dataclass
class Config(RunArgs):
    strategy: str = flag(
        "ddp", "ddp (Accelerate's prepare) or fsdp (FSDP2 fully_shard, ZeRO-3)", choices=("ddp", "fsdp")
    )
    gradient_accumulation_steps: int = flag(2, "micro-batches per optimizer step (k)")
    per_rank_batch_size: int = flag(4, "sequences per rank per micro-batch")
    block_size: int = flag(32, "sequence length, padding included")
    min_length: int = flag(2, "fewest real tokens a sequence keeps (uniform in min_length..block_size)")
    max_steps: int = flag(5, "SGD steps")
    lr: float = flag(0.5, "SGD learning rate")
    d_model: int = flag(32, "model width")
    n_layer: int = flag(2, "transformer blocks")
    n_head: int = flag(2, "attention heads")
    vocab_size: int = flag(512, "BPE vocabulary")
    parity_atol: float = flag(
        1e-5, "largest allowed |token_weighted - one process| gradient or parameter (float32)"
    )
    naive_margin: float = flag(
        1e-4, "naive's step-1 gradient must differ from one process's by more than this"
    )

    def validate(self) -> None:
        super().validate()
        require_positive(self, "gradient_accumulation_steps", "per_rank_batch_size", "block_size", "max_steps", "lr",
                         "d_model", "n_layer", "n_head", "parity_atol", "naive_margin")  # fmt: skip
        require(
            1 <= self.min_length <= self.block_size,
            f"--min_length must be in [1, --block_size], got {self.min_length}",
        )
        require(
            self.d_model % self.n_head == 0, f"--n_head {self.n_head} must divide --d_model {self.d_model}"
        )
        require_vocabulary(self.vocab_size)
        require(
            launched_world_size(self) * self.gradient_accumulation_steps >= 2,
            "one rank and one micro-batch average nothing: launch >= 2 ranks or pass --gradient_accumulation_steps >= 2",
        )


def pad_randomly(
    x: torch.Tensor, y: torch.Tensor, min_length: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i keeps its first L_i targets (L_i uniform in min_length..T); the rest become padding."""
    lengths = torch.randint(
        min_length, x.shape[1] + 1, (len(x),), generator=torch.Generator().manual_seed(seed)
    )
    padded = y.clone()
    padded[torch.arange(x.shape[1]) >= lengths[:, None]] = PAD
    return x, padded


def token_losses(model, x: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD, reduction=reduction)


def train(cfg: Config, variant: str, gpt_cfg: GPTConfig, batches, accelerator) -> tuple[dict, dict]:
    """--max_steps SGD steps of `variant`; returns (step-1 gradients, final parameters), both in full."""
    model = build_gpt(gpt_cfg, cfg.seed)
    # ZeRO-3 over every rank (--dp_shard N), or replicas (--dp_replicate N: Accelerate's DDP): train_gpt's pieces
    degrees = {"dp_shard" if cfg.strategy == "fsdp" else "dp_replicate": accelerator.num_processes}
    work = Workload(gpt_cfg, cfg.per_rank_batch_size)
    job = parallelize(model, Layout(**degrees), ParallelArgs(), work, accelerator,
                      lambda parameters: torch.optim.SGD(parameters, lr=cfg.lr), max_norm=0.0)  # fmt: skip
    model, optimizer = job.model, job.optimizer
    world, k = accelerator.num_processes, cfg.gradient_accumulation_steps
    first_gradients = {}
    for step in range(cfg.max_steps):
        # the host's rows to the run's device: the token count is all-reduced (NCCL takes device tensors only)
        micro_batches = [on_device(next(batches), accelerator.device) for _ in range(k)]
        # token_weighted: count the step's real tokens on every rank, once, before any backward
        local_tokens = sum((y != PAD).sum() for _, y in micro_batches).float()
        global_tokens = accelerator.reduce(local_tokens, "sum")
        for x, y in micro_batches:
            with accelerator.accumulate(model):  # / k on the loss, DDP's no_sync on all but the last
                set_gradient_sync(model, accelerator.sync_gradients)  # FSDP2's no_sync
                if variant == "naive":
                    loss = token_losses(model, x, y, "mean")  # the mean over THIS micro-batch's tokens
                else:  # sum / global count, times what the framework divides by (world_size, then k)
                    loss = token_losses(model, x, y, "sum") * world * k / global_tokens
                accelerator.backward(loss)
                if accelerator.sync_gradients and step == 0:
                    first_gradients = full_tensors(
                        {n: p.grad for n, p in named_parameters(model, accelerator)}
                    )
                optimizer.step()
                optimizer.zero_grad()
    return first_gradients, full_tensors(dict(named_parameters(model, accelerator)))


def named_parameters(model, accelerator):
    return accelerator.unwrap_model(model).named_parameters()


def full_tensors(tensors: dict) -> dict:
    """Every tensor in full on every rank (a DTensor shard is all-gathered: every rank calls this)."""
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
        for n, t in tensors.items()
    }


def train_reference(cfg: Config, gpt_cfg: GPTConfig, global_batches, device) -> tuple[dict, dict]:
    """One process (common/reference.py): each step ONE batch of every rank's k micro-batches, the mean over
    all its real tokens."""
    model = build_gpt(gpt_cfg, cfg.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    reference = train_single_process(model, optimizer, global_batches, cfg.max_steps, cfg.gradient_accumulation_steps,
                                     loss_fn=lambda m, x, y: token_losses(m, x, y, "mean"), device=device)  # fmt: skip
    return reference["first_gradients"], dict(model.named_parameters())


def run(cfg: Config) -> int:
    corpus = load_corpus(
        "", cfg.vocab_size, cfg.block_size, 0.1, cfg.dist_timeout_s
    )  # built once, under a lock
    # float32 whatever the launch config says (multi_gpu_ddp.yaml's bf16): the parity is exact up to float32
    # rounding only, and the reference trains in float32
    with start_run(cfg, EXPERIMENT, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                   mixed_precision="no") as session:  # fmt: skip
        accelerator = session.accelerator
        rank, world = accelerator.process_index, accelerator.num_processes
        gpt_cfg = GPTConfig(corpus["vocab_size"], cfg.block_size, cfg.n_layer, cfg.n_head, cfg.d_model)
        blocks = pad_randomly(*corpus["train"], cfg.min_length, cfg.seed)
        shards = [shard_rows(blocks, r, world) for r in range(world)]

        results = {}
        for variant in ("naive", "token_weighted"):  # from the same initial weights, on the same batches
            batches = iterate_batches(*shards[rank], cfg.per_rank_batch_size, cfg.seed)
            results[variant] = train(cfg, variant, gpt_cfg, batches, accelerator)
        first_micro_batches = [
            next(iterate_batches(*shard, cfg.per_rank_batch_size, cfg.seed)) for shard in shards
        ]
        tokens = [int((y != PAD).sum()) for _, y in first_micro_batches]
        if session.is_main:
            global_batches = concatenate_rank_batches(shards, cfg.per_rank_batch_size, cfg.seed)
            reference = train_reference(cfg, gpt_cfg, global_batches, accelerator.device)
            figures = {variant: {"step1_gradient_max_abs_diff": max_abs_difference(grads, reference[0]),
                                 "parameter_max_abs_diff": max_abs_difference(params, reference[1])}
                       for variant, (grads, params) in results.items()}  # fmt: skip
            session.metrics.update(figures, real_tokens_in_first_micro_batch_per_rank=tokens)
            weighted = figures["token_weighted"]
            session.parity_check("token_weighted_matches_one_process", max(weighted.values()), cfg.parity_atol,
                             f"{cfg.strategy}, {world} ranks x {cfg.gradient_accumulation_steps} micro-batches: "
                             "max |token_weighted - one process| over step-1 gradients and final parameters")  # fmt: skip
            naive = figures["naive"]["step1_gradient_max_abs_diff"]
            session.check("naive_differs_from_one_process", naive > cfg.naive_margin,
                      f"max |naive - one process| step-1 gradient = {naive:.2e}, must exceed {cfg.naive_margin:.0e} "
                      f"(real tokens in the first micro-batch per rank: {tokens})")  # fmt: skip
            for variant, figure in figures.items():
                session.print(f"{variant:<15} step-1 gradient {figure['step1_gradient_max_abs_diff']:.2e}, parameters after "
                          f"{cfg.max_steps} steps {figure['parameter_max_abs_diff']:.2e} from one process")  # fmt: skip
    return session.exit_code


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
