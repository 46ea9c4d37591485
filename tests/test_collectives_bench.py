"""collectives_bench for real on 2 gloo ranks: rows, plot and W&B table; its ceiling check shown able
to fail; the bus factors of common/collective_bench.py."""

from __future__ import annotations

import pytest

from common.comm_counter import bus_factor
from experiments.collectives_bench import main as bench_main
from helpers import clean_env, fork_launch, launch, wandb_history

QUIET = ["--report_to", "none"]


@pytest.mark.launch
def test_bench_tiny_sizes_rows_plot_and_wandb_table(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    args = [
        "--min_bytes",
        "1024",
        "--max_bytes",
        "4096",
        "--iters",
        "2",
        "--repeats",
        "3",
        "--warmup",
        "1",
        "--memcpy_bytes",
        str(2**20),
    ]
    finished = launch(
        "collectives_bench.py",
        args,
        tmp_path / "run",
        env=clean_env(HOME=str(home), NETRC=str(home / "none")),
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert set(finished.summary["checks"]) == {"distributed", "every_row_timed", "below_memory_ceiling"}
    metrics = finished.summary["metrics"]
    rows = metrics["rows"]
    assert len(rows) == 7 * 3 and {r["bytes"] for r in rows} == {1024, 2048, 4096}  # 7 ops (send_recv too)
    assert all(0 < r["time_us"] < 1e6 and r["spread_us"] >= 0 for r in rows)
    # on 2 ranks an all_reduce moves the message once each way per rank: busbw = algbw (factor 2(n-1)/n = 1)
    assert all(r["busbw_gbps"] == r["algbw_gbps"] for r in rows if r["op"] == "all_reduce")
    assert 0.1 < metrics["memcpy_gbps"] < 1000
    png = (tmp_path / "run" / "busbw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert [r["table"] for r in finished.metrics] == ["bench"] * len(rows)
    assert "all_reduce" in finished.stdout and "busbw_GB/s" in finished.stdout
    run_dir = finished.summary["trackers"]["wandb"]["run_dir"]
    logged_keys = {
        key.split(".")[0] for items in wandb_history(run_dir) for key in items
    }  # "bench_plot._type"
    assert {"bench_table", "bench_plot"} <= logged_keys


@pytest.mark.launch
def test_a_row_faster_than_memory_fails_the_bench(tmp_path):
    """The ceiling check can fail: with the allowed multiple of memcpy set absurdly low, every row is 'too fast'."""
    args = [
        *QUIET,
        "--ops",
        "all_reduce",
        "--min_bytes",
        "1024",
        "--max_bytes",
        "1024",
        "--iters",
        "2",
        "--repeats",
        "1",
        "--memcpy_bytes",
        str(2**20),
        "--max_memcpy_multiple",
        "1e-12",
    ]
    finished = fork_launch(bench_main, args, tmp_path / "run")
    assert finished.returncode == 1
    check = finished.summary["checks"]["below_memory_ceiling"]
    assert check["passed"] is False and "all_reduce@1024" in check["detail"]


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather_into_tensor", 4) == 0.75 == bus_factor("reduce_scatter_tensor", 4)
    assert bus_factor("all_to_all_single", 2) == 0.5
    assert bus_factor("broadcast", 8) == 1.0 == bus_factor("reduce", 8)
    assert bus_factor("all_reduce", 1) == 0.0  # one rank moves nothing
