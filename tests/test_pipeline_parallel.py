"""pipeline_parallel for real on 2 gloo ranks: GPipe and 1F1B equal the full model, the timer sees every
block, summing micro-batch gradients is caught, and too few ranks are refused."""

from __future__ import annotations

import pytest

from helpers import fork_launch, launch, run_main_in_process

QUIET = ["--report_to", "none"]
PIPE = [
    *QUIET,
    "--max_steps",
    "4",
    "--log_every",
    "2",
    "--hidden_features",
    "64",
    "--batch_size",
    "64",
    "--n_samples",
    "512",
    "--bubble_microbatches",
    "2,4",
    "--bubble_steps",
    "1",
]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.launch
def test_pipeline_equals_the_full_model(tmp_path, schedule):
    from experiments.pipeline_parallel import main

    args = [*PIPE, "--schedule", schedule]
    # gpipe through `accelerate launch` (the README's command), 1f1b on forked ranks (the same training)
    if schedule == "gpipe":
        finished = launch("pipeline_parallel.py", args, tmp_path / "run")
    else:
        finished = fork_launch(main, args, tmp_path / "run")
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = finished.summary
    assert summary["passed"] and summary["world_size"] == 2 and summary["metrics"]["stages"] == 2
    for name in ("loss_matches_full_model", "gradients_match_full_model", "parameters_match_full_model"):
        assert summary["checks"][name]["passed"]
    bubbles = summary["metrics"]["bubbles"]
    assert [b["m"] for b in bubbles] == [2, 4]
    assert [b["gpipe_theory"] for b in bubbles] == pytest.approx([1 / 3, 1 / 5])
    assert all(0 < b["measured_bubble"] < 1 for b in bubbles)
    for (
        row
    ) in bubbles:  # the timer saw every block: m forwards and m backwards on each of the 2 stages, none empty
        assert (
            row["blocks_per_stage"] == [{"F": row["m"], "B": row["m"]}] * 2 and row["shortest_block_us"] > 0
        )
    png = (tmp_path / "run" / "timeline.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 5000


@pytest.mark.launch
def test_summed_micro_batch_gradients_are_caught(tmp_path):
    from experiments.pipeline_parallel import main

    finished = fork_launch(
        main, [*PIPE, "--skip_gradient_scaling", "--bubble_microbatches", ""], tmp_path / "run"
    )
    assert finished.returncode != 0
    checks = finished.summary["checks"]
    assert not checks["gradients_match_full_model"]["passed"]  # m times too large
    assert not checks["parameters_match_full_model"]["passed"]


def test_pipeline_needs_two_ranks(tmp_path, capsys):
    from experiments.pipeline_parallel import main

    code, stderr = run_main_in_process(main, [*PIPE, "--output_dir", str(tmp_path / "run")], capsys)
    assert code == 2 and "a pipeline needs >= 2 ranks" in stderr
