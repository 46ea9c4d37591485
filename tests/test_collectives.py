"""collectives for real: every op verified on 2 gloo ranks and on 1, and a check shown able to fail
(gloo's silent wrong answer on strided tensors); bad input for both collectives programs."""

from __future__ import annotations

import pytest

from experiments.collectives import VERIFY_OPS, main
from experiments.collectives_bench import main as bench_main
from helpers import fork_launch, launch, run_in_process, run_main_in_process

QUIET = ["--report_to", "none"]


@pytest.mark.launch
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


@pytest.mark.launch
def test_strided_inputs_are_caught_as_wrong(tmp_path):
    """A measured trap: gloo all_reduce on a non-contiguous view returns wrong values, silently."""
    finished = fork_launch(
        main, [*QUIET, "--ops", "all_reduce", "--noncontiguous", "--dist_timeout_s", "30"], tmp_path / "run"
    )
    assert finished.returncode != 0
    check = finished.summary["checks"]["all_reduce"]
    assert check["passed"] is False and "WRONG: rank" in check["detail"] and "got [" in check["detail"]


@pytest.mark.parametrize(
    ("program", "args", "message"),
    [
        (main, ["--ops", "all_reduce,alltoall"], "'alltoall' is not a verify op"),
        (main, ["--ops", " , "], "--ops ' , ' names no op"),
        (bench_main, ["--ops", "scatter"], "'scatter' is not a bench op"),
        (bench_main, ["--min_bytes", "1000"], "--min_bytes must be a power of two >= 64, got 1000"),
        (main, ["--noncontiguous"], "--noncontiguous works with --ops from all_reduce, reduce, broadcast"),
        (main, ["--backend", "nccl2"], "invalid choice: 'nccl2'"),
    ],
)
def test_bad_input(tmp_path, program, args, message, capsys):
    code, stderr = run_main_in_process(
        program, [*QUIET, "--output_dir", str(tmp_path / "run"), *args], capsys
    )
    assert code == 2 and message in stderr and stderr.count("\n") == 1


@pytest.mark.launch
def test_bad_input_from_the_command_line_is_one_line(tmp_path):
    finished = launch("collectives.py", [*QUIET, "--ops", "alltoall"], tmp_path / "run", launcher="python")
    assert (
        finished.returncode == 2 and finished.stderr.count("\n") == 1 and "Traceback" not in finished.stderr
    )
