"""The benchmarks in --quick mode: every figure is produced and well-formed (no speed is asserted:
targets are met in the full run, whose table is in the README)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import REPO, clean_env


def positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_run_all_quick_writes_every_figure(tmp_path):
    output = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--quick", "--output", str(output)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=clean_env(HOME=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    assert results["quick"] is True and results["machine"]["cpus"] >= 1 and results["machine"]["torch"].startswith("2.13")
    step = results["step_overhead"]
    loops = ("bare", "bare_again", "bare_plus_common", "accelerate_model", "accelerate_no_accumulate", "accelerate")
    assert step["world_size"] == 2 and all(positive(step[f"{loop}_steps_per_s"]) for loop in loops)
    assert math.isclose(step["ratio"], step["accelerate_steps_per_s"] / step["bare_steps_per_s"])
    assert math.isclose(step["noise_floor_ratio"], step["bare_again_steps_per_s"] / step["bare_steps_per_s"])
    per_step_us = {loop: 1e6 / step[f"{loop}_steps_per_s"] for loop in loops}
    assert math.isclose(step["overhead_us"]["common"], per_step_us["bare_plus_common"] - per_step_us["bare"])
    assert math.isclose(step["overhead_us"]["accelerate_and_common"], per_step_us["accelerate"] - per_step_us["bare"])
    # each part is the difference between two neighbouring loops, so the parts add up to the whole
    for part, (without, with_it) in {"prepared_model": ("bare_plus_common", "accelerate_model"),
                                     "backward_and_optimizer": ("accelerate_model", "accelerate_no_accumulate"),
                                     "accumulate": ("accelerate_no_accumulate", "accelerate")}.items():
        assert math.isclose(step["overhead_us"][part], per_step_us[with_it] - per_step_us[without]), part
    assert step["met"] is (step["ratio"] >= 0.95)
    for batch in ("batch_32", "batch_1024"):
        row = results["data_path"][batch]
        assert all(positive(row[k]) for k in ("common_iterator", "raw_slicing", "raw_shuffled_slicing", "dataloader"))
    scaling = results["scaling"]
    assert positive(scaling["one_rank_samples_per_s"])
    assert set(scaling["two_ranks"]) == {"ddp"}  # accumulation and bucket variants run in full mode only
    assert all(positive(r["samples_per_s"]) and positive(r["efficiency"]) for r in scaling["two_ranks"].values())
    harness = results["collective_harness"]
    assert positive(harness["memcpy_gbps"]) and len(harness["rows"]) == 4
    assert all(positive(r[k]) for r in harness["rows"] for k in ("harness_us", "bare_us", "bare_again_us", "busbw_gbps"))
    assert all(math.isfinite(harness[k]) for k in ("overhead", "noise_floor", "max_row_overhead", "max_row_noise_floor"))
    assert harness["max_row_overhead"] == max(r["overhead"] for r in harness["rows"]) and harness["met"] is (harness["overhead"] < 0.05)
    startup = results["startup"]
    assert set(startup["imports_s"]) == {"torch", "accelerate", "datasets", "wandb"}
    assert 0 < startup["launch_to_first_step_s"] < 120
    assert startup["wandb_imported_without_wandb_tracker"] is False  # W&B is imported only when it is the tracker
    assert "| 1. step overhead" in done.stdout and "| 5. start-up" in done.stdout
