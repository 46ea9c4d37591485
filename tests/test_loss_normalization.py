"""loss_normalization for real: token-weighted loss equals one process under DDP (2 ranks) and FSDP2
(3 ranks x 4 micro-batches, which also guards against pytorch/pytorch#162338, gloo's AVG), the naive
per-micro-batch mean is shown wrong, and without padding the naive mean is right (its check fails)."""

from __future__ import annotations

import pytest

from experiments.loss_normalization import main
from helpers import fork_launch, launch, run_in_process, run_main_in_process

QUIET = ["--report_to", "none", "--max_steps", "3"]


def figures(finished) -> dict:
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = finished.summary
    assert summary["passed"], summary["checks"]
    return summary["metrics"]


@pytest.mark.launch
def test_ddp_two_ranks_token_weighted_is_exact_and_naive_is_not(tmp_path):
    metrics = figures(launch("loss_normalization.py", QUIET, tmp_path / "run"))
    assert metrics["token_weighted"]["step1_gradient_max_abs_diff"] < 1e-6
    assert metrics["naive"]["step1_gradient_max_abs_diff"] > 1e-3  # measured 1.3e-02
    tokens = metrics["real_tokens_in_first_micro_batch_per_rank"]
    assert len(tokens) == 2 and tokens[0] != tokens[1]  # the ranks really hold different token counts


@pytest.mark.launch
def test_fsdp_three_ranks_four_micro_batches(tmp_path):
    args = [*QUIET, "--strategy", "fsdp", "--gradient_accumulation_steps", "4"]
    metrics = figures(fork_launch(main, args, tmp_path / "run", num_processes=3))
    assert metrics["token_weighted"]["parameter_max_abs_diff"] < 1e-6
    assert metrics["naive"]["parameter_max_abs_diff"] > 1e-3


def test_without_padding_the_naive_mean_is_right_and_its_check_fails(tmp_path, capsys):
    """Every sequence full length: every micro-batch holds the same number of tokens, so the mean of
    means IS the global mean. The check that the bug shows must then fail: it can."""
    finished = run_in_process(main, [*QUIET, "--min_length", "32"], tmp_path / "run", capsys)
    assert finished.returncode == 1
    checks = finished.summary["checks"]
    assert checks["token_weighted_matches_one_process"]["passed"]
    assert not checks["naive_differs_from_one_process"]["passed"]


def test_one_process_with_accumulation_shows_the_bug_too(tmp_path, capsys):
    metrics = figures(run_in_process(main, QUIET, tmp_path / "run", capsys))  # 1 rank x 2 micro-batches
    assert metrics["naive"]["step1_gradient_max_abs_diff"] > 1e-3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min_length", "0"], "--min_length must be in [1, --block_size], got 0"),
        (["--gradient_accumulation_steps", "1"], "one rank and one micro-batch average nothing"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message, capsys):
    code, stderr = run_main_in_process(main, [*QUIET, "--output_dir", str(tmp_path / "run"), *args], capsys)
    assert code == 2 and message in stderr and stderr.strip().count("\n") == 0
