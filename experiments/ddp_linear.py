"""ddp_linear: does data-parallel training with Accelerate give exactly what one process would?

The DDP tutorial this project corrects (docs/tutorials.md), done right. It trains `nn.Linear(10, 1)`
with MSE + SGD on synthetic data y = X·w* + b* + noise (or on your own table, --data_file). Every rank
reads its own shard of the data (per-rank batch 32: with 2 ranks the global batch is 64). DDP averages
the ranks' gradients, and the mean of per-rank mean gradients equals the mean over the global batch
when shards are equal, so the run checks itself:

- distributed            the ranks Accelerate sees are the ranks that were launched (no silent
                         "two processes that both think they are rank 0");
- recovers_truth         learned weight and bias are within --truth_tolerance of w*, b*
                         (of the least-squares fit when the data is a file);
- matches_single_process the same global batches replayed in ONE process from the same initial
                         weights give the same parameters, within --parity_atol (float32 sums in
                         another order differ by ~1e-7 per step; bf16 by ~1e-2);
- loss_decreased         full-data MSE after training is below the MSE at initialisation;
- resume_restored_state  (resumed runs) the state right after loading is bitwise the saved state.

Run it (results in runs/ddp_linear/: summary.json, metrics.jsonl, config.json, W&B offline run):
    accelerate launch experiments/ddp_linear.py                                          # 1 process
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/ddp_linear.py   # 2 CPU ranks, gloo
    accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml experiments/ddp_linear.py  # all GPUs, NCCL
    torchrun --nproc_per_node 2 experiments/ddp_linear.py                                # same, plain torchrun
    # many nodes: edit accelerate_configs/multi_node_ddp.yaml (machine_rank, main_process_ip) on each node
    accelerate launch --config_file accelerate_configs/multi_node_ddp.yaml experiments/ddp_linear.py
    # checkpoints, resume and elastic restarts (common/training.py; README "When things go wrong")
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 3 \\
        experiments/ddp_linear.py --output_dir runs/ddp_linear_elastic --checkpoint_every 100 --resume_from_checkpoint latest
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file from any cwd
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("ddp_linear.py")

import torch
import torch.nn.functional as F

from common.checkpoint import ResumableArgs, file_sha256
from common.config import UsageError, flag, parse_config, require, require_positive, run_cli
from common.data import (
    iterate_batches,
    iterate_global_batches,
    load_table,
    make_regression_dataset,
    require_memory,
    shard_tensors,
)
from common.models import build_linear
from common.reference import max_abs_difference, train_single_process
from common.run import start_run
from common.training import TrainLoop

EXPERIMENT = "ddp_linear"


@dataclass
class Config(ResumableArgs):
    sweep_metrics = ("loss", "samples_per_s", "final_mse", "max_weight_error", "bias_error")
    # tolerances change no result; --data_file is known by its content (data_identity), not its path
    result_neutral = (
        *ResumableArgs.result_neutral,
        "truth_tolerance",
        "parity_atol",
        "parity_atol_mixed_precision",
        "data_file",
    )

    n_samples: int = flag(1000, "rows of synthetic data (the tutorial's 1000)")
    n_features: int = flag(10, "input features of synthetic data (the tutorial's nn.Linear(10, 1))")
    noise_std: float = flag(0.1, "standard deviation of the noise added to y = X·w* + b*")
    data_file: str = flag("", "a local csv/json/jsonl/parquet file to train on instead of synthetic data")
    target_column: str = flag("y", "column of --data_file to predict (needs --data_file)")
    feature_columns: str = flag(
        "", "comma-separated input columns of --data_file (default: all but the target; needs --data_file)"
    )
    per_rank_batch_size: int = flag(
        32, "rows per rank per micro-batch; global batch = this x ranks x accumulation"
    )
    gradient_accumulation_steps: int = flag(1, "micro-batches per optimizer step (Accelerate's accumulate())")
    lr: float = flag(0.1, "SGD learning rate (the tutorial's 0.1)")
    mixed_precision: str = flag(
        "",
        "no/bf16/fp16 (empty: what `accelerate launch` or its config says); bf16 runs on CPU, fp16 needs a GPU",
        choices=("", "no", "bf16", "fp16"),
    )
    truth_tolerance: float = flag(0.05, "largest allowed |learned - true| of any weight or the bias")
    parity_atol: float = flag(1e-5, "largest allowed |DDP - single process| parameter difference in float32")
    parity_atol_mixed_precision: float = flag(
        5e-2, "the same under bf16/fp16 mixed precision (both sides round to ~3 digits)"
    )

    def validate(self) -> None:
        super().validate()
        require_positive(
            self, "n_samples", "n_features", "per_rank_batch_size", "gradient_accumulation_steps", "lr"
        )
        require(self.noise_std >= 0, f"--noise_std must be >= 0, got {self.noise_std}")
        require_positive(self, "truth_tolerance", "parity_atol", "parity_atol_mixed_precision")
        if not self.data_file:
            require(
                not self.feature_columns and self.target_column == "y",
                "--feature_columns and --target_column choose columns of --data_file; pass --data_file too",
            )
            # x, y, and a shuffled copy
            require_memory("n_samples", self.n_samples * (self.n_features + 1) * 4 * 3)


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
    totals = accelerator.reduce(
        torch.stack([squared_error, torch.tensor(float(len(x)), device=x.device)]), "sum"
    )
    return (totals[0] / totals[1]).item()


def replay_single_process(
    cfg: Config, dataset, world_size: int, initial_state: dict, accelerator
) -> torch.nn.Linear:
    """The reference: the global batches of the distributed run, in one process, with no DDP
    (32 per rank x 2 ranks x accumulation 1 = 64 rows per step, one mean loss over them)."""
    model = build_linear(initial_state["weight"].shape[1], seed=cfg.seed)
    model.load_state_dict(initial_state)
    global_batches = iterate_global_batches(dataset, world_size, cfg.per_rank_batch_size, cfg.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    train_single_process(model, optimizer, global_batches, cfg.max_steps, cfg.gradient_accumulation_steps,
                         device=accelerator.device, autocast=accelerator.autocast)  # fmt: skip
    return model


def data_identity(cfg: Config) -> dict:
    """What a checkpoint of this run is tied to: the data file's bytes (synthetic data is fixed by the flags)."""
    if not cfg.data_file:
        return {}
    if not os.path.isfile(cfg.data_file):
        raise UsageError(f"--data_file {cfg.data_file!r}: no such file")
    try:
        return {"data_file_sha256": file_sha256(cfg.data_file)}
    except OSError as error:
        raise UsageError(
            f"--data_file {cfg.data_file!r}: cannot be read ({error.strerror or error})"
        ) from None


def run(cfg: Config) -> int:
    with start_run(
        cfg,
        EXPERIMENT,
        data_identity=data_identity(cfg),
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
    ) as session:
        accelerator = session.accelerator
        with accelerator.main_process_first():  # datasets' cache: one rank writes it, the others read it
            dataset, truth = load_data(cfg)
        rank, world_size = accelerator.process_index, accelerator.num_processes
        shard_x, shard_y = (t.to(accelerator.device) for t in shard_tensors(dataset, rank, world_size))
        # A resumed run skips the micro-batches the checkpointed steps consumed: same data order as one long run.
        samples_per_micro_batch = cfg.per_rank_batch_size * world_size  # 32 per rank x 2 ranks = 64
        batches = iterate_batches(
            shard_x,
            shard_y,
            cfg.per_rank_batch_size,
            cfg.seed,
            start_batch=session.samples_seen // samples_per_micro_batch,
        )

        # same seed on every rank, and DDP broadcasts rank 0's anyway
        model = build_linear(shard_x.shape[1], seed=cfg.seed)
        initial_state = copy.deepcopy(model.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        model, optimizer = accelerator.prepare(model, optimizer)
        initial_mse = full_data_mse(model, shard_x, shard_y, accelerator)

        # The idea: each rank trains on its own shard; DDP averages the gradients in backward.
        # TrainLoop (common/training.py): resume, logging, progress, heartbeat, checkpoints, NaN stop
        loop = TrainLoop(session, model, optimizer, samples_per_micro_batch=samples_per_micro_batch)
        for x, y in loop.micro_batches(batches):
            with accelerator.accumulate(model):  # no all-reduce until the last micro-batch of a step
                loss = F.mse_loss(model(x), y)
                # DDP: all-reduce, then / world size: every rank holds the mean gradient
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)

        final_mse = full_data_mse(model, shard_x, shard_y, accelerator)
        trained = accelerator.unwrap_model(model)
        weight, bias = trained.weight.detach().float().cpu().squeeze(0), trained.bias.detach().float().cpu()
        weight_error = (weight - torch.tensor(truth["weight"])).abs().max().item()
        bias_error = abs(bias.item() - truth["bias"])
        global_batch_size = cfg.per_rank_batch_size * world_size * cfg.gradient_accumulation_steps
        session.metrics.update(
            loop.metrics(),
            weight=weight.tolist(),
            bias=bias.item(),
            true_weight=truth["weight"],
            true_bias=truth["bias"],
            max_weight_error=weight_error,
            bias_error=bias_error,
            initial_mse=initial_mse,
            final_mse=final_mse,
            global_batch_size=global_batch_size,
        )
        session.check(
            "loss_decreased", final_mse < initial_mse, f"full-data MSE {initial_mse:.5f} -> {final_mse:.5f}"
        )
        if session.is_main:
            session.check(
                "recovers_truth",
                max(weight_error, bias_error) <= cfg.truth_tolerance,
                f"max |w - w_true| = {weight_error:.4f}, "
                f"|b - b_true| = {bias_error:.4f} vs {truth.get('source', 'w*, b*')}, "
                f"tolerance {cfg.truth_tolerance}",
            )
            reference = replay_single_process(cfg, dataset, world_size, initial_state, accelerator)
            session.metrics["parity_max_abs_diff"] = max_abs_difference(trained, reference)
            session.parity_check(
                "matches_single_process",
                session.metrics["parity_max_abs_diff"],
                cfg.parity_atol if accelerator.mixed_precision == "no" else cfg.parity_atol_mixed_precision,
                "max |DDP - one process| over all parameters, "
                f"{cfg.max_steps} steps of global batch {global_batch_size} (the ranks' half-batch gradients, "
                "all-reduced and averaged, round unlike one full-batch gradient by float32's last bits, or not at "
                "all where the CPU's kernels sum in the same order: 0.0 on one VM, 1.2e-07 on another)",
            )
        session.log(
            loop.step,
            {
                **loop.last_interval,
                "final_mse": final_mse,
                "max_weight_error": weight_error,
                "bias_error": bias_error,
            },
        )
    return session.exit_code


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
