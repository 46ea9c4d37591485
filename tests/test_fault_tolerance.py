"""experiments/fault_tolerance.py for real: torchft's lighthouse, replica groups as processes, groups SIGKILLed and
replaced while the others go on. A run with failures passes every check (parameters equal one process to the bit,
every sample once, every failure survived, no survivor restarted); each check fails on the mistake it exists for;
DiLoCo reports its bytes against DDP's; bad input is one line; no process outlives the run."""

from __future__ import annotations

import json
import socket

import psutil
import pytest
import torch

from common.gpt import GPTConfig, build_gpt, lm_loss
from experiments.fault_tolerance import main
from helpers import run_in_process, run_main_in_process
from strategies.ft import share_of

# a 40-step run of a 32-wide GPT; survivors wait 2 s (not 5) for a peer that died inside their quorum
TINY = ["--report_to", "none", "--max_steps", "40", "--global_batch_size", "6", "--micro_batch_size", "1",
        "--d_model", "32", "--step_timeout_s", "2", "--rejoin_timeout_s", "40"]  # fmt: skip


def alive(summary: dict) -> list[int]:
    """The processes a run started that are still running (none should be: killed, finished or ended)."""
    running = []
    for pid in summary["metrics"]["started_pids"]:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def test_the_groups_share_the_micro_batches_whole_however_many_are_alive():
    for micro_batches in (4, 6, 7):
        for groups in range(1, micro_batches + 1):
            shares = [list(share_of(micro_batches, groups, rank)) for rank in range(groups)]
            assert sum(shares, []) == list(range(micro_batches))  # every micro-batch once, in order
            assert all(shares), (micro_batches, groups)  # and every live group has one


def test_the_float64_sum_of_micro_batch_gradients_does_not_depend_on_who_computed_which():
    """The premise of exact accumulation (strategies/job.py): 3 groups' float64 sums, or 2 groups', added in any
    order, are the one-process sum to the bit once rounded to float32 (a float32 accumulation would not be)."""
    model = build_gpt(GPTConfig(64, 16, 2, 2, 32), 0)
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 64, (6, 16), generator=generator) for _ in range(2))

    def gradient(m: int) -> torch.Tensor:  # micro-batch m's gradient, its loss / the 6 micro-batches
        model.zero_grad(set_to_none=True)
        (lm_loss(model(x[m : m + 1]), y[m : m + 1]) / 6).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    gradients = [gradient(m) for m in range(6)]
    whole = sum(g.double() for g in gradients).float()
    for groups in (2, 3, 6):
        shares = [sum(gradients[m].double() for m in share_of(6, groups, r)) for r in range(groups)]
        assert torch.equal(sum(reversed(shares)).float(), whole), groups
    in_float32 = sum(gradients[m] for m in (5, 4, 3, 2, 1, 0))
    assert not torch.equal(in_float32, whole)  # the order matters in float32: why the sums are float64


@pytest.mark.launch
def test_two_failures_change_the_time_not_the_result_with_fsdp_inside_each_group(tmp_path, capsys):
    """Fault-tolerant HSDP: 2 replica groups of 2 FSDP ranks; one group killed, then its replacement killed while
    it heals; every check passes, the parameters equal one process's to the bit. (Plain replicas, --dp_shard 1,
    pass every check but the one their mistake fails in test_each_mistake_fails_its_check.)"""
    args = [*TINY, "--replica_groups", "2", "--dp_shard", "2", "--failures", "2", "--global_batch_size", "8"]
    finished = run_in_process(main, args, tmp_path / "run", capsys)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    checks = finished.summary["checks"]
    assert all(
        checks[name]["passed"] for name in ("matches_one_process", "every_sample_once", "failures_survived")
    ), checks
    metrics = finished.summary["metrics"]
    assert (
        metrics["failures_injected"] == metrics["failures_survived"] == 2
        and metrics["survivor_restarts"] == 0
    )
    assert "= 0.00e+00" in checks["matches_one_process"]["detail"]  # to the bit, two failures or none
    assert metrics["committed_steps"] == metrics["full_steps"] + metrics["degraded_steps"] == 40
    assert metrics["allreduce_bytes_match_theory"]
    assert all(seconds is not None for seconds in metrics["recover_s"])
    events = [
        json.loads(line)
        for path in (tmp_path / "run" / "groups").glob("*/ft_events/*.jsonl")
        for line in path.read_text().splitlines()
    ]
    replacements = {p["pid"] for p in metrics["processes"] if p["why"] != "initial"}
    healed = {
        (e["pid"], e["rank"])
        for e in events
        if e["event"] == "healed" and e["group"] == metrics["kills"][0]["group"]
    }
    assert {rank for _, rank in healed} == {0, 1}  # each FSDP rank took its own shard from its peer rank
    assert any(e["event"] == "healed" and e["pid"] in replacements for e in events)  # state from a peer
    assert (tmp_path / "run" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert alive(finished.summary) == []


@pytest.mark.launch
@pytest.mark.parametrize(
    ("variant", "failing"),
    [
        ("own_data_position", {"every_sample_once", "matches_one_process"}),
        ("average_over_groups", {"matches_one_process"}),
        ("replacement_hangs", {"failures_survived"}),
    ],
)
def test_each_mistake_fails_its_check(tmp_path, capsys, variant, failing):
    args = [
        *TINY,
        "--replica_groups",
        "2",
        "--failures",
        "0" if variant == "average_over_groups" else "1",  # AVG is wrong in every step, with or without one
        "--wrong_variant",
        variant,
        "--rejoin_timeout_s",
        "6" if variant == "replacement_hangs" else "15",  # how long the hung replacement is waited for
    ]
    finished = run_in_process(main, args, tmp_path / "run", capsys)
    assert finished.returncode == 1, finished.stdout[-3000:] + finished.stderr[-3000:]
    checks = finished.summary["checks"]
    assert {name for name, check in checks.items() if check["passed"] is False} == failing, checks
    if variant == "replacement_hangs":  # named, and the survivor finished the run
        assert "given up on: [{'group': " in checks["failures_survived"]["detail"]
        assert finished.summary["metrics"]["committed_steps"] == 40
    assert alive(finished.summary) == []


@pytest.mark.launch
def test_diloco_sends_a_fraction_of_ddps_bytes_and_survives_a_failure(tmp_path, capsys):
    args = [*TINY, "--algorithm", "diloco", "--sync_every", "4", "--replica_groups", "2", "--failures", "1"]
    finished = run_in_process(main, args, tmp_path / "run", capsys)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    checks, metrics = finished.summary["checks"], finished.summary["metrics"]
    assert checks["matches_one_process"]["skipped"] and checks["failures_survived"]["passed"]
    assert 0 < metrics["bytes_vs_ddp"] < 0.5  # a sync every 4 steps (and a redone one) against one every step
    assert metrics["val_loss"] > 0 and metrics["val_loss_ddp"] > 0
    assert alive(finished.summary) == []


def test_bad_input_is_one_line(tmp_path, capsys):
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--replica_groups", "0"], "--replica_groups must be > 0"),
            (["--failures", "30"], "--failures 30: at most 10 in 40 steps"),
            (["--replica_groups", "1", "--failures", "1"], "a failure needs a healthy group to recover from"),
            (["--replica_groups", "4"], "--global_batch_size 6 must be a multiple of --micro_batch_size x "),
            (
                ["--micro_batch_size", "4"],
                "--global_batch_size 6 must be a multiple of --micro_batch_size x ",
            ),
            (["--dp_shard", "4"], "--global_batch_size 6 must be a multiple of --micro_batch_size x "),
            (
                ["--algorithm", "diloco", "--dp_shard", "2", "--failures", "0"],
                "DiLoCo runs plain replicas here",
            ),
            (["--step_timeout_s", "1e308"], "--step_timeout_s must be <= 604800"),
            (["--wrong_variant", "nope"], "--wrong_variant 'nope': known:"),
            # the model through train_gpt's own checks (it ran, or crashed after starting the groups, before)
            (["--vocab_size", "0"], "--vocab_size must be >= 260 (256 bytes + merges), got 0"),
            (["--d_model", "0"], "--d_model must be > 0, got 0"),
            (["--n_head", "3"], "--n_head 3 must divide --d_model 32"),
            (["--block_size", "0"], "--block_size must be > 0, got 0"),
            (
                ["--lighthouse_port", str(port)],
                f"--lighthouse_port {port}: the lighthouse cannot listen there",
            ),
        ]
        for args, message in cases:
            output_dir = tmp_path / "r"
            code, stderr = run_main_in_process(main, ["--output_dir", str(output_dir), *TINY, *args], capsys)
            assert code == 2 and message in stderr and stderr.strip().count("\n") == 0, (args, stderr)
            assert not output_dir.exists(), args  # refused before anything was written


@pytest.mark.launch
@pytest.mark.parametrize("when", ["before_the_groups_are_placed", "while_they_train"])
def test_no_process_outlives_a_launcher_killed_by_sigkill(tmp_path, when):
    """The launcher (and the lighthouse it holds) SIGKILLed, with no chance to end its children: 10 s later none of
    the processes it started is left (the groups' processes, the spares, the fork server, the resource tracker)."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import REPO, clean_env

    run = tmp_path / "run"
    command = [sys.executable, str(REPO / "experiments" / "fault_tolerance.py"), "--output_dir", str(run), *TINY,
               "--max_steps", "400", "--replica_groups", "2", "--failures", "1"]  # fmt: skip
    launcher = subprocess.Popen(command, cwd=REPO, env=clean_env(HOME=str(tmp_path)), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    started, descendants = time.monotonic(), []
    try:
        while time.monotonic() - started < 90:
            descendants = psutil.Process(launcher.pid).children(recursive=True)
            events = list(run.glob("groups/*/ft_events/*.jsonl"))
            ready = len(descendants) >= 4 if when == "before_the_groups_are_placed" else any(
                '"commit"' in path.read_text() for path in events)  # fmt: skip
            if ready:
                break
            time.sleep(0.2)
        assert descendants, "the launcher started no process within 90 s"
        if when == "before_the_groups_are_placed":
            assert not list(run.glob("spare*.go")), "too late: a group was already placed"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        left = descendants
        while left and time.monotonic() < deadline:
            left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.2)
        assert not left, [(p.pid, " ".join(p.cmdline())[:120]) for p in left]
    finally:  # whatever a failure left (reparented to init: no longer this test's children)
        for process in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def write_environment_variable(argv: list[str]) -> int:
    """A group's main: writes the variable argv[1] as its process sees it to the file argv[0]."""
    import os

    with open(argv[0], "w") as handle:
        handle.write(os.environ.get(argv[1], "<unset>"))
    return 0


@pytest.mark.launch
def test_a_group_starts_with_the_launchers_environment(tmp_path, monkeypatch):
    """A replica group's process sees the launcher's environment when it starts the group, not the fork server's
    (started once, maybe long before: a variable set after it, DIST_REHEARSAL say, would not reach the ranks)."""
    import multiprocessing

    from common.processes import RankGroup

    context = multiprocessing.get_context("forkserver")
    started = RankGroup(context, write_environment_variable, [str(tmp_path / "before"), "FT_PROBE"], 1, [],
                        str(tmp_path / "before"))  # fmt: skip
    started.processes[0].join(timeout=60)  # the fork server is up (this test process's: one a process)
    monkeypatch.setenv("FT_PROBE", "set after the fork server started")
    group = RankGroup(context, write_environment_variable, [str(tmp_path / "seen"), "FT_PROBE"], 1, [],
                      str(tmp_path / "group"))  # fmt: skip
    group.processes[0].join(timeout=60)
    assert group.processes[0].exitcode == 0 and (tmp_path / "before").read_text() == "<unset>"
    assert (tmp_path / "seen").read_text() == "set after the fork server started"
