"""Reliability, for real on 2 gloo ranks: kill-and-resume gives bitwise-equal parameters, a dead or
stuck rank ends the job in bounded time with the rank named, an elastic restart recovers, two
"machines" rendezvous on 127.0.0.1, and bad input is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.config import UsageError
from common.reliability import Heartbeat, ResumableArgs, find_checkpoint
from conftest import CPU_DDP, REPO, clean_env, free_port, launch, run_main_in_process

# Long enough to kill between checkpoints (~1 s of steps here), short enough that five runs stay cheap.
LONG = ["--report_to", "none", "--max_steps", "600", "--log_every", "150", "--checkpoint_every", "150"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The uninterrupted reference: 600 steps on 2 ranks."""
    finished = launch("ddp_linear.py", LONG, tmp_path_factory.mktemp("clean") / "run")
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished


def same_parameters(a: dict, b: dict) -> bool:
    return a["weight"] == b["weight"] and a["bias"] == b["bias"]  # float lists compared exactly: bitwise


def test_sigkill_then_resume_is_bitwise_equal_and_logs_each_step_once(clean_run, tmp_path):
    out = tmp_path / "run"
    home = tmp_path / "home"
    home.mkdir()
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_DDP, "--main_process_port", str(free_port()),
               str(REPO / "experiments" / "ddp_linear.py"), "--output_dir", str(out), *LONG]
    victim = subprocess.Popen(command, cwd=REPO, env=clean_env(HOME=str(home)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "step_00000300").exists():
        assert victim.poll() is None and time.monotonic() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.02)
    os.killpg(victim.pid, signal.SIGKILL)  # the whole process group: launcher and both ranks
    victim.wait(timeout=30)
    assert not (out / "summary.json").exists(), "killed too late: the run had finished"

    resumed = launch("ddp_linear.py", [*LONG, "--resume_from_checkpoint", "latest"], out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = resumed.summary
    assert summary["metrics"]["resumed_from_step"] >= 300
    assert same_parameters(summary["metrics"], clean_run.summary["metrics"])
    steps = [r["step"] for r in resumed.metrics]
    assert steps == [150, 300, 450, 600]  # each step exactly once
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(checkpoints) <= 2 and not any(name.endswith(".partial") for name in checkpoints)  # --keep_checkpoints 2


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_elastic_restart_recovers_an_injected_crash(clean_run, tmp_path, launcher):
    """torchrun --standalone --max-restarts 1 + --resume_from_checkpoint latest: rank 1 dies after step 400 in the first
    attempt; torchrun restarts both ranks, they resume from step 300 and finish equal to the clean run."""
    out = tmp_path / "run"
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(HOME=str(home), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    args = [*LONG, "--resume_from_checkpoint", "latest", "--fail_at_step", "400", "--fail_rank", "1"]
    # c10d rendezvous plus TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the static rendezvous restarted ranks
    # connected to the dead attempt's addresses; without the variable they hung (pytorch/pytorch#135712).
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1"]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_DDP, "--main_process_port", str(free_port()),
                   "--rdzv_backend", "c10d", "--max_restarts", "1"]
    command += [str(REPO / "experiments" / "ddp_linear.py"), "--output_dir", str(out), *args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1: injected failure after step 400" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["metrics"]["resumed_from_step"] == 300
    assert same_parameters(summary["metrics"], clean_run.summary["metrics"])
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [150, 300, 450, 600]


def test_a_dead_rank_ends_the_job_fast_and_is_named(tmp_path):
    started = time.monotonic()
    finished = launch("ddp_linear.py", ["--report_to", "none", "--fail_at_step", "30", "--fail_rank", "1"], tmp_path / "run",
                      timeout=120)
    assert finished.returncode != 0 and time.monotonic() - started < 60
    assert "rank 1: injected failure after step 30" in finished.stderr
    assert "exitcode  : 13" in finished.stderr  # torchrun's report of the failed rank


def test_a_stuck_rank_times_out_and_is_named(tmp_path):
    started = time.monotonic()
    args = ["--report_to", "none", "--hang_at_step", "30", "--hang_rank", "1", "--dist_timeout_s", "5"]
    finished = launch("ddp_linear.py", args, tmp_path / "run", timeout=120)
    assert finished.returncode != 0 and time.monotonic() - started < 60
    assert "ranks behind: rank 1 (finished step 30, never entered step 31)" in finished.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_two_machines_rendezvous_on_localhost(tmp_path):
    """machine_rank 0 and 1 of num_machines 2, one process each, through accelerate launch."""
    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    launchers = []
    for machine_rank in (0, 1):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "multi_node_ddp.yaml"),
                   "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1",
                   "--main_process_port", str(port), "--mixed_precision", "no", str(REPO / "experiments" / "ddp_linear.py"),
                   "--output_dir", str(tmp_path / "run"), "--report_to", "none", "--max_steps", "100"]
        launchers.append(subprocess.Popen(command, cwd=REPO, env=clean_env(HOME=str(home)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=180)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["passed"] and summary["world_size"] == 2 and summary["distributed_type"] == "MULTI_CPU"
    assert all(check["passed"] for check in summary["checks"].values())


def test_half_written_checkpoints_are_never_latest(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_00000100").mkdir(parents=True)
    (root / "step_00000100" / "step.json").write_text('{"step": 100}')
    (root / "step_00000200.partial").mkdir()  # killed while saving
    (root / "step_00000300").mkdir()  # no step.json: not complete
    cfg = ResumableArgs(resume_from_checkpoint="latest")
    assert find_checkpoint(cfg, str(tmp_path)) == (str(root / "step_00000100"), 100)
    assert find_checkpoint(ResumableArgs(resume_from_checkpoint="latest"), str(tmp_path / "empty")) == (None, 0)
    with pytest.raises(UsageError, match="is not a complete checkpoint"):
        find_checkpoint(ResumableArgs(resume_from_checkpoint=str(root / "step_00000300")), str(tmp_path))


def test_data_file_without_the_target_column(tmp_path, capsys):
    from experiments.ddp_linear import main

    (tmp_path / "t.csv").write_text("a,b\n1,2\n3,4\n")
    code, stderr = run_main_in_process(main, ["--report_to", "none", "--output_dir", str(tmp_path / "run"), "--data_file", str(tmp_path / "t.csv")], capsys)
    assert code == 2 and "has no target column 'y'; its columns: a, b" in stderr


@pytest.mark.parametrize("config_text", [None, "distributed_type: [oops\n"], ids=["missing", "malformed"])
def test_bad_accelerate_config_is_refused_by_the_launcher(tmp_path, config_text):
    """Accelerate's CLI reads the config before our script runs: it refuses, naming the file (its own
    traceback, not ours), and no result is written."""
    config = tmp_path / "config.yaml"
    if config_text is not None:
        config.write_text(config_text)
    finished = launch("ddp_linear.py", ["--report_to", "none"], tmp_path / "run", config=str(config))
    assert finished.returncode != 0 and str(config) in finished.stderr
    assert not Path(tmp_path / "run" / "summary.json").exists()


def test_slurm_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "slurm_ddp.sbatch")], check=True)


def test_heartbeats_name_the_rank_that_is_behind(tmp_path):
    rank0, rank1 = Heartbeat(str(tmp_path), 0, 2), Heartbeat(str(tmp_path), 1, 2)
    rank1.finished(30)
    rank0.entering(31)  # rank 0 waits inside step 31 for rank 1, which never came
    assert rank0.laggards() == "rank 1 (finished step 30, never entered step 31)"
    assert rank1.laggards() == "none visible from here (the stuck rank may be on another node)"
    (tmp_path / "heartbeat" / "rank1").unlink()
    assert rank0.laggards() == "rank 1 (never reported)"
