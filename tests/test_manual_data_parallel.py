"""manual_data_parallel for real on 2 gloo ranks: every hand-rolled strategy equals DDP and the
single-process replay, no_sync is honoured, and the tutorial's sum-not-average bug is caught."""

from __future__ import annotations

import pytest

from experiments.manual_data_parallel import main
from helpers import fork_launch, launch, run_in_process

QUIET = ["--report_to", "none", "--max_steps", "60"]


@pytest.mark.launch
def test_all_strategies_match_ddp_and_one_process(tmp_path):
    finished = launch("manual_data_parallel.py", QUIET, tmp_path / "run")
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = finished.summary
    assert summary["passed"] and summary["world_size"] == 2
    for strategy in ("per_param", "bucketed", "overlapped"):
        assert summary["checks"][f"{strategy}_matches_ddp"]["passed"]
        assert summary["checks"][f"{strategy}_matches_single_process"]["passed"]
    stats = summary["metrics"]["strategies"]
    assert stats["per_param"]["collectives_per_step"] == 2  # weight and bias of nn.Linear(10, 1)
    assert stats["bucketed"]["collectives_per_step"] == 1 and stats["ddp"]["collectives_per_step"] == 1
    assert {s["bytes_per_step"] for s in stats.values()} == {
        44.0
    }  # 11 float32 gradients, whatever the strategy
    assert [r["strategy"] for r in finished.metrics] == ["ddp", "per_param", "bucketed", "overlapped"]
    assert "median ms/step" in finished.stdout


@pytest.mark.launch
def test_accumulation_syncs_on_the_last_micro_batch_only(tmp_path):
    # mlp gradients: fc2.bias 4 B + fc2.weight 200 B | fc1.bias 200 B | fc1.weight 2000 B -> 3 buckets of <= 314 B
    args = [
        *QUIET,
        "--model",
        "mlp",
        "--lr",
        "0.05",
        "--gradient_accumulation_steps",
        "2",
        "--bucket_mb",
        "0.0003",
    ]
    finished = fork_launch(main, args, tmp_path / "run")
    assert finished.returncode == 0
    summary = finished.summary
    assert summary["passed"]
    stats = summary["metrics"]["strategies"]
    assert (
        stats["per_param"]["collectives_per_step"] == 4 and stats["overlapped"]["collectives_per_step"] == 4
    )
    assert stats["bucketed"]["collectives_per_step"] == 3
    assert stats["ddp"]["all_reduces_inside_no_sync"] == 0
    assert summary["checks"]["ddp_no_sync_skips_all_reduce"]["passed"]


@pytest.mark.launch
def test_summing_without_averaging_is_caught(tmp_path):
    """The tutorial's bug: all_reduce(SUM) without / world_size doubles every step on 2 ranks."""
    args = [*QUIET, "--strategy", "per_param", "--average_gradients", "false"]
    finished = fork_launch(main, args, tmp_path / "run")
    assert finished.returncode != 0
    check = finished.summary["checks"]["per_param_matches_single_process"]
    assert check["passed"] is False and "tolerance 1e-05" in check["detail"]
    assert finished.summary["metrics"]["strategies"]["per_param"]["diff_vs_single_process"] > 1e-3


def test_one_strategy_on_one_process(tmp_path, capsys):
    finished = run_in_process(main, [*QUIET, "--strategy", "overlapped"], tmp_path / "run", capsys)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert set(finished.summary["checks"]) == {
        "distributed",
        "overlapped_matches_single_process",
        "overlapped_syncs_once_per_step",
    }
