"""ddp_linear for real: 2 ranks through accelerate launch, 1 rank with no config, torchrun, W&B offline
read back, and the checks shown able to fail."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from experiments.ddp_linear import main
from helpers import clean_env, fork_launch, launch, run_in_process, run_main_in_process, wandb_history

TINY = ["--max_steps", "120", "--log_every", "40", "--report_to", "none"]
ALL_CHECKS = {"distributed", "recovers_truth", "matches_single_process", "loss_decreased"}


def assert_passed(finished, world_size: int) -> dict:
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = finished.summary
    assert summary["passed"] is True, json.dumps(summary["checks"], indent=1) + finished.stderr[-2000:]
    assert summary["experiment"] == "ddp_linear"
    assert set(summary["checks"]) == ALL_CHECKS and all(c["passed"] for c in summary["checks"].values())
    assert summary["world_size"] == world_size
    assert summary["distributed_type"] == ("MULTI_CPU" if world_size > 1 else "NO")
    return summary


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """One 2-rank run through accelerate launch + cpu_ddp.yaml, read by several tests."""
    return launch("ddp_linear.py", TINY, tmp_path_factory.mktemp("two_ranks") / "run")


@pytest.mark.launch
def test_two_cpu_ranks_match_one_process_and_recover_the_truth(two_rank_run):
    finished = two_rank_run
    summary = assert_passed(finished, world_size=2)
    metrics = summary["metrics"]
    assert metrics["global_batch_size"] == 64  # 32 per rank x 2 ranks
    assert metrics["max_weight_error"] < 0.05 and metrics["parity_max_abs_diff"] <= 1e-5
    assert len(metrics["weight"]) == 10 and metrics["final_mse"] < 0.02 < metrics["initial_mse"]
    from experiments.ddp_linear import Config

    logged = {key for record in finished.metrics for key in record}
    assert set(Config.sweep_metrics) <= logged  # what sweeps may name as their metric really is logged
    steps = [r["step"] for r in finished.metrics if "loss" in r]
    assert steps == [40, 80, 120]
    assert "step     40 | loss" in finished.stdout and "samples/s" in finished.stdout
    assert json.loads((finished.output_dir / "config.json").read_text())["max_steps"] == 120


@pytest.mark.launch
def test_one_process_with_no_config(tmp_path):
    assert_passed(launch("ddp_linear.py", TINY, tmp_path / "run", config=None), world_size=1)


@pytest.mark.launch
def test_torchrun_accumulation_and_bf16(tmp_path):
    args = [*TINY, "--gradient_accumulation_steps", "2", "--mixed_precision", "bf16"]
    summary = assert_passed(
        launch("ddp_linear.py", args, tmp_path / "run", launcher="torchrun"), world_size=2
    )
    assert summary["metrics"]["global_batch_size"] == 128  # 32 x 2 ranks x 2 micro-batches
    assert summary["config"]["mixed_precision"] == "bf16"


@pytest.mark.launch
def test_wandb_offline_without_key_logs_what_metrics_jsonl_says(tmp_path):
    """No key, WANDB_MODE unset, no netrc: the run must neither prompt nor hang, and go offline (forked ranks: the
    launcher is no part of it)."""
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(HOME=str(home), NETRC=str(home / "absent"))
    finished = fork_launch(main, ["--max_steps", "60", "--log_every", "20"], tmp_path / "run", env=env)
    summary = assert_passed(finished, world_size=2)
    run_dir = summary["trackers"]["wandb"]["run_dir"]
    assert summary["trackers"]["wandb"]["mode"] == "offline" and "offline-run-" in run_dir
    assert f"wandb sync {run_dir}" in finished.stdout
    logged = {items["_step"]: items["loss"] for items in wandb_history(run_dir) if "loss" in items}
    local = {r["step"]: r["loss"] for r in finished.metrics if "loss" in r}
    assert logged == pytest.approx(local) and sorted(local) == [20, 40, 60]


@pytest.mark.launch
def test_distributed_check_fails_when_ranks_are_missing(tmp_path):
    finished = fork_launch(main, [*TINY, "--expected_world_size", "3"], tmp_path / "run")
    assert finished.returncode != 0
    summary = finished.summary
    assert summary["passed"] is False and summary["checks"]["distributed"]["passed"] is False
    assert "launched 3" in summary["checks"]["distributed"]["detail"]


@pytest.mark.launch
def test_single_process_reference_tells_apart_a_different_run(two_rank_run):
    """The parity check can fail: replaying the batches of a 1-rank run (batch 32, not 64) ends far from
    the 2-rank result, far beyond the tolerance that the 2-rank replay meets."""
    from accelerate import Accelerator

    from common.data import make_regression_dataset
    from common.models import build_linear
    from experiments.ddp_linear import Config, replay_single_process

    distributed = two_rank_run.summary["metrics"]
    cfg = Config(max_steps=120)
    dataset, _ = make_regression_dataset(cfg.n_samples, cfg.n_features, cfg.noise_std, cfg.seed)
    initial_state = copy.deepcopy(build_linear(cfg.n_features, seed=cfg.seed).state_dict())
    accelerator = Accelerator(cpu=True)
    right = replay_single_process(cfg, dataset, 2, initial_state, accelerator)
    wrong = replay_single_process(cfg, dataset, 1, initial_state, accelerator)
    learned = torch.tensor(distributed["weight"])
    assert (right.weight.detach().squeeze(0) - learned).abs().max() <= 1e-5
    assert (wrong.weight.detach().squeeze(0) - learned).abs().max() > 1e-3


def test_finished_run_is_not_overwritten(tmp_path, capsys):
    first = run_in_process(main, TINY, tmp_path / "run", capsys)
    assert first.returncode == 0
    before = (tmp_path / "run" / "summary.json").read_text()
    again = run_in_process(main, TINY, tmp_path / "run", capsys)
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0 and "already holds a finished run" in again.stderr
    assert (tmp_path / "run" / "summary.json").read_text() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "-0.1"], "--lr must be > 0, got -0.1"),
        (["--per_rank_batch_size", "zero"], "invalid int value: 'zero'"),
        (["--mixed_precision", "fp16"], "fp16 needs a GPU"),
        (["--data_file", "missing.csv"], "no such file"),
        (["--n_samples", "20"], "fewer than the batch size 32"),
        (["--report_to", "mlflow"], "--report_to mlflow: that tracker is not installed"),
        (
            ["--resume_from_checkpoint", "no/such/checkpoint"],
            "no/such/checkpoint: cannot be used: not a folder",
        ),
        (["--checkpoint_every", "-5"], "--checkpoint_every must be >= 0, got -5"),
        (["--keep_checkpoints", "0"], "--keep_checkpoints must be > 0, got 0"),
        (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be > 0, got 0"),
        (["--mixed_precision", "fp8"], "invalid choice: 'fp8'"),
        (
            ["--feature_columns", "a,b"],
            "--feature_columns and --target_column choose columns of --data_file; pass --data_file too",
        ),
        (["--n_samples", "10000000000"], "--n_samples: the data would need about"),
        (["--fail_at_step", "3", "--fail_rank", "5"], "--fail_rank 5: this launch has ranks 0..0"),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, args, message, capsys):
    code, stderr = run_main_in_process(
        main, ["--report_to", "none", "--output_dir", str(tmp_path / "run"), *args], capsys
    )
    assert code == 2, stderr
    assert stderr.strip().count("\n") == 0 and message in stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    ("csv_text", "args", "message"),
    [
        ("a,b\n1,2\n3,4\n", [], "has no target column 'y'; its columns: a, b"),
        ("a,y\n1,2\n3,4\n", ["--feature_columns", "a,y"], "--feature_columns lists the target column 'y'"),
    ],
    ids=["no-target-column", "target-listed-as-a-feature"],
)
def test_a_data_file_that_cannot_train_is_refused(tmp_path, capsys, csv_text, args, message):
    (tmp_path / "t.csv").write_text(csv_text)
    argv = [
        "--report_to",
        "none",
        "--output_dir",
        str(tmp_path / "run"),
        "--data_file",
        str(tmp_path / "t.csv"),
        *args,
    ]
    code, stderr = run_main_in_process(main, argv, capsys)
    assert code == 2 and message in stderr


@pytest.mark.launch
def test_trains_on_a_local_csv(tmp_path):
    x = torch.randn(256, 3, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.25
    rows = ["a,b,c,target"] + [
        ",".join(f"{v:.6f}" for v in (*r.tolist(), t.item())) for r, t in zip(x, y, strict=True)
    ]
    (tmp_path / "table.csv").write_text("\n".join(rows) + "\n")
    args = [
        *TINY,
        "--data_file",
        str(tmp_path / "table.csv"),
        "--target_column",
        "target",
        "--per_rank_batch_size",
        "16",
    ]
    summary = assert_passed(fork_launch(main, args, tmp_path / "run"), world_size=2)
    assert summary["metrics"]["true_weight"] == pytest.approx(
        [1.0, -2.0, 0.5], abs=1e-4
    )  # least squares of exact data
    assert "least squares" in summary["checks"]["recovers_truth"]["detail"]
