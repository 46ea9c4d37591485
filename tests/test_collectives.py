"""collectives for real: every op verified on 2 gloo ranks and on 1, the bench's rows and plot, and a
check shown able to fail (gloo's silent wrong answer on strided tensors)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import clean_env, launch, run_in_process, run_main_in_process
from experiments.collectives import VERIFY_OPS, bus_factor, main

QUIET = ["--report_to", "none"]


def test_two_ranks_verify_every_op_and_list_what_gloo_refuses(tmp_path):
    finished = launch("collectives.py", [*QUIET, "--backend", "gloo"], tmp_path / "run")
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = finished.summary
    assert summary["passed"] and summary["world_size"] == 2 and summary["metrics"]["backend"] == "gloo"
    assert set(summary["checks"]) == {"distributed", *VERIFY_OPS}
    statuses = {(r["op"], r["dtype"]): r["status"] for r in summary["metrics"]["results"]}
    assert statuses[("all_reduce(sum)", "bfloat16")] == "ok" and statuses[("send_recv", "int64")] == "ok"
    assert statuses[("all_reduce(avg)", "int64")] == "unsupported"  # gloo cannot average integers in place
    assert "can't be cast" in summary["metrics"]["unsupported"]["all_reduce(avg)/int64"]
    assert summary["metrics"]["verified"] == sum(s == "ok" for s in statuses.values()) >= 45


def test_one_process_runs_the_api_on_a_one_rank_group(tmp_path, capsys):
    finished = run_in_process(main, QUIET, tmp_path / "run", capsys)
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = finished.summary
    assert summary["passed"] and summary["world_size"] == 1 and "send_recv" not in summary["checks"]
    assert any(r["op"] == "send_recv" and r["status"] == "skipped" for r in summary["metrics"]["results"])


def test_strided_inputs_are_caught_as_wrong(tmp_path):
    """FIELD_NOTES' trap: gloo all_reduce on a non-contiguous view returns wrong values, silently."""
    finished = launch("collectives.py", [*QUIET, "--ops", "all_reduce", "--noncontiguous", "--dist_timeout_s", "30"],
                      tmp_path / "run", launcher="torchrun")
    assert finished.returncode != 0
    check = finished.summary["checks"]["all_reduce"]
    assert check["passed"] is False and "WRONG: rank" in check["detail"] and "got [" in check["detail"]


def test_bench_tiny_sizes_rows_plot_and_wandb_table(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    args = ["--bench", "--min_bytes", "1024", "--max_bytes", "4096", "--iters", "2", "--repeats", "3", "--warmup", "1",
            "--memcpy_bytes", str(2**20)]
    finished = launch("collectives.py", args, tmp_path / "run", env=clean_env(HOME=str(home), NETRC=str(home / "none")))
    assert finished.returncode == 0, finished.stderr[-3000:]
    metrics = finished.summary["metrics"]
    rows = metrics["rows"]
    assert len(rows) == 6 * 3 and {r["bytes"] for r in rows} == {1024, 2048, 4096}
    for row in rows:
        assert row["time_us"] > 0 and row["spread_us"] >= 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor(row["op"], 2))
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_pct_of_memcpy"] == pytest.approx(100 * row["busbw_gbps"] / metrics["memcpy_gbps"])
    assert metrics["memcpy_gbps"] > 0.1
    png = (tmp_path / "run" / "busbw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert len(finished.metrics) == len(rows)
    assert "all_reduce" in finished.stdout and "busbw_GB/s" in finished.stdout
    run_dir = finished.summary["trackers"]["wandb"]["run_dir"]
    inspected = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", run_dir],
                               capture_output=True, text=True, timeout=60, check=True).stdout
    logged_keys = set()
    for line in inspected.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            logged_keys |= {key.split(".")[0] for key in record["history"]["item"]}  # "bench_plot._type" -> bench_plot
    assert {"bench_table", "bench_plot", "busbw_gbps"} <= logged_keys


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather_into_tensor", 4) == 0.75 == bus_factor("reduce_scatter_tensor", 4)
    assert bus_factor("all_to_all_single", 2) == 0.5
    assert bus_factor("broadcast", 8) == 1.0 == bus_factor("reduce", 8)
    assert bus_factor("all_reduce", 1) == 0.0  # one rank moves nothing


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ops", "all_reduce,alltoall"], "'alltoall' is not a verify op"),
        (["--bench", "--ops", "scatter"], "'scatter' is not a bench op"),
        (["--bench", "--min_bytes", "1000"], "--min_bytes must be a power of two >= 64, got 1000"),
        (["--noncontiguous"], "--noncontiguous works with --ops from all_reduce, reduce, broadcast"),
        (["--backend", "nccl2"], "invalid choice: 'nccl2'"),
    ],
)
def test_bad_input(tmp_path, args, message, capsys):
    code, stderr = run_main_in_process(main, [*QUIET, "--output_dir", str(tmp_path / "run"), *args], capsys)
    assert code == 2 and message in stderr and stderr.count("\n") == 1


def test_bad_input_from_the_command_line_is_one_line(tmp_path):
    finished = launch("collectives.py", [*QUIET, "--ops", "alltoall"], tmp_path / "run", launcher="python")
    assert finished.returncode == 2 and finished.stderr.count("\n") == 1 and "Traceback" not in finished.stderr
