"""Resume, for real on 2 gloo ranks: kill -9 of every process then resume ends with the clean run's
state at the resume step and at the end; a swapped checkpoint fails its check; an elastic restart
recovers an injected crash; a resumed run continues its W&B run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from experiments.ddp_linear import main
from helpers import (
    CPU_DDP,
    REPO,
    clean_env,
    fork_launch,
    free_port,
    run_in_process,
    start_and_kill_every_process,
)

# Long enough to kill between checkpoints (~1 s of steps here), short enough that five runs stay cheap.
LONG = ["--report_to", "none", "--max_steps", "600", "--log_every", "150", "--checkpoint_every", "150"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The uninterrupted reference: 600 steps on 2 ranks, a state digest at every checkpoint step (forked ranks:
    the launcher is the killed and the restarted runs' matter)."""
    finished = fork_launch(main, LONG, tmp_path_factory.mktemp("clean") / "run")
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished


def same_parameters(a: dict, b: dict) -> bool:
    return a["weight"] == b["weight"] and a["bias"] == b["bias"]  # float lists compared exactly: bitwise


@pytest.mark.launch
def test_kill_every_process_then_resume_equals_the_clean_run_and_continues_its_wandb_run(clean_run, tmp_path):
    """kill -9 of the launcher and both ranks mid-run, then resume: the state right after loading is
    the clean run's at that step, the end state is the clean run's, every step is logged once, and
    W&B (offline, no key) continues the same run, with every check's verdict in its summary."""
    out = tmp_path / "run"
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(HOME=str(home), NETRC=str(home / "none"))
    args = [*LONG, "--report_to", "wandb"]  # the last --report_to wins
    script = str(REPO / "experiments" / "ddp_linear.py")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_DDP,
               "--main_process_port", str(free_port()), script, "--output_dir", str(out), *args]  # fmt: skip
    start_and_kill_every_process(command, env, until=lambda: (out / "checkpoints" / "step_00000300").exists())
    assert not (out / "summary.json").exists(), "killed too late: the run had finished"
    first_wandb_id = (out / "wandb_run_id").read_text()

    resumed = fork_launch(main, [*args, "--resume_from_checkpoint", "latest"], out, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics, clean = resumed.summary["metrics"], clean_run.summary["metrics"]
    step = metrics["resumed_from_step"]
    assert step >= 300
    # the state right after loading IS the clean run's state at that step, and so is the end state
    assert metrics["resumed_state_digest"] == clean["state_digests"][str(step)]
    assert metrics["final_state_digest"] == clean["final_state_digest"]
    assert resumed.summary["checks"]["resume_restored_state"]["passed"]
    assert same_parameters(metrics, clean)
    assert [r["step"] for r in resumed.metrics] == [150, 300, 450, 600]  # each step exactly once
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(checkpoints) <= 2 and not any(
        name.endswith(".partial") for name in checkpoints
    )  # --keep_checkpoints 2

    wandb = resumed.summary["trackers"]["wandb"]
    assert wandb["run_id"] == first_wandb_id and wandb["run_dir"].endswith(first_wandb_id)
    inspected = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", wandb["run_dir"]],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    summary = json.loads(inspected.stdout)["summary"]
    assert summary["passed"] is True and summary["check/matches_single_process"] == "PASS"


def test_a_checkpoint_holding_another_runs_weights_is_refused_before_anything_is_written(tmp_path, capsys):
    """SGD on this convex problem forgets where it started, so the final parameters alone would not
    notice a swapped checkpoint. The file digests recorded at save time do, before anything loads."""
    args = ["--report_to", "none", "--max_steps", "40", "--log_every", "20", "--checkpoint_every", "20"]
    first = run_in_process(main, args, tmp_path / "a", capsys)
    other = run_in_process(main, [*args, "--seed", "1"], tmp_path / "b", capsys)
    assert first.returncode == other.returncode == 0
    (tmp_path / "a" / "summary.json").unlink()  # as if killed after its step-20 checkpoint
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "step_00000040")  # (the finished run's last one)
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000020"
    shutil.copy(
        tmp_path / "b" / "checkpoints" / "step_00000020" / "model.safetensors",
        checkpoint / "model.safetensors",
    )
    before = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir() if p.is_file()}
    resumed = run_in_process(main, [*args, "--resume_from_checkpoint", "latest"], tmp_path / "a", capsys)
    assert resumed.returncode == 2 and resumed.stderr.strip().count("\n") == 0, resumed.stderr
    assert (
        "no checkpoint in" in resumed.stderr
        and "model.safetensors differs from what was written" in resumed.stderr
    )
    assert {
        p.name: p.read_bytes() for p in (tmp_path / "a").iterdir() if p.is_file()
    } == before  # nothing written


@pytest.mark.launch
def test_elastic_restart_recovers_an_injected_crash(clean_run, tmp_path):
    """accelerate launch --rdzv_backend c10d --max_restarts 1 + --resume_from_checkpoint latest: rank 1 dies after
    step 400 in the first attempt; the launcher (torch's elastic agent, as torchrun's) restarts both ranks, they
    resume from step 300 and finish equal to the clean run. (The torchrun command of docs/reliability.md is the
    same agent with the same rendezvous; it is not run here, to keep the suite's time.)"""
    out = tmp_path / "run"
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(HOME=str(home), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    args = [*LONG, "--resume_from_checkpoint", "latest", "--fail_at_step", "400", "--fail_rank", "1"]
    # c10d rendezvous plus TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the static rendezvous restarted ranks
    # connected to the dead attempt's addresses; without the variable they hung (pytorch/pytorch#135712).
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_DDP, "--main_process_port",
               str(free_port()), "--rdzv_backend", "c10d", "--max_restarts", "1",
               str(REPO / "experiments" / "ddp_linear.py"), "--output_dir", str(out), *args]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1: injected failure after step 400" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["metrics"]["resumed_from_step"] == 300
    assert same_parameters(summary["metrics"], clean_run.summary["metrics"])
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [150, 300, 450, 600]
