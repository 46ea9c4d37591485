"""manual_data_parallel: what does DDP actually do? Data parallelism by hand, proven equal to DDP.

The collectives tutorial this project corrects (docs/tutorials.md) hand-rolls data parallelism and gets
it wrong: it all-reduces a *list* of parameter copies,
sums gradients without dividing by the number of ranks (so the step is world_size times too large),
and calls that "moving parameters to workers". Done right, data parallelism is three moves:
  1. start equal: broadcast rank 0's initial parameters once (here every rank deliberately
     initialises from seed + rank, so skipping the broadcast would show);
  2. after backward, make every rank's gradient the MEAN over ranks: all_reduce(SUM) / world_size;
  3. step: every rank applies the same update, so the replicas stay equal forever.
This experiment uses raw torch.distributed on purpose (it is about the API); only `ddp` uses
Accelerate's prepared (DDP) model. Same model and data as ddp_linear (common/). --strategy:
  per_param   one all_reduce per parameter tensor: simplest, most collectives;
  bucketed    gradients flattened into buckets of <= --bucket_mb, one all_reduce per bucket
              (what DDP's buckets do: fewer, larger messages);
  overlapped  an async all_reduce launched from each parameter's grad hook DURING backward, all
              waited for before the step (what DDP does to hide communication behind compute);
  ddp         Accelerate's DDP, the reference; a comm hook counts its all_reduces and bytes;
  all         every strategy from the same init on the same batches, compared.
With --gradient_accumulation_steps k > 1 every strategy syncs only on the last micro-batch of a step
(DDP's no_sync), and is still equal. Checks: each hand-rolled strategy ends with the same parameters
as `ddp` and as a single-process replay of the global batches (float32, tolerance --parity_atol), and
issues the collectives it should per step. --average_gradients false reproduces the tutorial's bug
(on >= 2 ranks: with one rank, a sum over ranks IS the mean).

Run it:
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/manual_data_parallel.py
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/manual_data_parallel.py \\
        --model mlp --hidden_features 512 --bucket_mb 0.5
    torchrun --nproc_per_node 2 experiments/manual_data_parallel.py --strategy bucketed
    accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml experiments/manual_data_parallel.py   # NCCL
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("manual_data_parallel.py")

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import RunArgs, flag, parse_config, require_positive, run_cli
from common.data import iterate_batches, iterate_global_batches, make_regression_dataset, shard_tensors
from common.device import device_time
from common.models import build_linear, build_mlp
from common.reference import max_abs_difference, train_single_process
from common.run import start_run

EXPERIMENT = "manual_data_parallel"
STRATEGIES = ("ddp", "per_param", "bucketed", "overlapped")  # ddp first: the others are compared with it


@dataclass
class Config(RunArgs):
    strategy: str = flag(
        "all",
        "per_param, bucketed, overlapped, ddp, or all (each from the same init, compared)",
        choices=(*STRATEGIES, "all"),
    )
    model: str = flag(
        "linear",
        "linear: the tutorial's nn.Linear(10, 1); mlp: fc1 -> ReLU -> fc2 (more, larger gradients)",
        choices=("linear", "mlp"),
    )
    hidden_features: int = flag(50, "width of the mlp's hidden layer (the tutorial's 50)")
    bucket_mb: float = flag(
        25.0, "largest gradient bucket in MiB for `bucketed` (DDP's default bucket_cap_mb is 25)"
    )
    n_samples: int = flag(1000, "rows of synthetic data")
    n_features: int = flag(10, "input features")
    noise_std: float = flag(0.1, "noise on y = X·w* + b*")
    per_rank_batch_size: int = flag(32, "rows per rank per micro-batch")
    gradient_accumulation_steps: int = flag(1, "micro-batches per optimizer step; syncs only on the last one")
    lr: float = flag(0.1, "SGD learning rate")
    max_steps: int = flag(100, "optimizer steps per strategy")
    average_gradients: bool = flag(
        True,
        "divide the all-reduced gradient sum by world size (false = the tutorial's bug; needs >= 2 ranks to show)",
    )
    parity_atol: float = flag(
        1e-5, "largest allowed |strategy - reference| parameter difference in float32 (> 0)"
    )

    def validate(self) -> None:
        super().validate()
        require_positive(
            self,
            "max_steps",
            "hidden_features",
            "n_samples",
            "n_features",
            "per_rank_batch_size",
            "gradient_accumulation_steps",
            "bucket_mb",
            "lr",
            "parity_atol",
        )


def build_model(cfg: Config, seed: int) -> torch.nn.Module:
    if cfg.model == "linear":
        return build_linear(cfg.n_features, seed=seed)
    return build_mlp(cfg.n_features, cfg.hidden_features, 1, seed=seed)


class GradientSync:
    """The hand-rolled part of data parallelism: make every rank's .grad the mean over ranks.
    Counts the collectives it issues and the bytes they carry (both per optimizer step)."""

    def __init__(self, model: torch.nn.Module, strategy: str, bucket_mb: float, average: bool):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.strategy, self.average, self.world_size = strategy, average, dist.get_world_size()
        self.collectives, self.bytes, self.pending = 0, 0, []
        self.sync_this_micro_batch = True
        self.buckets = self.make_buckets(bucket_mb)
        if strategy == "overlapped":
            for param in self.params:
                param.register_post_accumulate_grad_hook(self.launch_during_backward)

    def make_buckets(self, bucket_mb: float) -> list[list[torch.nn.Parameter]]:
        """Consecutive parameters, in reverse order (the order backward produces their grads), up to bucket_mb."""
        buckets, current, current_bytes = [], [], 0
        for param in reversed(self.params):
            size = param.numel() * param.element_size()
            if current and current_bytes + size > bucket_mb * 2**20:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(param)
            current_bytes += size
        return buckets + [current] if current else buckets

    def launch_during_backward(self, param: torch.nn.Parameter) -> None:
        """Grad hook (overlapped): this param's gradient is final, start its all_reduce without waiting."""
        if self.sync_this_micro_batch:
            self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))
            self.count(param.grad)

    def count(self, tensor: torch.Tensor) -> None:
        self.collectives += 1
        self.bytes += tensor.numel() * tensor.element_size()

    def finish(self) -> None:
        """After the last backward of a step, before optimizer.step()."""
        if self.strategy == "overlapped":
            for _, work in self.pending:
                work.wait()
            self.pending.clear()
        elif self.strategy == "per_param":
            for param in self.params:
                dist.all_reduce(param.grad)  # one tensor, SUM, in place
                self.count(param.grad)
        else:  # bucketed: one flat buffer per bucket, one all_reduce, copied back
            for bucket in self.buckets:
                flat = torch.cat([p.grad.reshape(-1) for p in bucket])
                dist.all_reduce(flat)
                self.count(flat)
                for param, synced in zip(bucket, torch.split(flat, [p.numel() for p in bucket]), strict=True):
                    param.grad.copy_(synced.view_as(param.grad))
        if self.average:
            for param in self.params:
                param.grad.div_(self.world_size)  # SUM / n = mean of per-rank means = global mean


def train_by_hand(cfg: Config, strategy: str, batches, accelerator) -> tuple[torch.nn.Module, dict]:
    rank = dist.get_rank()
    model = build_model(cfg, seed=cfg.seed + rank).to(accelerator.device)  # different on purpose
    for param in model.parameters():
        dist.broadcast(param.data, src=0)  # move 1: every replica starts as rank 0's
    sync = GradientSync(model, strategy, cfg.bucket_mb, cfg.average_gradients)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    step_times = []
    device = accelerator.device
    for _ in range(cfg.max_steps):
        start = device_time(device)  # after the device's queued work: a step's time, on a GPU too
        for micro in range(cfg.gradient_accumulation_steps):
            # no_sync before the last
            sync.sync_this_micro_batch = micro == cfg.gradient_accumulation_steps - 1
            x, y = next(batches)
            # grads add up to the step's mean
            loss = F.mse_loss(model(x), y) / cfg.gradient_accumulation_steps
            loss.backward()
        sync.finish()
        optimizer.step()
        optimizer.zero_grad()
        step_times.append(device_time(device) - start)
    stats = {
        "collectives_per_step": sync.collectives / cfg.max_steps,
        "bytes_per_step": sync.bytes / cfg.max_steps,
        "median_step_ms": 1e3 * statistics.median(step_times),
        "expected_collectives_per_step": len(sync.params) if strategy != "bucketed" else len(sync.buckets),
    }
    return model, stats


def train_with_ddp(cfg: Config, batches, accelerator) -> tuple[torch.nn.Module, dict]:
    """Accelerate's prepared model; a comm hook counts what DDP all-reduces (DDP itself stays in charge)."""
    model = build_model(cfg, seed=cfg.seed)  # rank 0's init; DDP broadcasts it to every rank anyway
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    counted = {"collectives": 0, "bytes": 0, "inside_no_sync": 0}
    if accelerator.num_processes > 1:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_allreduce_hook(state, bucket):
            counted["collectives"] += 1
            counted["inside_no_sync"] += not accelerator.sync_gradients  # must stay 0: no_sync skips the hook
            counted["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(state, bucket)  # DDP's own default: all_reduce(bucket / world_size)

        model.register_comm_hook(state=None, hook=counting_allreduce_hook)
    step_times, start = [], device_time(accelerator.device)
    while len(step_times) < cfg.max_steps:
        x, y = next(batches)
        with accelerator.accumulate(model):  # DDP's no_sync() on every micro-batch but the last
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            now = device_time(accelerator.device)
            step_times.append(now - start)
            start = now
    stats = {
        "collectives_per_step": counted["collectives"] / cfg.max_steps,
        "bytes_per_step": counted["bytes"] / cfg.max_steps,
        "median_step_ms": 1e3 * statistics.median(step_times),
        "all_reduces_inside_no_sync": counted["inside_no_sync"],
    }
    return accelerator.unwrap_model(model), stats


def run(cfg: Config) -> int:
    # needs_process_group: in one process, a 1-rank gloo group, so the hand-rolled collectives still run
    # float32 whatever the launch config says (multi_gpu_ddp.yaml's bf16): Accelerate would autocast only the
    # prepared DDP model, and the hand-rolled replicas and the reference train in float32
    with start_run(cfg, EXPERIMENT, needs_process_group=True, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                   mixed_precision="no") as session:  # fmt: skip
        accelerator = session.accelerator
        dataset, _ = make_regression_dataset(cfg.n_samples, cfg.n_features, cfg.noise_std, cfg.seed)
        rank, world_size = accelerator.process_index, accelerator.num_processes
        shard_x, shard_y = (t.to(accelerator.device) for t in shard_tensors(dataset, rank, world_size))
        strategies = STRATEGIES if cfg.strategy == "all" else (cfg.strategy,)
        trained, stats = {}, {}
        for strategy in strategies:
            # same batches for each
            batches = iterate_batches(shard_x, shard_y, cfg.per_rank_batch_size, cfg.seed)
            if strategy == "ddp":
                trained[strategy], stats[strategy] = train_with_ddp(cfg, batches, accelerator)
            else:
                trained[strategy], stats[strategy] = train_by_hand(cfg, strategy, batches, accelerator)
        session.log_table("strategies", [{"strategy": name, **figures} for name, figures in stats.items()])
        if session.is_main:
            compare_with_references(cfg, session, dataset, trained, stats)
        session.metrics.update(strategies=stats, world_size=world_size)
    return session.exit_code


def compare_with_references(cfg: Config, session, dataset, trained: dict, stats: dict) -> None:
    """Each strategy against a one-process replay of the global batches, and against DDP."""
    world_size = session.accelerator.num_processes
    reference = build_model(cfg, seed=cfg.seed)
    global_batches = iterate_global_batches(dataset, world_size, cfg.per_rank_batch_size, cfg.seed)
    optimizer = torch.optim.SGD(reference.parameters(), lr=cfg.lr)
    train_single_process(reference, optimizer, global_batches, cfg.max_steps, cfg.gradient_accumulation_steps,
                         device=session.accelerator.device)  # fmt: skip
    session.print(
        f"{'strategy':<12}{'median ms/step':>15}{'all_reduces/step':>18}{'bytes/step':>12}{'max|Δ| vs 1 proc':>19}"
    )
    for strategy, model in trained.items():
        s = stats[strategy]
        s["diff_vs_single_process"] = max_abs_difference(model, reference)
        session.print(
            f"{strategy:<12}{s['median_step_ms']:>15.3f}{s['collectives_per_step']:>18.1f}{s['bytes_per_step']:>12,.0f}"
            f"{s['diff_vs_single_process']:>19.2e}"
        )
        session.parity_check(
            f"{strategy}_matches_single_process",
            s["diff_vs_single_process"],
            cfg.parity_atol,
            f"max |{strategy} - one process|",
        )
        if "ddp" in trained and strategy != "ddp":
            s["diff_vs_ddp"] = max_abs_difference(model, trained["ddp"])
            session.parity_check(
                f"{strategy}_matches_ddp", s["diff_vs_ddp"], cfg.parity_atol, f"max |{strategy} - ddp|"
            )
        if strategy == "ddp" and world_size > 1:
            session.check(
                "ddp_no_sync_skips_all_reduce",
                s["all_reduces_inside_no_sync"] == 0 and s["collectives_per_step"] > 0,
                f"{s['all_reduces_inside_no_sync']} all_reduces on non-final micro-batches, "
                f"{s['collectives_per_step']:.1f} per step in all",
            )
        if "expected_collectives_per_step" in s:  # only the last micro-batch of a step may communicate
            session.check(
                f"{strategy}_syncs_once_per_step",
                s["collectives_per_step"] == s["expected_collectives_per_step"],
                f"{s['collectives_per_step']:.1f} all_reduces per step, expected {s['expected_collectives_per_step']} "
                f"with {cfg.gradient_accumulation_steps} micro-batches per step",
            )


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
