"""Reliability, for real on 2 gloo ranks: kill-and-resume gives bitwise-equal parameters, a dead or
stuck rank ends the job in bounded time with the rank named, an elastic restart recovers, two
"machines" rendezvous on 127.0.0.1, and bad input is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.reliability import Heartbeat, OutputLock
from helpers import REPO, clean_env, free_port, launch, run_in_process, run_main_in_process


@pytest.mark.launch
def test_a_dead_rank_ends_the_job_fast_and_is_named(tmp_path):
    started = time.monotonic()
    finished = launch(
        "ddp_linear.py",
        ["--report_to", "none", "--fail_at_step", "30", "--fail_rank", "1"],
        tmp_path / "run",
        timeout=120,
    )
    assert finished.returncode != 0 and time.monotonic() - started < 60
    assert "rank 1: injected failure after step 30" in finished.stderr
    assert "exitcode  : 13" in finished.stderr  # torchrun's report of the failed rank


@pytest.mark.launch
def test_a_stuck_rank_times_out_and_is_named(tmp_path):
    started = time.monotonic()
    args = ["--report_to", "none", "--hang_at_step", "30", "--hang_rank", "1", "--dist_timeout_s", "5"]
    finished = launch("ddp_linear.py", args, tmp_path / "run", timeout=120)
    assert finished.returncode != 0 and time.monotonic() - started < 60
    assert "ranks behind: rank 1 (finished step 30, never entered step 31)" in finished.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.launch
def test_two_machines_rendezvous_on_localhost(tmp_path):
    """machine_rank 0 and 1 of num_machines 2, one process each, through accelerate launch."""
    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    launchers = []
    for machine_rank in (0, 1):
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "accelerate_configs" / "multi_node_ddp.yaml"),
            "--num_machines",
            "2",
            "--num_processes",
            "2",
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "--mixed_precision",
            "no",
            str(REPO / "experiments" / "ddp_linear.py"),
            "--output_dir",
            str(tmp_path / "run"),
            "--report_to",
            "none",
            "--max_steps",
            "100",
        ]
        launchers.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env=clean_env(HOME=str(home)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=180)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["passed"] and summary["world_size"] == 2 and summary["distributed_type"] == "MULTI_CPU"
    assert all(check["passed"] for check in summary["checks"].values())


@pytest.mark.parametrize("config_text", [None, "distributed_type: [oops\n"], ids=["missing", "malformed"])
@pytest.mark.launch
def test_bad_accelerate_config_is_refused_by_the_launcher(tmp_path, config_text):
    """Accelerate's CLI reads the config before our script runs: it refuses, naming the file (its own
    traceback, not ours), and no result is written."""
    config = tmp_path / "config.yaml"
    if config_text is not None:
        config.write_text(config_text)
    finished = launch("ddp_linear.py", ["--report_to", "none"], tmp_path / "run", config=str(config))
    assert finished.returncode != 0 and str(config) in finished.stderr
    assert not Path(tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("script,experiment", [("slurm_ddp.sbatch", "ddp_linear.py"),
                                               ("slurm_train_gpt.sbatch", "train_gpt.py")])  # fmt: skip
def test_a_slurm_script_hands_every_flag_over_whole_and_each_node_its_rank(tmp_path, script, experiment):
    """The script under stand-ins for srun (two nodes, each its SLURM_NODEID), scontrol and accelerate (which
    writes the arguments it got, one a line): a flag with a space reaches the experiment as one argument."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "srun": 'while [[ "$1" == --* ]]; do shift; done\nfor node in 0 1; do SLURM_NODEID=$node "$@"; done',
        "scontrol": "printf 'node-a\\nnode-b\\n'",
        "accelerate": f'printf "%s\\n" "$@" > {tmp_path}/args.$SLURM_NODEID',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"}  # fmt: skip
    subprocess.run(["bash", str(REPO / "scripts" / script), "--text_files", "a b.txt", "--max_steps", "7"],
                   cwd=REPO, env=env, check=True, timeout=30)  # fmt: skip
    for node in (0, 1):
        args = (tmp_path / f"args.{node}").read_text().splitlines()
        assert args[args.index("--machine_rank") + 1] == str(node)
        assert (
            args[args.index("--num_processes") + 1] == "8"
            and args[args.index("--main_process_ip") + 1] == "node-a"
        )
        assert args[args.index("--max_restarts") + 1] == "0"  # a failure ends the job: resubmitting resumes
        assert f"experiments/{experiment}" in args and "latest" in args
        assert args[-4:] == ["--text_files", "a b.txt", "--max_steps", "7"]  # whole, in order, last


def test_heartbeats_name_the_rank_that_is_behind(tmp_path):
    rank0, rank1 = Heartbeat(str(tmp_path), 0, 2), Heartbeat(str(tmp_path), 1, 2)
    rank1.finished(30)
    rank0.entering(31)  # rank 0 waits inside step 31 for rank 1, which never came
    assert rank0.laggards() == "rank 1 (finished step 30, never entered step 31)"
    assert rank1.laggards() == "none visible from here (the stuck rank may be on another node)"
    (tmp_path / "heartbeat" / "rank1").unlink()
    assert rank0.laggards() == "rank 1 (never reported)"


# ------------------------------------------------------------------ no run lost or silently wrong (in-process)

QUICK = ["--report_to", "none", "--max_steps", "40", "--log_every", "20"]


def ddp_linear(argv: list[str], output_dir: Path, capsys):
    from experiments.ddp_linear import main

    return run_in_process(main, [*QUICK, *argv], output_dir, capsys)


def test_resume_latest_never_overwrites_a_finished_run(tmp_path, capsys):
    """The README's elastic command into a folder that holds a finished run without checkpoints."""
    first = ddp_linear([], tmp_path / "run", capsys)
    before = (tmp_path / "run" / "summary.json").read_text()
    other = ddp_linear(["--resume_from_checkpoint", "latest", "--lr", "0.05"], tmp_path / "run", capsys)
    assert first.returncode == 0 and other.returncode == 2
    assert (
        "already holds a finished run with other settings (--lr: 0.1 in that run, 0.05 now)" in other.stderr
    )
    same = ddp_linear(["--resume_from_checkpoint", "latest"], tmp_path / "run", capsys)
    assert same.returncode == 0 and "already finished (summary.json); nothing to resume" in same.stdout
    assert (tmp_path / "run" / "summary.json").read_text() == before


def test_a_second_run_into_a_busy_folder_is_refused_naming_the_holder(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    # what a live run has written so far: its config.json, no summary.json (it is not an earlier run that did not
    # finish, which is what the folder was called when the lock was looked at after the folder's files)
    (tmp_path / "run" / "config.json").write_text("{}")
    holder = OutputLock(str(tmp_path / "run"))
    holder.acquire()  # as the main process of a running job holds it
    try:
        refused = ddp_linear([], tmp_path / "run", capsys)
    finally:
        holder.release()
    assert refused.returncode == 2 and f"is in use by another run (pid {os.getpid()})" in refused.stderr
    assert "did not finish" not in refused.stderr and refused.stderr.count("\n") == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    (tmp_path / "run" / "config.json").unlink()  # (the live run would have finished and written summary.json)
    assert ddp_linear([], tmp_path / "run", capsys).returncode == 0  # free again once the holder is gone


@pytest.fixture(scope="module")
def killed_after_step_20(tmp_path_factory) -> Path:
    """A 30-step ddp_linear run with a checkpoint at step 20, its summary removed: as if killed after it."""
    from experiments.ddp_linear import main

    out = tmp_path_factory.mktemp("killed") / "run"
    finished = run_main_in_process(main, [*QUICK, "--checkpoint_every", "20", "--max_steps", "30", "--output_dir", str(out)],
                                   capsys=None)  # fmt: skip
    assert finished[0] == 0
    (out / "summary.json").unlink()
    return out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max_steps", "20"], "--max_steps 20: the checkpoint"),
        (["--max_steps", "60", "--lr", "0.2"], "--lr: 0.1 in the checkpoint, 0.2 now"),
        (
            ["--max_steps", "60", "--per_rank_batch_size", "16"],
            "--per_rank_batch_size: 32 in the checkpoint, 16 now",
        ),
        (
            ["--max_steps", "60", "--gradient_accumulation_steps", "2"],
            "--gradient_accumulation_steps: 1 in the checkpoint, 2 now",
        ),
        (["--max_steps", "60", "--expected_world_size", "2"], "world_size: 1 in the checkpoint, 2 now"),
    ],
)
def test_a_resume_whose_settings_differ_is_refused(killed_after_step_20, tmp_path, argv, message, capsys):
    out = tmp_path / "run"
    shutil.copytree(killed_after_step_20, out)
    refused = ddp_linear(
        ["--checkpoint_every", "20", "--resume_from_checkpoint", "latest", *argv], out, capsys
    )
    assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and not (out / "summary.json").exists()


@pytest.mark.parametrize(
    ("make_bad_dir", "message"),
    [
        (lambda tmp: "/proc/no/such/dir", "cannot write there"),
        (lambda tmp: str(_file(tmp) / "sub"), "cannot write there"),
        (lambda tmp: str(_file(tmp)), "exists and is not a directory"),
    ],
    ids=["under-proc", "under-a-file", "a-file"],
)
def test_an_unwritable_output_dir_is_one_line(tmp_path, make_bad_dir, message, capsys):
    from experiments.ddp_linear import main

    code, stderr = run_main_in_process(main, [*QUICK, "--output_dir", make_bad_dir(tmp_path)], capsys)
    assert code == 2 and message in stderr and stderr.strip().count("\n") == 0


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


def test_a_diverging_run_stops_at_the_first_log_interval_with_a_non_finite_loss(tmp_path, capsys):
    """The loss is read where it is logged (a GPU run waits for the device at each read): the first interval
    holding a non-finite loss stops the run."""
    finished = ddp_linear(
        ["--lr", "1e30", "--max_steps", "200", "--log_every", "5"], tmp_path / "run", capsys
    )
    assert finished.returncode == 2 and finished.stderr.strip().count("\n") == 0
    assert "training diverged; lower --lr (now 1e+30)" in finished.stderr and "at step " in finished.stderr
    step = int(finished.stderr.split("at step ")[1].split()[0])
    assert step == 5  # the first log interval, not after 200 steps of NaN
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.launch
def test_a_full_disk_keeps_the_last_complete_checkpoint(tmp_path):
    """2 ranks, checkpoints on a 160 KiB tmpfs: the first fits, a later one fills the disk. The ranks agree
    on the failure; the main one says it in one line naming the folder and the newest complete checkpoint
    kept (no rank's traceback); the half-written one is removed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = tmp_path / "run"
        out.mkdir()
        (out / "checkpoints").symlink_to(disk)
        args = [*QUICK, "--checkpoint_every", "10", "--max_steps", "200", "--keep_checkpoints", "1000"]
        finished = launch("ddp_linear.py", args, out)
        complete = sorted(p.name for p in disk.iterdir())
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)
    ours = [line for line in finished.stderr.splitlines() if "could not write the step-" in line]
    assert finished.returncode != 0 and len(ours) == 1, finished.stderr[-3000:]
    assert "(disk full); newest complete checkpoint kept: step_" in ours[0]
    assert "[rank0]" not in finished.stderr and "[rank1]" not in finished.stderr  # no rank's traceback
    assert complete and not any(name.endswith(".partial") for name in complete)
    assert not (out / "summary.json").exists()


def test_a_full_disk_under_metrics_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    finished = ddp_linear([], out, capsys)
    assert (
        finished.returncode == 2 and "could not write" in finished.stderr and "disk full" in finished.stderr
    )
    assert finished.stderr.strip().count("\n") == 0


def test_pipeline_refusals_come_before_any_output(tmp_path, capsys):
    from experiments.pipeline_parallel import main

    for argv in (["--schedule", "1f1b", "--n_microbatches", "1"], ["--n_layers", "1"], []):
        code, stderr = run_main_in_process(
            main, ["--report_to", "wandb", "--output_dir", str(tmp_path / "run"), *argv], capsys
        )
        assert code == 2 and stderr.strip().count("\n") == 0
        assert not (tmp_path / "run").exists()  # no folder, no config.json, no W&B run


@pytest.mark.launch
def test_a_multi_cpu_config_that_starts_one_process_is_refused(tmp_path):
    """accelerate 1.16: `distributed_type: MULTI_CPU`, num_processes 2, no mpirun -> ONE process. It would
    pass every check as a 1-rank run; it is refused with the fix instead."""
    config = tmp_path / "multi_cpu.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\nnum_machines: 1\n"
        "machine_rank: 0\nuse_cpu: true\nmixed_precision: 'no'\n"
    )
    finished = launch("ddp_linear.py", QUICK, tmp_path / "run", config=str(config))
    assert (
        finished.returncode != 0
        and "MULTI_CPU` needs mpirun; use accelerate_configs/cpu_ddp.yaml" in finished.stderr
    )
    assert not (tmp_path / "run" / "summary.json").exists()
