"""pipeline_parallel: the model cut into stages on different ranks, fed with micro-batches.

model_parallel splits a model over devices in ONE process, so only one device works at a time. A
pipeline puts each stage in its own process (rank) and cuts the batch into m micro-batches: while
stage 1 computes micro-batch 1, stage 0 already computes micro-batch 2. Ranks idle only while the
pipeline fills and drains: the "bubble", (p-1)/(m+p-1) of the time for p stages under GPipe.

This uses `torch.distributed.pipelining` as its docs show: the MLP (fc1..fcN) is cut into
world_size contiguous stages, one `PipelineStage` per rank, run by `ScheduleGPipe` (all forwards,
then all backwards) or `Schedule1F1B` (one forward, one backward, alternating: fewer live
activations), --schedule. The loss is the mean over each micro-batch and the schedule divides
gradients by m (scale_grads), so a step equals one full-batch step.

Checks: the pipeline's loss at every step equals the single-process full model's on the same batch,
and the gradients of step 1 and the parameters after --max_steps equal the full model's (each rank
replays the same batches through the whole model in one process, common/reference.py, and compares the
layers of its own stage; float32, --parity_atol). Then, for each m in --bubble_microbatches, it times each
stage's forward and backward blocks and reports the measured bubble beside GPipe's theory; timeline.png
draws stage x time.
--skip_gradient_scaling reproduces a classic mistake (summing micro-batch gradients) the checks catch.

Run it (>= 2 ranks, one stage each; p = world size):
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/pipeline_parallel.py
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/pipeline_parallel.py \\
        --schedule 1f1b --n_microbatches 8
    torchrun --nproc_per_node 4 experiments/pipeline_parallel.py --n_layers 8        # 4 stages
    accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml experiments/pipeline_parallel.py  # one GPU per stage
"""

from __future__ import annotations

import os
import statistics
import sys
import warnings
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("pipeline_parallel.py")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from common.config import TrainArgs, UsageError, flag, parse_config, require, require_positive, run_cli
from common.data import iterate_batches, make_regression_dataset, shard_tensors
from common.device import device_time
from common.models import build_mlp
from common.profiling import plot_timeline
from common.reference import max_abs_difference, train_single_process
from common.run import start_run
from common.runtime import launched_world_size

EXPERIMENT = "pipeline_parallel"
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass
class Config(TrainArgs):
    schedule: str = flag(
        "gpipe", "pipeline schedule: gpipe (all F then all B) or 1f1b (alternating)", choices=tuple(SCHEDULES)
    )
    n_microbatches: int = flag(4, "micro-batches per step (the batch must split evenly)")
    n_layers: int = flag(4, "Linear layers fc1..fcN, cut into world_size contiguous stages")
    hidden_features: int = flag(
        512, "hidden width: large enough that compute, not messaging, dominates a stage"
    )
    n_features: int = flag(10, "input features")
    n_samples: int = flag(4096, "rows of synthetic regression data")
    batch_size: int = flag(512, "rows per step (split into micro-batches)")
    lr: float = flag(0.01, "SGD learning rate")
    max_steps: int = flag(10, "training steps checked against the full model")
    log_every: int = flag(5, "steps between console lines")
    bubble_microbatches: str = flag(
        "1,2,4,8", "comma-separated m values for the bubble measurement ('' to skip)"
    )
    bubble_steps: int = flag(3, "timed steps per m (median bubble reported)")
    skip_gradient_scaling: bool = flag(
        False, "a classic mistake: sum micro-batch gradients instead of averaging (scale_grads=False)"
    )
    parity_atol: float = flag(
        1e-5,
        "largest allowed |pipeline - full model| difference in loss, gradient or parameter, float32 (> 0)",
    )

    def validate(self) -> None:
        super().validate()
        require_positive(
            self,
            "n_microbatches",
            "n_layers",
            "hidden_features",
            "n_features",
            "n_samples",
            "batch_size",
            "bubble_steps",
        )
        require(self.lr > 0 and self.parity_atol > 0, "--lr and --parity_atol must be > 0")
        for m in [self.n_microbatches, *self.bubble_values()]:
            require(
                self.batch_size % m == 0,
                f"--batch_size {self.batch_size} must split evenly into {m} micro-batches",
            )
        # Refused now, before any output or tracker run exists: the launch's world size is the stage count.
        n_stages = launched_world_size(self)
        require(
            n_stages >= 2 and self.n_layers >= n_stages,
            f"a pipeline needs >= 2 ranks and >= 1 layer per rank: {n_stages} ranks, --n_layers {self.n_layers}; "
            "launch with accelerate_configs/cpu_ddp.yaml",
        )
        require(
            self.schedule != "1f1b" or self.n_microbatches >= n_stages,
            f"--schedule 1f1b needs --n_microbatches >= the {n_stages} stages, got {self.n_microbatches}",
        )

    def bubble_values(self) -> list[int]:
        try:
            values = [int(v) for v in self.bubble_microbatches.split(",") if v.strip()]
        except ValueError:
            raise UsageError(
                f"--bubble_microbatches {self.bubble_microbatches!r}: expected whole numbers like 1,2,4,8"
            ) from None
        require(
            all(v > 0 for v in values),
            f"--bubble_microbatches {self.bubble_microbatches!r}: values must be > 0",
        )
        return values


class Stage(nn.Module):
    """A contiguous run of the MLP's layers; ReLU after each, except after the model's final layer."""

    def __init__(self, layers: list[nn.Linear], ends_model: bool):
        super().__init__()
        self.layers, self.ends_model = nn.ModuleList(layers), ends_model

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if not (self.ends_model and index == len(self.layers) - 1):
                x = torch.relu(x)
        return x


def cut_stage(model, rank: int, n_stages: int) -> tuple[Stage, list[str]]:
    """Layers [rank*L/p, (rank+1)*L/p) of the full model: stage `rank` of `n_stages`."""
    names = model.layer_names
    bounds = [round(i * len(names) / n_stages) for i in range(n_stages + 1)]
    mine = names[bounds[rank] : bounds[rank + 1]]
    return Stage([getattr(model, n) for n in mine], ends_model=rank == n_stages - 1), mine


class BlockTimer:
    """Per-stage forward/backward blocks, each stage on its own clock from the step's start (`start()`: the ranks
    leave a barrier together; two hosts' clocks are never compared): forward hooks time forward; backward runs from
    the backward pre-hook to the last parameter gradient of the stage (the last thing it computes). The times wait
    for the device (common/device.device_time): on a GPU a hook runs when the kernels are launched, not done."""

    def __init__(self, stage_module: nn.Module, device):
        self.blocks, self.origin = [], 0.0
        now = lambda: device_time(device) - self.origin  # noqa: E731
        stage_module.register_forward_pre_hook(lambda *_: self.blocks.append(["F", now(), None]))
        stage_module.register_forward_hook(lambda *_: self.blocks[-1].__setitem__(2, now()))
        stage_module.register_full_backward_pre_hook(lambda *_: self.blocks.append(["B", now(), now()]))
        for param in stage_module.parameters():
            param.register_post_accumulate_grad_hook(lambda _p: self.blocks[-1].__setitem__(2, now()))
        self.now = now

    def start(self) -> None:
        """A new step: no blocks yet, its clock at 0."""
        self.blocks.clear()
        self.origin = 0.0
        self.origin = self.now()


def run_step(schedule, rank: int, n_stages: int, x, y):
    """One pipeline step: rank 0 feeds inputs, the last rank gets targets and per-micro-batch losses."""
    losses = []
    if rank == 0:
        schedule.step(x)
    elif rank == n_stages - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return torch.stack(losses).mean().item() if losses else None


def reduce_max(value: float, device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def run(cfg: Config) -> int:
    # Stage 0's input needs no gradient, so torch warns that its backward hook fires on outputs: expected here.
    with start_run(cfg, EXPERIMENT) as session, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        rank, n_stages, device = (
            session.accelerator.process_index,
            session.accelerator.num_processes,
            session.accelerator.device,
        )
        pipeline_model = build_mlp(
            cfg.n_features, cfg.hidden_features, 1, seed=cfg.seed, n_layers=cfg.n_layers
        ).to(device)
        stage_module, my_layers = cut_stage(pipeline_model, rank, n_stages)
        session.print(
            f"{n_stages} stages of {cfg.n_layers} layers; "
            f"rank 0 holds {my_layers}; {cfg.schedule}, m = {cfg.n_microbatches}"
        )

        def make_schedule(m: int):
            stage = PipelineStage(stage_module, stage_index=rank, num_stages=n_stages, device=device)
            return SCHEDULES[cfg.schedule](
                stage, n_microbatches=m, loss_fn=F.mse_loss, scale_grads=not cfg.skip_gradient_scaling
            )

        dataset, _ = make_regression_dataset(cfg.n_samples, cfg.n_features, 0.1, cfg.seed)
        # every rank sees the same full batches
        x_all, y_all = (t.to(device) for t in shard_tensors(dataset, 0, 1))
        batches = iterate_batches(x_all, y_all, cfg.batch_size, cfg.seed)
        schedule = make_schedule(cfg.n_microbatches)
        optimizer = torch.optim.SGD(stage_module.parameters(), lr=cfg.lr)
        pipeline_losses, first_gradients = [], {}
        for step in range(1, cfg.max_steps + 1):
            pipeline_loss = run_step(schedule, rank, n_stages, *next(batches))
            pipeline_losses.append(pipeline_loss)  # None except on the last stage
            if step == 1:
                first_gradients = {n: getattr(pipeline_model, n).weight.grad.clone() for n in my_layers}
            optimizer.step()
            optimizer.zero_grad()
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                session.log(step, {"pipeline_loss": pipeline_loss} if pipeline_loss is not None else {})

        # The reference (common/reference.py): the whole model, the same batches, one process; each rank
        # trains its own copy and compares the layers of its stage.
        full_model = build_mlp(cfg.n_features, cfg.hidden_features, 1, seed=cfg.seed, n_layers=cfg.n_layers)
        reference = train_single_process(
            full_model,
            torch.optim.SGD(full_model.parameters(), lr=cfg.lr),
            iterate_batches(x_all, y_all, cfg.batch_size, cfg.seed),
            cfg.max_steps,
            device=device,
        )
        loss_diff = max(
            (abs(a - b) for a, b in zip(pipeline_losses, reference["losses"], strict=True) if a is not None),
            default=0.0,
        )
        grad_diff = max_abs_difference(
            first_gradients, {n: reference["first_gradients"][f"{n}.weight"] for n in my_layers}
        )
        mine = {f"{n}.{p}": t for n in my_layers for p, t in getattr(pipeline_model, n).named_parameters()}
        param_diff = max_abs_difference(
            mine, {name: dict(full_model.named_parameters())[name] for name in mine}
        )
        loss_diff, grad_diff, param_diff = (reduce_max(v, device) for v in (loss_diff, grad_diff, param_diff))
        session.parity_check(
            "loss_matches_full_model",
            loss_diff,
            cfg.parity_atol,
            "max |pipeline - full model| loss at every step",
        )
        session.parity_check(
            "gradients_match_full_model",
            grad_diff,
            cfg.parity_atol,
            "max |pipeline - full model| weight gradients of step 1",
        )
        session.parity_check(
            "parameters_match_full_model",
            param_diff,
            cfg.parity_atol,
            f"max |pipeline - full model| parameters after {cfg.max_steps} steps",
        )

        bubbles, timeline = measure_bubbles(
            cfg, make_schedule, stage_module, batches, rank, n_stages, session
        )
        session.metrics.update(
            stages=n_stages,
            schedule=cfg.schedule,
            loss_max_abs_diff=loss_diff,
            grad_max_abs_diff=grad_diff,
            param_max_abs_diff=param_diff,
            bubbles=bubbles,
        )
        if session.is_main and timeline:
            session.metrics["timeline_png"] = draw_timeline(timeline, cfg, n_stages, session.output_dir)
        session.log_table("bubble", bubbles, session.metrics.get("timeline_png"))
    return session.exit_code


def measure_bubbles(cfg: Config, make_schedule, stage_module, batches, rank: int, n_stages: int, session):
    """For each m: warm up once, then time bubble_steps steps; bubble = 1 - mean stage busy time / makespan."""
    timer = BlockTimer(stage_module, session.accelerator.device)
    rows, timeline = [], None
    if session.is_main and cfg.bubble_values():
        session.print(f"{'m':>4}{'measured bubble':>17}{'GPipe theory':>14}{'step ms':>10}")
    for m in cfg.bubble_values():
        if cfg.schedule == "1f1b" and m < n_stages:
            session.print(f"{m:>4}  skipped: 1f1b needs m >= {n_stages} stages")
            continue
        schedule = make_schedule(m)
        run_step(schedule, rank, n_stages, *next(batches))  # warm-up: shape inference, buffers
        fractions, step_ms = [], []
        for _ in range(cfg.bubble_steps):
            x, y = next(batches)
            dist.barrier()
            timer.start()  # each rank's times from here: the barrier lines the ranks up, on any host
            run_step(schedule, rank, n_stages, x, y)
            every_stage = [None] * n_stages
            dist.all_gather_object(every_stage, timer.blocks)
            start = min(b[1] for blocks in every_stage for b in blocks)
            makespan = max(b[2] for blocks in every_stage for b in blocks) - start
            busy = [sum(b[2] - b[1] for b in blocks) for blocks in every_stage]
            fractions.append(1 - statistics.mean(busy) / makespan)
            step_ms.append(1e3 * makespan)
            if m == cfg.n_microbatches or timeline is None:
                timeline = [[(kind, s - start, e - start) for kind, s, e in blocks] for blocks in every_stage]
        theory = (n_stages - 1) / (m + n_stages - 1)
        row = {
            "m": m,
            "measured_bubble": statistics.median(fractions),
            "gpipe_theory": theory,
            "step_ms": statistics.median(step_ms),
            # what the timer saw in the last step: m forward and m backward blocks per stage, each of some length
            "blocks_per_stage": [
                {kind: sum(b[0] == kind for b in blocks) for kind in "FB"} for blocks in every_stage
            ],
            "shortest_block_us": 1e6 * min(b[2] - b[1] for blocks in every_stage for b in blocks),
        }
        rows.append(row)
        session.print(f"{m:>4}{row['measured_bubble']:>17.3f}{theory:>14.3f}{row['step_ms']:>10.1f}")
    return rows, timeline


def draw_timeline(timeline, cfg: Config, n_stages: int, output_dir: str) -> str:
    """stage x time: each stage's forward and backward blocks of one step (common/profiling.plot_timeline)."""
    lanes = [
        (
            f"stage {stage}",
            {
                kind: [(1e3 * s, 1e3 * e) for k, s, e in blocks if k == kind[0].upper()]
                for kind in ("forward", "backward")
            },
        )
        for stage, blocks in enumerate(timeline)
    ]
    path = os.path.join(output_dir, "timeline.png")
    title = f"{cfg.schedule}: one step, m = {cfg.n_microbatches} micro-batches"
    plot_timeline(
        lanes, {"forward": "tab:blue", "backward": "tab:orange"}, title, path, xlabel="time in step (ms)"
    )
    return path


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
