"""Faults a user would lose work to (issue #39), each fixed and shown here failing without its fix, in-process
(no launch): a crashed sweep trial is never ranked; resuming at another world size keeps or refuses the global
batch, never changes it silently; a finished run re-run is a no-op; a read error is not corruption (nothing
moved); a checkpoint pruned between verification and load is one line; sweeps are validated trial by trial as
they will run; a second rejection keeps the first; a refusal is said by one rank; a full disk leaves no
temporary file; a fresh run never overwrites an unfinished one's files. The tp <-> fsdp resharding runs are
tests/test_train_gpt_checkpoints.py's chain."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from test_checkpoint import make_checkpoint

from common.checkpoint import (
    CheckpointUnreadable,
    ResumableArgs,
    find_checkpoint,
    load_checkpoint,
    refuse_incompatible,
    tidy_checkpoints,
)
from common.config import UsageError
from experiments.train_gpt import Config
from experiments.train_gpt import main as train_gpt
from helpers import GPT_TINY, run_in_process, run_main_in_process
from tools import sweep_leaderboard, sweep_run, sweep_validate


# ------------------------------------------------------------------------ 2: a crashed trial is never ranked
def trial(folder: Path, summary: dict | None, logged: float | None) -> str:
    folder.mkdir(parents=True)
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    if logged is not None:
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 5, "tokens_per_s": logged}) + "\n")
    return str(folder)


def test_a_trial_that_did_not_run_to_its_end_is_failed_and_never_ranked(tmp_path, capsys):
    crashed = trial(
        tmp_path / "crashed", None, logged=9e9
    )  # metrics.jsonl, no summary: exit 1 under a launcher
    early = trial(tmp_path / "early", {"completed": False, "metrics": {"tokens_per_s": 8e9}}, None)
    done = trial(tmp_path / "done", {"completed": True, "metrics": {"tokens_per_s": 1000.0}}, None)
    assert sweep_run.read_outcome(crashed, "tokens_per_s")[0] is None
    assert "no summary.json" in sweep_run.read_outcome(crashed, "tokens_per_s")[1]
    assert sweep_run.read_outcome(early, "tokens_per_s") == (
        None,
        "it ended early (summary.json: completed false; see its checks)",
        [],
    )
    assert sweep_run.read_outcome(done, "tokens_per_s") == (1000.0, None, [])
    rows = [{"trial": name, "state": state, "ranked": state == "finished", sweep_metric: value, "fail_at_step": step}
            for name, state, value, step in (("crashed", "failed", None, 5), ("done", "finished", 1000.0, 0))
            for sweep_metric in ("tokens_per_s",)]  # fmt: skip
    config = {"parameters": {"fail_at_step": {"values": [0, 5]}}}
    best = sweep_leaderboard.write_leaderboard(sweep_validate.Sweep("s.yaml", config, "p.py", [], "tokens_per_s", "maximize", []),
                                   rows, str(tmp_path))  # fmt: skip
    assert best["trial"] == "done" and "best: done" in capsys.readouterr().out


def test_summary_json_says_whether_a_run_ran_to_its_end(tmp_path, capsys):
    # a check failed (4 steps are too few for the loss to fall by 0.1), but the run ran to its end (a sweep still
    # never ranks it: its result is not verified)
    args = [*GPT_TINY, "--max_steps", "4", "--parity_steps", "0"]
    finished = run_in_process(train_gpt, args, tmp_path / "r", capsys)
    assert finished.returncode == 1 and finished.summary["completed"] is True


# ------------------------------------------------- 3: resuming at another world size keeps the global batch
def test_a_resume_that_would_change_the_global_batch_is_refused_naming_both_figures(tmp_path):
    two_ranks = Config(strategy="fsdp", expected_world_size=2)
    two_ranks.resolve_layout(2)
    one = Config(strategy="none")
    one.resolve_layout(1)
    meta = {"step": 4, "trajectory": two_ranks.trajectory(2), "layout": {}, "world_size": 2, "data": {}}
    with pytest.raises(UsageError) as refused:
        refuse_incompatible(one, "ckpt", meta, 1, {})
    assert ("global_batch_size: 8 in the checkpoint, 4 now (--per_rank_batch_size 4 x --gradient_accumulation_steps 1 "
            "x 1 data-parallel rank(s); --gradient_accumulation_steps 2 keeps it)") in str(refused.value)  # fmt: skip
    kept = Config(strategy="none", gradient_accumulation_steps=2)
    kept.resolve_layout(1)
    refuse_incompatible(kept, "ckpt", meta, 1, {})  # 4 rows x 2 micro-batches x 1 rank: the same 8 samples


# ------------------------------------------------------------------ 4: a finished run re-run is a no-op
def test_a_finished_run_resumed_with_its_own_command_is_a_no_op(tmp_path, capsys):
    args = [*GPT_TINY, "--max_steps", "8", "--parity_steps", "0", "--checkpoint_every", "4"]
    assert run_in_process(train_gpt, args, tmp_path / "run", capsys).returncode == 0
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [
        "step_00000004",
        "step_00000008",
    ]  # #40: the end
    again = run_in_process(train_gpt, [*args, "--resume_from_checkpoint", "latest"], tmp_path / "run", capsys)
    assert again.returncode == 0 and "already finished (summary.json); nothing to resume" in again.stdout


def test_a_fresh_run_never_overwrites_an_unfinished_runs_files(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 3, "loss": 5.0}\n')
    code, stderr = run_main_in_process(train_gpt, [*GPT_TINY, "--output_dir", str(run)], capsys)
    assert code == 2 and "holds an earlier run that did not finish (metrics.jsonl" in stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 3, "loss": 5.0}\n'


# --------------------------------------------------------------------- 5: a read error is not corruption
def test_an_unreadable_file_stops_the_run_in_one_line_and_moves_nothing(tmp_path, monkeypatch):
    newer = make_checkpoint(tmp_path, 8)
    make_checkpoint(tmp_path, 4)
    shard = newer / "state" / "__0_0.distcp"
    real_open = open

    def denied(path, *args, **kwargs):  # root reads any file whatever its mode: the error is injected
        if str(path) == str(shard):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", denied)
    with pytest.raises(CheckpointUnreadable) as refused:
        find_checkpoint(ResumableArgs(resume_from_checkpoint="latest"), str(tmp_path))
    assert f"cannot read {shard} (Permission denied): a read error, not a damaged checkpoint" in str(
        refused.value
    )
    assert newer.exists() and not (tmp_path / "checkpoints" / "rejected").exists()


def test_an_unreadable_checkpoints_folder_is_one_line(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, 4)
    real_listdir = os.listdir

    def denied(path):
        if str(path).endswith("checkpoints"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", denied)
    with pytest.raises(CheckpointUnreadable, match="cannot read .*checkpoints \\(Permission denied\\)"):
        find_checkpoint(ResumableArgs(resume_from_checkpoint="latest"), str(tmp_path))


# ---------------------------------------------------- 7: a checkpoint pruned between verification and load
def test_a_checkpoint_gone_before_it_was_loaded_is_one_line(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    gone = tmp_path / "step_00000004"

    class Pruned:
        def load(self, folder, same_layout):
            raise CheckpointException("load", {0: (FileNotFoundError(errno.ENOENT, "No such file"), None)})

    with pytest.raises(UsageError, match="was verified, then disappeared while it was loaded"):
        load_checkpoint(Pruned(), str(gone), same_layout=True)


# -------------------------------------------------------------- 8: sweeps validated as their trials will run
def write_sweep(tmp_path: Path, **overrides) -> str:
    config = {"program": "experiments/train_gpt.py", "method": "grid", "metric": {"name": "val_loss", "goal": "minimize"},
              "parameters": {"max_steps": {"value": 12}, "parity_steps": {"value": 3}, "strategy": {"value": "ddp"}},
              "command": ["${env}", "accelerate", "launch", "--config_file", "accelerate_configs/cpu_ddp.yaml",
                          "${program}", "${args}"]}  # fmt: skip
    config.update(overrides)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_sweep_is_valid_when_each_trial_is_and_the_launch_has_the_ranks(tmp_path):
    # --max_steps 12 alone is refused (the default --parity_steps 15 > 12), and ddp alone needs 2 ranks: together,
    # under the 2-rank launch the command makes, the trial is fine
    assert sweep_validate.validate_sweep(write_sweep(tmp_path)).metric == "val_loss"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parameters": [{"lr": 0.1}]}, "parameters must be a mapping of flag names to their specs"),
        ({"parameters": None}, "parameters must be a mapping of flag names"),
        ({"parameters": {"lr": 0.001}}, "parameter 'lr' must be a mapping such as {value: 0.001}"),
        ({"program": "scripts/slurm_train_gpt.sh"}, "is not a Python file"),
        ({"parameters": {"max_steps": {"value": 12}}}, "a trial may run with max_steps=12 on 2 rank(s), which "
         "experiments/train_gpt.py refuses: argument --parity_steps must be in [0, --max_steps], got 15"),
    ],
)  # fmt: skip
def test_a_broken_sweep_is_one_line(tmp_path, overrides, message):
    with pytest.raises(UsageError) as refused:
        sweep_validate.validate_sweep(write_sweep(tmp_path, **overrides))
    assert message.replace("argument ", "") in str(refused.value) and "\n" not in str(refused.value)


# ------------------------------------------------------------------------------------------- 9: smaller
def test_a_second_rejection_of_a_step_keeps_the_first(tmp_path):
    for attempt in (1, 2):
        make_checkpoint(tmp_path, 8, payload=f"try {attempt}".encode())
        tidy_checkpoints(str(tmp_path), [("step_00000008", "corrupt")])
    rejected = tmp_path / "checkpoints" / "rejected"
    assert sorted(os.listdir(rejected)) == ["step_00000008", "step_00000008.2"]


def test_a_refusal_is_said_by_rank_0_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    code, stderr = run_main_in_process(train_gpt, [*GPT_TINY, "--n_head", "3"], capsys)
    assert code == 2 and stderr == ""
    monkeypatch.setenv("RANK", "0")
    code, stderr = run_main_in_process(train_gpt, [*GPT_TINY, "--n_head", "3"], capsys)
    assert code == 2 and "--n_head 3 must divide --d_model 32" in stderr


def test_a_full_disk_leaves_no_temporary_summary(tmp_path, monkeypatch):
    from common.tracking import write_json_atomic

    def full(source, target):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(UsageError, match="could not write .*summary.json: disk full"):
        write_json_atomic(str(tmp_path / "summary.json"), {"a": 1})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------- 6 (and #40): the converter, every format, one line
def test_the_converter_names_an_accelerate_checkpoint_and_converts_it(tmp_path, capsys):
    from experiments.ddp_linear import main as ddp_linear
    from tools.convert_checkpoint import main as convert

    args = ["--report_to", "none", "--max_steps", "40", "--log_every", "20", "--checkpoint_every", "20"]
    assert run_in_process(ddp_linear, args, tmp_path / "run", capsys).returncode == 0
    code, _ = run_main_in_process(
        convert,
        [
            "to-safetensors",
            str(tmp_path / "run" / "checkpoints" / "step_00000040"),
            str(tmp_path / "w.safetensors"),
        ],
        capsys,
    )
    from safetensors.torch import load_file

    weights, written = (
        load_file(str(tmp_path / "w.safetensors")),
        load_file(str(tmp_path / "run" / "checkpoints" / "step_00000040" / "model.safetensors")),
    )
    assert code == 0 and weights.keys() == written.keys()
    assert all(torch.equal(weights[k], written[k]) for k in weights)


def test_a_full_disk_while_converting_back_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.api import CheckpointException

    from tools import convert_checkpoint

    weights = {"w": torch.ones(3)}
    source = tmp_path / "w.safetensors"
    save_file(
        weights,
        str(source),
        metadata={convert_checkpoint.DIGEST_KEY: convert_checkpoint.weights_digest(weights)},
    )

    def full(*args, **kwargs):
        raise CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr("torch.distributed.checkpoint.format_utils.torch_save_to_dcp", full)
    code, stderr = run_main_in_process(
        convert_checkpoint.main, ["from-safetensors", str(source), str(tmp_path / "dcp")], capsys
    )
    assert code == 2 and stderr.strip().count("\n") == 0 and "disk full; nothing written" in stderr
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]  # no .partial folder


@pytest.mark.launch
def test_ctrl_c_while_the_program_is_still_importing_is_one_line(tmp_path):
    """SIGINT once torch's library is being loaded (the imports take seconds): one line, and the process ends as
    a Ctrl-C does (killed by SIGINT: a shell's exit status 130), not an import's traceback."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from helpers import REPO

    command = [
        sys.executable,
        str(REPO / "experiments" / "train_gpt.py"),
        "--report_to",
        "none",
        "--output_dir",
        str(tmp_path / "run"),
    ]

    def as_a_terminal_starts_it() -> (
        None
    ):  # SIGINT handled and not blocked, whatever this test process inherited
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    starting = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"}, preexec_fn=as_a_terminal_starts_it)  # fmt: skip
    deadline = time.monotonic() + 60
    while not any("libtorch" in m.path for m in psutil.Process(starting.pid).memory_maps()):
        assert time.monotonic() < deadline and starting.poll() is None
        time.sleep(0.005)
    starting.send_signal(signal.SIGINT)
    try:
        _, stderr = starting.communicate(timeout=30)
    except (
        subprocess.TimeoutExpired
    ):  # say where it was: its signal masks, then every thread's stack (SIGABRT)
        masks = [line for line in open(f"/proc/{starting.pid}/status") if line.startswith("Sig")]
        starting.send_signal(signal.SIGABRT)
        _, stderr = starting.communicate(timeout=30)
        raise AssertionError(f"Ctrl-C ignored for 30 s; {masks}; {stderr[-4000:]}") from None
    assert starting.returncode in (-signal.SIGINT, 130), stderr
    assert stderr.strip().count("\n") == 0 and "interrupted (Ctrl-C)" in stderr, stderr
    assert not (tmp_path / "run").exists()
