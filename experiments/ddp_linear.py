"""ddp_linear: does data-parallel training with Accelerate give exactly what one process would?

Seed 001's DDP example, done right. It trains `nn.Linear(10, 1)` with MSE + SGD on synthetic data
y = X·w* + b* + noise (or on your own table, --data_file). Every rank reads its own shard of the data
(per-rank batch 32: with 2 ranks the global batch is 64). DDP averages the ranks' gradients, and the
mean of per-rank mean gradients equals the mean over the global batch when shards are equal, so the run
checks itself:

- distributed            the ranks Accelerate sees are the ranks that were launched (no silent
                         "two processes that both think they are rank 0");
- recovers_truth         learned weight and bias are within --truth_tolerance of w*, b*
                         (of the least-squares fit when the data is a file);
- matches_single_process the same global batches replayed in ONE process from the same initial
                         weights give the same parameters, within --parity_atol (float32 sums in
                         another order differ by ~1e-7 per step; bf16 by ~1e-2);
- loss_decreased         full-data MSE after training is below the MSE at initialisation.

Run it (results in runs/ddp_linear/: summary.json, metrics.jsonl, config.json, W&B offline run):
    accelerate launch experiments/ddp_linear.py                                          # 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/ddp_linear.py   # 2 CPU ranks, gloo
    accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml experiments/ddp_linear.py  # all GPUs, NCCL
    torchrun --nproc_per_node 2 experiments/ddp_linear.py                                # same, plain torchrun
    # many nodes: edit accelerate_configs/multi_node_ddp.yaml (machine_rank, main_process_ip) on each node
    accelerate launch --config_file accelerate_configs/multi_node_ddp.yaml experiments/ddp_linear.py
    # checkpoints, resume and elastic restarts (common/reliability.py; README "When things go wrong")
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 3 \
        experiments/ddp_linear.py --checkpoint_every 100 --resume_from_checkpoint latest
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file from any cwd

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from common.config import flag, parse_config, require, require_positive, run_cli
from common.data import (
    iterate_batches,
    iterate_global_batches,
    load_table,
    make_regression_dataset,
    shard_tensors,
)
from common.models import build_linear
from common.reference import max_abs_difference, train_single_process
from common.reliability import (
    Heartbeat,
    ResumableArgs,
    explain_timeout,
    find_checkpoint,
    inject_fault,
    save_checkpoint,
)
from common.runtime import check_distributed, make_accelerator, prepare_output_dir
from common.tracking import RunRecorder, resolve_trackers

EXPERIMENT = "ddp_linear"
SWEEP_METRICS = ("loss", "samples_per_s", "final_mse", "max_weight_error", "bias_error")  # what a sweep may optimise


@dataclass
class Config(ResumableArgs):
    n_samples: int = flag(1000, "rows of synthetic data (the seed's 1000)")
    n_features: int = flag(10, "input features of synthetic data (the seed's nn.Linear(10, 1))")
    noise_std: float = flag(0.1, "standard deviation of the noise added to y = X·w* + b*")
    data_file: str = flag("", "a local csv/json/jsonl/parquet file to train on instead of synthetic data")
    target_column: str = flag("y", "column of --data_file to predict")
    feature_columns: str = flag("", "comma-separated input columns of --data_file (default: all but the target)")
    per_rank_batch_size: int = flag(32, "rows per rank per micro-batch; global batch = this x ranks x accumulation")
    gradient_accumulation_steps: int = flag(1, "micro-batches per optimizer step (Accelerate's accumulate())")
    lr: float = flag(0.1, "SGD learning rate (the seed's 0.1)")
    mixed_precision: str = flag("", "no/bf16/fp16 (empty: what `accelerate launch` or its config says); bf16 runs on CPU, fp16 needs a GPU", choices=("", "no", "bf16", "fp16"))
    truth_tolerance: float = flag(0.05, "largest allowed |learned - true| of any weight or the bias")
    parity_atol: float = flag(0.0, "largest allowed |DDP - single process| parameter difference (0: 1e-5 for fp32, 5e-2 for bf16/fp16)")

    def validate(self) -> None:
        super().validate()
        require_positive(self, "n_samples", "n_features", "per_rank_batch_size", "gradient_accumulation_steps", "lr")
        require(self.noise_std >= 0, f"--noise_std must be >= 0, got {self.noise_std}")
        require_positive(self, "truth_tolerance")
        require(self.parity_atol >= 0, f"--parity_atol must be >= 0, got {self.parity_atol}")


def load_data(cfg: Config):
    """(dataset, truth): truth is w*, b* for synthetic data, the least-squares fit for a file."""
    if not cfg.data_file:
        return make_regression_dataset(cfg.n_samples, cfg.n_features, cfg.noise_std, cfg.seed)
    dataset = load_table(cfg.data_file, cfg.target_column, cfg.feature_columns)
    x, y = shard_tensors(dataset, 0, 1)
    design = torch.cat([x, torch.ones(len(x), 1)], dim=1).double()
    solution = torch.linalg.lstsq(design, y.double()).solution.squeeze(1)
    return dataset, {"weight": solution[:-1].tolist(), "bias": solution[-1].item(), "source": "least squares"}


def full_data_mse(model, x, y, accelerator) -> float:
    """MSE over the whole dataset: each rank sums its shard, one all-reduce adds the shards up."""
    with torch.no_grad():
        squared_error = F.mse_loss(model(x).float(), y, reduction="sum")
    totals = accelerator.reduce(torch.stack([squared_error, torch.tensor(float(len(x)), device=x.device)]), "sum")
    return (totals[0] / totals[1]).item()


def replay_single_process(cfg: Config, dataset, world_size: int, initial_state: dict, accelerator) -> torch.nn.Linear:
    """The reference: the global batches of the distributed run, in one process, with no DDP
    (32 per rank x 2 ranks x accumulation 1 = 64 rows per step, one mean loss over them)."""
    model = build_linear(initial_state["weight"].shape[1], seed=cfg.seed)
    model.load_state_dict(initial_state)
    global_batches = iterate_global_batches(dataset, world_size, cfg.per_rank_batch_size, cfg.seed)
    return train_single_process(model, global_batches, cfg.max_steps, cfg.gradient_accumulation_steps, cfg.lr,
                                accelerator.device, autocast=accelerator.autocast)


def run(cfg: Config) -> int:
    output_dir = prepare_output_dir(cfg, EXPERIMENT, resuming=bool(cfg.resume_from_checkpoint))
    checkpoint, start_step = find_checkpoint(cfg, output_dir)
    log_with, init_kwargs, tracker_notes = resolve_trackers(cfg.report_to, output_dir)
    accelerator = make_accelerator(
        cfg, output_dir, log_with=log_with,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, mixed_precision=cfg.mixed_precision,
    )
    recorder = RunRecorder(accelerator, EXPERIMENT, cfg, output_dir, init_kwargs, tracker_notes, resume_step=start_step if checkpoint else None)
    checks = {"distributed": check_distributed(accelerator, cfg)}
    if not checks["distributed"]["passed"]:  # training on a broken launch would only waste time
        return recorder.finish({}, checks)

    with accelerator.main_process_first():  # datasets' cache: one rank writes it, the others read it
        dataset, truth = load_data(cfg)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    shard_x, shard_y = (t.to(accelerator.device) for t in shard_tensors(dataset, rank, world_size))
    # A resumed run skips the micro-batches the checkpointed steps consumed: same data order as one long run.
    batches = iterate_batches(shard_x, shard_y, cfg.per_rank_batch_size, cfg.seed, start_batch=start_step * cfg.gradient_accumulation_steps)

    model = build_linear(shard_x.shape[1], seed=cfg.seed)  # same seed on every rank, and DDP broadcasts rank 0's anyway
    initial_state = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    initial_mse = full_data_mse(model, shard_x, shard_y, accelerator)
    if checkpoint:
        accelerator.load_state(checkpoint)  # model, optimizer and every rank's RNG states
        recorder.print(f"resumed from {checkpoint} at step {start_step}")
    heartbeat = Heartbeat(output_dir, rank, world_size)

    global_batch_size = cfg.per_rank_batch_size * world_size * cfg.gradient_accumulation_steps
    progress = tqdm(total=cfg.max_steps, initial=start_step, desc=EXPERIMENT, disable=not accelerator.is_main_process)
    step, window_loss, window_micro_batches = start_step, torch.zeros((), device=accelerator.device), 0
    train_start = window_start = time.perf_counter()
    interval, first_step_unix_time = {}, None
    while step < cfg.max_steps:
        x, y = next(batches)
        if window_micro_batches % cfg.gradient_accumulation_steps == 0:
            heartbeat.entering(step + 1)
        try:
            with accelerator.accumulate(model):  # no all-reduce until the last micro-batch of a step
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        except RuntimeError as error:  # a timed-out collective: say which rank is behind
            raise explain_timeout(error, heartbeat, cfg, step) from None
        window_loss += loss.detach()
        window_micro_batches += 1
        if not accelerator.sync_gradients:
            continue
        step += 1
        first_step_unix_time = first_step_unix_time or time.time()  # benchmarks/startup.py reads it
        progress.update(1)
        heartbeat.finished(step)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            mean_loss = accelerator.reduce(window_loss / window_micro_batches, "mean").item()
            samples = window_micro_batches * cfg.per_rank_batch_size * world_size
            interval = {"loss": mean_loss, "samples_per_s": samples / (time.perf_counter() - window_start)}
            if step < cfg.max_steps:  # the last interval goes out below, with the final figures
                recorder.log(step, interval)
            window_loss.zero_()
            window_micro_batches, window_start = 0, time.perf_counter()
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
            save_checkpoint(accelerator, output_dir, step, cfg.keep_checkpoints)
        inject_fault(cfg, step, rank)
    progress.close()
    train_time_s = time.perf_counter() - train_start
    final_mse = full_data_mse(model, shard_x, shard_y, accelerator)

    trained = accelerator.unwrap_model(model)
    weight, bias = trained.weight.detach().float().cpu().squeeze(0), trained.bias.detach().float().cpu()
    weight_error = (weight - torch.tensor(truth["weight"])).abs().max().item()
    bias_error = abs(bias.item() - truth["bias"])
    steps_run = cfg.max_steps - start_step
    metrics = {
        "weight": weight.tolist(), "bias": bias.item(), "true_weight": truth["weight"], "true_bias": truth["bias"],
        "max_weight_error": weight_error, "bias_error": bias_error, "initial_mse": initial_mse, "final_mse": final_mse,
        "global_batch_size": global_batch_size, "train_time_s": train_time_s, "resumed_from_step": start_step,
        "first_step_unix_time": first_step_unix_time,
        "samples_per_s": steps_run * global_batch_size / train_time_s if steps_run else 0.0,
    }
    checks["loss_decreased"] = {"passed": final_mse < initial_mse, "detail": f"full-data MSE {initial_mse:.5f} -> {final_mse:.5f}"}
    if accelerator.is_main_process:
        truth_name = truth.get("source", "w*, b*")
        checks["recovers_truth"] = {
            "passed": max(weight_error, bias_error) <= cfg.truth_tolerance,
            "detail": f"max |w - w_true| = {weight_error:.4f}, |b - b_true| = {bias_error:.4f} vs {truth_name}, tolerance {cfg.truth_tolerance}",
        }
        reference = replay_single_process(cfg, dataset, world_size, initial_state, accelerator)
        parity_atol = cfg.parity_atol or (1e-5 if accelerator.mixed_precision == "no" else 5e-2)
        parity_error = max_abs_difference(trained, reference)
        metrics["parity_max_abs_diff"] = parity_error
        checks["matches_single_process"] = {
            "passed": parity_error <= parity_atol,
            "detail": f"max |DDP - one process| over all parameters = {parity_error:.2e}, tolerance {parity_atol:.0e}, {cfg.max_steps} steps of global batch {global_batch_size}",
        }
    recorder.log(step, {**interval, "final_mse": final_mse, "max_weight_error": weight_error, "bias_error": bias_error})
    return recorder.finish(metrics, checks)


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
