"""W&B sweeps (tools/sweep.py): every YAML in sweep_configs/ is valid for its program, bad sweeps (and
values the program would refuse) are refused before any trial, an offline grid runs end to end
through accelerate launch into a leaderboard, and a trial that times out leaves no process behind."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import UsageError
from helpers import REPO, clean_env, fork_the_launches, parse_launch, run_in_process, run_main_in_process
from tools.sweep_run import expand_command, seeded
from tools.sweep_validate import proposable_values, validate_sweep

SWEEP_FILES = sorted((REPO / "sweep_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.name)
def test_every_sweep_file_validates(path, monkeypatch):
    monkeypatch.chdir(REPO)
    sweep = validate_sweep(str(path))
    assert sweep.command[:3] == ["${env}", "accelerate", "launch"] and "${args}" in sweep.command
    assert set(sweep.config["parameters"]) <= set(sweep.flags)


def test_expanded_command_is_what_the_agent_runs(monkeypatch):
    monkeypatch.chdir(REPO)
    sweep = validate_sweep("sweep_configs/ddp_linear_lr.yaml")
    command = expand_command(sweep, {"lr": 0.1, "per_rank_batch_size": 16}, "/tmp/args.json")
    assert command == [
        "/usr/bin/env",
        "accelerate",
        "launch",
        "--config_file",
        "accelerate_configs/cpu_ddp.yaml",
        "experiments/ddp_linear.py",
        "--lr=0.1",
        "--per_rank_batch_size=16",
    ]


BAD = {
    "not yaml": ("program: [unclosed\n", "is not valid YAML"),
    "no metric": (
        "program: experiments/ddp_linear.py\nmethod: grid\nparameters: {lr: {values: [0.1]}}\n",
        "has no 'metric'",
    ),
    "bad method": (
        "program: experiments/ddp_linear.py\nmethod: grd\nmetric: "
        "{name: final_mse}\nparameters: {lr: {values: [0.1]}}\n",
        "breaks W&B's sweep schema: 'grd' is not one of",
    ),
    "not a flag": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: "
        "{name: final_mse}\nparameters: {learning_rate: {values: [0.1]}}\n",
        "parameter 'learning_rate' is not a flag of experiments/ddp_linear.py",
    ),
    "metric never logged": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: "
        "{name: val_acc}\nparameters: {lr: {values: [0.1]}}\n",
        "metric 'val_acc' is never logged by experiments/ddp_linear.py",
    ),
    "one item with two words": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: "
        "{name: final_mse}\nparameters: {lr: {values: [0.1]}}\n"
        'command: ["${env}", "accelerate launch", "${program}", "${args}"]\n',
        "holds several words",
    ),
    "no args": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: "
        "{name: final_mse}\nparameters: {lr: {values: [0.1]}}\n"
        'command: ["${env}", "accelerate", "launch", "${program}"]\n',
        "never passes ${args}",
    ),
    "a value the program refuses": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: {name: final_mse}\n"
        "parameters: {lr: {values: [0.1, abc]}}\n",
        "a trial may run with lr=abc on 1 rank(s), which experiments/ddp_linear.py refuses: argument --lr: invalid "
        "float value: 'abc'",
    ),
    "a negative range": (
        "program: experiments/ddp_linear.py\nmethod: random\nmetric: {name: final_mse}\n"
        "parameters: {lr: {min: -0.5, max: 0.1}}\n",
        "a trial may run with lr=-0.5 on 1 rank(s), which experiments/ddp_linear.py refuses: --lr must be > 0",
    ),
    "a duplicate key": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: {name: final_mse}\n"
        "parameters: {lr: {values: [0.1]}, lr: {values: [0.5]}}\n",
        "is not valid YAML: duplicate key 'lr' in",
    ),
    "a duplicate top-level key": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmethod: random\nmetric: {name: final_mse}\n"
        "parameters: {lr: {values: [0.1]}}\n",
        "is not valid YAML: duplicate key 'method' in",
    ),
    "a flag the command sets after ${args}": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: {name: final_mse}\n"
        "parameters: {lr: {values: [0.1, 0.5]}}\n"
        'command: ["${env}", "${interpreter}", "${program}", "${args}", "--lr=0.2"]\n',
        "command sets --lr itself, which the sweep also sets through ${args}: the last one on the command line wins",
    ),
    "a swept output_dir": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: {name: final_mse}\n"
        "parameters: {output_dir: {values: [a, b]}}\n",
        "parameter 'output_dir' cannot be swept: each trial writes into its own folder",
    ),
    "a swept overwrite": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: {name: final_mse}\n"
        "parameters: {overwrite: {values: [true, false]}}\n",
        "parameter 'overwrite' cannot be swept",
    ),
    "an output_dir in the command": (
        "program: experiments/ddp_linear.py\nmethod: grid\nmetric: {name: final_mse}\n"
        "parameters: {lr: {values: [0.1]}}\n"
        'command: ["${env}", "${interpreter}", "${program}", "--output_dir", "runs/x", "${args}"]\n',
        "command sets --output_dir: each trial writes into its own folder",
    ),
    "not utf-8": (b"program: experiments/ddp_linear.py\nmethod: \xff\xfe\n", "is not UTF-8 text (byte 0xff"),
    "a degree that changes the global batch": (
        "program: experiments/train_gpt.py\nmethod: grid\nmetric: {name: val_loss}\nparameters: {tp: {values: [1, 2]}}\n"
        'command: ["${env}", "torchrun", "--nproc_per_node", "2", "${program}", "${args}"]\n',
        "its trials would train different global batches (tp=1: 8; tp=2: 4 samples a step on 2 rank(s))",
    ),
    "missing program": (
        "program: experiments/nope.py\nmethod: grid\nmetric: {name: final_mse}\nparameters: {lr: {values: [0.1]}}\n",
        "program 'experiments/nope.py' not found",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_sweeps_are_refused(case, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    text, message = BAD[case]
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UsageError) as refused:
        validate_sweep(str(path))
    assert message in str(refused.value)


def test_a_sweep_over_init_from_refuses_a_bad_weights_file_before_any_trial(tmp_path, monkeypatch):
    """train_gpt checks --init_from as it parses its flags (readable, its digest, its architecture): a sweep over
    a truncated file is refused before any trial starts, in the trial's own words."""
    monkeypatch.chdir(REPO)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(b"\x08\x00\x00\x00")
    path = tmp_path / "sweep.yaml"
    path.write_text("program: experiments/train_gpt.py\nmethod: grid\nmetric: {name: val_loss}\n"
                    f"parameters: {{init_from: {{values: ['{truncated}']}}}}\n")  # fmt: skip
    with pytest.raises(UsageError) as refused:
        validate_sweep(str(path))
    assert f"a trial may run with init_from={truncated}" in str(refused.value)
    assert "is not a readable safetensors file" in str(refused.value)


@pytest.mark.launch
def test_cli_refuses_a_bad_sweep_with_one_line_and_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD["not a flag"][0])
    done = subprocess.run(
        [sys.executable, "-m", "tools.sweep", str(path), "--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env=clean_env(HOME=str(tmp_path)),
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "learning_rate" in done.stderr
    assert not (tmp_path / "out" / "trial001").exists()


def test_the_search_is_seeded():
    """Two bayes/random searches with the same --seed propose the same values; another seed does not."""
    from tools.sweep_validate import import_sweeps

    sweeps = import_sweeps()
    config = {
        "method": "random",
        "metric": {"name": "final_mse", "goal": "minimize"},
        "parameters": {"lr": {"distribution": "log_uniform_values", "min": 0.001, "max": 0.3}},
    }

    def proposals(seed):
        return [float(seeded(seed * 1000 + trial, lambda: sweeps.next_run(config, [])).config["lr"]["value"])
                for trial in (1, 2, 3)]  # fmt: skip

    import random

    proposals(
        0
    )  # the engine's first call imports modules that draw from the generators: not part of a proposal
    before = random.getstate()
    assert proposals(0) == proposals(0) != proposals(1)
    assert random.getstate() == before  # and the process's own generator is left as it was
    assert proposable_values(config["parameters"]["lr"]) == [
        0.001,
        0.3,
    ]  # both ends checked against the program


@pytest.mark.launch
def test_a_timed_out_trial_leaves_no_process_and_no_late_writes(tmp_path):
    """The trial's ranks (torchrun puts each in a session of its own) are all ended on the timeout,
    before the trial is reported failed; nothing writes into its folder afterwards."""
    import time

    import psutil

    out = tmp_path / "sweep"
    sweep_file = tmp_path / "slow.yaml"
    sweep_file.write_text(
        (REPO / "sweep_configs" / "ddp_linear_lr.yaml")
        .read_text()
        # a trial that never ends without burning the cores the other tests share: rank 0 sleeps after step 1
        .replace("value: 150", "value: 150\n  hang_at_step:\n    value: 1")
        .replace("values: [0.02, 0.1]", "values: [0.1]")
        .replace("values: [16, 32]", "values: [32]")
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.sweep",
            str(sweep_file),
            "--count",
            "1",
            "--output_dir",
            str(out),
            "--trial_timeout_s",
            "6",  # torchrun and its ranks are up by then, here; a trial caught earlier must leave nothing either
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env=clean_env(HOME=str(tmp_path), NETRC=str(tmp_path / "none")),
    )
    assert "(exit timeout)" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    trial_dir = next(p for p in out.iterdir() if p.is_dir())

    def of_this_sweep(process) -> bool:
        try:
            return process.environ().get("WANDB_SWEEP_ID") == out.name  # every trial process inherits it
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    assert [p.pid for p in psutil.process_iter() if of_this_sweep(p)] == []
    sizes = {p: p.stat().st_size for p in trial_dir.rglob("*") if p.is_file()}
    time.sleep(2)
    assert {p: p.stat().st_size for p in trial_dir.rglob("*") if p.is_file()} == sizes


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, capsys, monkeypatch):
    from tools.sweep import main

    monkeypatch.chdir(REPO)
    (tmp_path / "a_file").write_text("x")
    code, stderr = run_main_in_process(
        main, ["sweep_configs/ddp_linear_lr.yaml", "--output_dir", str(tmp_path / "a_file")], capsys
    )
    assert code == 2 and "exists and is not a directory" in stderr and stderr.strip().count("\n") == 0


@pytest.mark.launch
def test_offline_grid_end_to_end_ranks_only_the_trial_whose_checks_pass(tmp_path, capsys, monkeypatch):
    """An offline grid through accelerate launch, end to end. Two trials that train the same run: the first with
    a truth tolerance no run can meet, so its own check fails. Its metric equals the other's, yet only the verified
    trial is ranked and named best; the failed one is listed with its failed check in the table and the CSV, told
    to the search as failed, and its W&B run tagged."""
    out, home = tmp_path / "sweep", tmp_path / "home"
    home.mkdir()
    sweep_file = tmp_path / "tolerance.yaml"
    sweep_file.write_text(
        (REPO / "sweep_configs" / "ddp_linear_lr.yaml")
        .read_text()
        .replace("values: [0.02, 0.1]", "value: 0.1")
        .replace("per_rank_batch_size:\n    values: [16, 32]", "truth_tolerance:\n    values: [1.0e-9, 0.05]")
        .replace("value: 150", "value: 100")
    )
    # the sweep in this process, its trials' ranks forked (helpers.fork_the_launches: the timed-out trial's test
    # below launches for real); the environment a fresh machine has
    import tools.sweep
    import tools.sweep_run

    forked = fork_the_launches(monkeypatch, tools.sweep_run)
    for name in set(os.environ) - set(clean_env()):  # what clean_env leaves out of a launch's environment
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / "none"))
    finished = run_in_process(tools.sweep.main, [str(sweep_file), "--count", "2"], out, capsys)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    stdout = finished.stdout
    assert [parse_launch(command)[0] for command in forked] == [
        str(REPO / "experiments" / "ddp_linear.py")
    ] * 2
    with open(out / "leaderboard.csv") as handle:
        rows = list(csv.DictReader(handle))
    verified, failed = rows
    assert verified["ranked"] == "True" and verified["truth_tolerance"] == "0.05"
    assert (
        failed["ranked"] == "False"
        and failed["state"] == "failed"
        and failed["failed_checks"] == "recovers_truth"
    )
    assert failed["not_ranked_because"] == "checks failed: recovers_truth"
    assert float(failed["final_mse"]) == pytest.approx(
        float(verified["final_mse"])
    )  # the same run, only unverified
    assert f"best: {verified['trial']}" in stdout and f"best: {failed['trial']}" not in stdout
    assert f"{failed['trial']} failed (exit 1) not ranked: checks failed: recovers_truth" in stdout
    record = json.loads((out / "sweep.json").read_text())
    assert record["best"]["trial"] == verified["trial"]
    assert (out / "leaderboard.png").read_bytes()[:4] == b"\x89PNG"
    tags = {}
    for row in rows:
        summary = json.loads((Path(row["dir"]) / "summary.json").read_text())
        # each trial ran on 2 ranks, every rank got the flags
        assert summary["world_size"] == 2 and summary["passed"] == (row["ranked"] == "True")
        assert summary["config"]["truth_tolerance"] == float(row["truth_tolerance"])
        assert summary["metrics"]["final_mse"] == pytest.approx(float(row["final_mse"]))
        wandb_run = summary["trackers"]["wandb"]
        # the agent's WANDB_RUN_ID, unique per sweep; offline, syncable later
        assert (
            wandb_run["mode"] == "offline"
            and row["trial"].startswith("sweep-")
            and wandb_run["run_id"] == row["trial"]
        )
        inspected = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", wandb_run["run_dir"]],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        inspected = json.loads(inspected.stdout)
        assert inspected["config"]["truth_tolerance"] == float(row["truth_tolerance"])
        tags[row["ranked"]] = inspected.get("tags") or []
    assert "checks_failed" in tags["False"] and "checks_failed" not in tags["True"], tags


def test_no_verified_trial_means_no_best_and_the_search_is_told_each_failed(tmp_path, capsys):
    """A trial that completed with a failed check, one that crashed: neither is ranked, nothing is named best, and
    read_outcome hands the search a failure (no score), with the failed checks' names."""
    from tools.sweep_leaderboard import write_leaderboard
    from tools.sweep_run import read_outcome
    from tools.sweep_validate import Sweep

    completed = tmp_path / "t1"
    completed.mkdir()
    (completed / "summary.json").write_text(json.dumps({
        "completed": True, "metrics": {"val_loss": 1.5},
        "checks": {"loss_decreased": {"passed": True}, "communication_volume": {"passed": False},
                   "matches_single_process": {"passed": None, "skipped": True}},
    }))  # fmt: skip
    crashed = tmp_path / "t2"
    crashed.mkdir()
    assert read_outcome(str(completed), "val_loss") == (
        1.5,
        "checks failed: communication_volume",
        ["communication_volume"],
    )
    assert read_outcome(str(crashed), "val_loss")[:2] == (
        None,
        "no summary.json: it crashed or was ended before its end (see trial.log)",
    )
    sweep = Sweep(
        "s.yaml", {"parameters": {"tp": {"values": [1, 2]}}}, "p.py", ["tp"], "val_loss", "minimize", []
    )
    rows = [
        {"trial": "t1", "state": "failed", "ranked": False, "val_loss": 1.5, "tp": 1, "dir": str(completed)},
        {"trial": "t2", "state": "failed", "ranked": False, "val_loss": None, "tp": 2, "dir": str(crashed)},
    ]
    assert write_leaderboard(sweep, rows, str(tmp_path)) is None
    printed = capsys.readouterr().out
    assert (
        "best:" not in printed
        and "no trial ran to its end and passed every check, so there is no best" in printed
    )
