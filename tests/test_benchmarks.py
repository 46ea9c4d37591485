"""The benchmarks in --quick mode: every figure is produced and well-formed (no speed is asserted:
targets are met in the full run, whose table is in docs/performance.md)."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import run_all, sharding_step
from helpers import REPO, fork_launch, fork_the_launches, parse_launch


def positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.launch
def test_run_all_quick_writes_every_figure_and_shows_a_slowed_loop_where_it_was_slowed(
    tmp_path, capsys, monkeypatch
):
    """Every benchmark's figures, well-formed; and the step-overhead figures are not identities of the
    code: 10 ms of busy work added to the `accelerate` loop's step must appear as accumulate()'s share
    (accelerate minus accelerate_no_accumulate) and drop the ratio, while the parts measured between
    other loops stay far below it. Swapped or mislabelled loops fail this."""
    tracked = {
        path: path.read_bytes()
        for path in (REPO / "docs" / "performance.md", REPO / "benchmarks" / "results.json")
    }
    # in this process, its torchrun workers forked (helpers.fork_the_launches); the start-up benchmark's own
    # launches and imports stay fresh processes, which are what it measures
    forked = fork_the_launches(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(
        sys, "argv", ["run_all.py", "--quick", "--slow_loop", "accelerate", "--slow_us", "10000"]
    )
    run_all.main()
    stdout = capsys.readouterr().out
    assert {path: path.read_bytes() for path in tracked} == tracked  # --quick rewrites no tracked file
    # step overhead, scaling's one rank and two, the collective bench's harness
    assert [parse_launch(command)[0].rsplit("/", 1)[1] for command in forked] == [
        "step_overhead.py", "scaling.py", "scaling.py", "collective_bench_overhead.py"]  # fmt: skip
    output = Path(stdout.split("figures written to ")[1].split()[0])
    assert output.parent == tmp_path
    results = json.loads(output.read_text())
    assert (
        results["quick"] is True
        and results["machine"]["cpus"] >= 1
        and results["machine"]["torch"].startswith("2.13")
    )
    step = results["step_overhead"]
    from benchmarks.step_overhead import LOOPS

    assert (
        len(LOOPS) == 7
        and step["world_size"] == 2
        and all(positive(step[f"{loop}_steps_per_s"]) for loop in LOOPS)
    )
    assert set(step["overhead_us"]) == {
        "common",
        "prepared_model",
        "backward_and_optimizer",
        "accumulate",
        "lookups_saved_by_caching",
        "accelerate_and_common",
    }
    assert step["met"] is (step["ratio"] >= 0.95) and 0 < step["noise_floor_ratio"] < 2
    for batch in ("batch_32", "batch_1024"):
        row = results["data_path"][batch]
        assert all(
            positive(row[k]) for k in ("common_iterator", "raw_slicing", "raw_shuffled_slicing", "dataloader")
        )
    scaling = results["scaling"]
    assert positive(scaling["one_rank_samples_per_s"])
    assert set(scaling["two_ranks"]) == {"ddp"}  # accumulation and bucket variants run in full mode only
    assert all(
        positive(r["samples_per_s"]) and positive(r["efficiency"]) for r in scaling["two_ranks"].values()
    )
    harness = results["collective_bench_overhead"]
    assert positive(harness["memcpy_gbps"]) and len(harness["rows"]) == 4
    assert all(
        positive(r[k])
        for r in harness["rows"]
        for k in ("harness_us", "bare_us", "bare_again_us", "busbw_gbps")
    )
    assert all(
        math.isfinite(harness[k])
        for k in ("overhead", "noise_floor", "max_row_overhead", "max_row_noise_floor")
    )
    assert harness["met"] is (harness["overhead"] < 0.05)
    startup = results["startup"]
    assert set(startup["imports_s"]) == {"torch", "accelerate", "datasets", "wandb"}
    assert 0 < startup["launch_to_first_step_s"] < 120
    assert (
        startup["wandb_imported_without_wandb_tracker"] is False
    )  # W&B is imported only when it is the tracker
    assert "| 1. step overhead" in stdout and "| 5. start-up" in stdout
    parts = step["overhead_us"]
    # 10 ms where it was added; each part between other loops below half of it. A behaviour check (where the
    # slow-down lands), not a speed bound: with other tests beside this one on the 2 cores an un-slowed part
    # has read 2.35 and 3.07 ms, and a swapped or mislabelled loop puts the whole 10 ms there
    assert parts["accumulate"] > 6000 and parts["accelerate_and_common"] > 6000
    assert max(parts["common"], parts["prepared_model"], parts["backward_and_optimizer"]) < 5000
    assert parts["lookups_saved_by_caching"] > 6000  # the cached variant is not slowed
    assert step["ratio"] < 0.5 and step["met"] is False


@pytest.mark.launch
def test_sharding_step_times_each_variant_and_checks_it_against_one_process(tmp_path):
    """benchmarks/sharding_step.py on 2 real gloo ranks, one timed step each: every row is made, and the
    plain-tensor TP (written only there) ends at one process's loss (the run's own check, exit 0)."""
    args = ["--variants", "tp_plain", "--rounds", "1", "--steps", "1"]
    finished = fork_launch(sharding_step.main, args, tmp_path / "run", output_flag=False)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = [
        line.split(" | ")[0].strip("| ") for line in finished.stdout.splitlines() if line.startswith("| ")
    ]
    assert rows == ["variant", "local", "ddp", "tp_plain"]
    assert "(equal within 1e-4)" in finished.stdout and "ms: tp " in finished.stdout


def test_a_benchmarks_command_is_printed_as_it_can_be_run_again():
    """A flag's value with spaces is quoted: the calibration's table printed `--model_flags --n_layer 4 ...`,
    which its own parser refuses."""
    import shlex

    from benchmarks.workers import command_line

    argv = ["--model_flags", "--n_layer 4 --d_model 256", "--rounds", "3"]
    line = command_line("benchmarks.at_scale_calibration", argv)
    quoted = "--model_flags '--n_layer 4 --d_model 256' --rounds 3"
    assert line == f"python -m benchmarks.at_scale_calibration {quoted}"
    assert shlex.split(line)[3:] == argv
