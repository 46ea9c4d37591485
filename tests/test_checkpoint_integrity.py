"""Checkpoints that cannot lie, for real (README "When things go wrong"): train_gpt and ddp_linear
runs whose checkpoints are corrupted, swapped, resumed on other data, overwritten, resumed with a
stretched schedule, written to a full disk or interrupted, and the DCP <-> safetensors converter fed
bad files. Each test fails if its guarantee is removed.

One process where one process shows it (in this process: seconds); 2 ranks where the ranks must agree.
"""

from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.train_gpt import main as train_gpt
from helpers import (
    CPU_DDP,
    GPT_TINY,
    REPO,
    clean_env,
    fork_launch,
    free_port,
    run_in_process,
    run_main_in_process,
)

pytestmark = pytest.mark.launch  # trains models end to end: the slow tier
# a small corpus: its validation share is the default's (GPT_TINY's 2 % is for pydoc topics)
CHECKPOINTED = [*GPT_TINY, "--val_fraction", "0.1", "--checkpoint_every", "3", "--keep_checkpoints", "5", "--log_every",
                "3"]  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """60 kB of pydoc topics: an epoch is many steps."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("text") / "topics.txt"
    path.write_text("".join(topics[key] for key in sorted(topics))[:60_000])
    return path


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, text) -> dict:
    """A one-process run of 12 steps with checkpoints at 3, 6 and 9, whose summary.json is then removed:
    as if it had been killed at step 10. Tests copy it. Also its clean end state, for comparison."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    finished = run_in_process(train_gpt, [*CHECKPOINTED, "--text_files", str(text)], out, capsys=None)
    assert finished.returncode == 0, finished.stderr[-2000:]
    clean = finished.summary["metrics"]
    (out / "summary.json").unlink()
    shutil.rmtree(
        out / "checkpoints" / "step_00000012"
    )  # the finished run's last checkpoint: not there at step 10
    return {
        "dir": out,
        "final_state_digest": clean["final_state_digest"],
        "val_loss_before": clean["val_loss_before"],
    }


def copy_run(interrupted: dict, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(interrupted["dir"], out)
    return out


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def snapshot(folder: Path) -> dict:
    """Every file under folder and its bytes: to show that a refusal wrote, moved or deleted nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_latest_passes_over_a_corrupt_checkpoint_and_ends_as_the_clean_run(
    interrupted, text, tmp_path, capsys
):
    out = copy_run(interrupted, tmp_path)
    flip_a_byte(out / "checkpoints" / "step_00000009" / "state" / "__0_0.distcp")
    resumed = run_in_process(
        train_gpt,
        [*CHECKPOINTED, "--text_files", str(text), "--resume_from_checkpoint", "latest"],
        out,
        capsys,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step_00000006, the newest checkpoint that verifies; passed over step_00000009 " \
           "(state/__0_0.distcp differs from what was written" in resumed.stderr  # fmt: skip
    metrics = resumed.summary["metrics"]
    assert metrics["resumed_from_step"] == 6 and resumed.summary["checks"]["resume_restored_state"]["passed"]
    assert (
        metrics["final_state_digest"] == interrupted["final_state_digest"]
    )  # nothing of the bad one was used
    assert (out / "checkpoints" / "rejected" / "step_00000009").is_dir()  # kept aside, not deleted
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "rejected",
        "step_00000003",
        "step_00000006",
        "step_00000009",
        "step_00000012",
    ]  # fmt: skip (9 redone, 12: the end)
    # loss_decreased counts from the loaded state, not from a random initialisation
    assert metrics["val_loss_before"] < interrupted["val_loss_before"] - 0.05
    assert "from the loaded checkpoint" in resumed.summary["checks"]["loss_decreased"]["detail"]


@pytest.mark.parametrize(
    "damage",
    [
        "bit-flip",
        "truncated-shard",
        "missing-shard",
        "corrupt-metadata",
        "edited-step-json",
        "shard-is-a-folder",
        "step-json-is-a-folder",
    ],
)
def test_a_bad_checkpoint_named_explicitly_is_refused_and_nothing_is_written(
    interrupted, text, tmp_path, capsys, damage
):
    out = copy_run(interrupted, tmp_path)
    bad = out / "checkpoints" / "step_00000009"
    shard = bad / "state" / "__0_0.distcp"
    if damage == "bit-flip":
        flip_a_byte(shard)
    elif damage == "truncated-shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "missing-shard":
        shard.unlink()
    elif damage == "corrupt-metadata":
        flip_a_byte(bad / "state" / ".metadata")
    elif damage.endswith("is-a-folder"):  # one fault, one message (was "has 4,096 bytes" or a read error)
        where = shard if damage == "shard-is-a-folder" else bad / "step.json"
        where.unlink()
        where.mkdir()
    else:
        step = json.loads((bad / "step.json").read_text())
        (bad / "step.json").write_text(json.dumps({**step, "samples_seen": -4}))
    before = snapshot(out)
    refused = run_in_process(
        train_gpt,
        [*CHECKPOINTED, "--text_files", str(text), "--resume_from_checkpoint", str(bad)],
        out,
        capsys,
    )
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert f"{bad}: cannot be used" in refused.stderr
    assert refused.stderr.strip().endswith(
        f"the newest checkpoint there that verifies is {out}/checkpoints/step_00000006"
    )
    assert snapshot(out) == before  # nothing written, pruned, moved or marked finished
    if damage.endswith("is-a-folder"):
        name = "state/__0_0.distcp" if damage == "shard-is-a-folder" else "step.json"
        assert f"cannot be used: {name} is a folder where a file was written;" in refused.stderr


def test_a_weights_only_folder_is_refused_for_what_it_is_and_init_from_starts_from_its_weights(
    interrupted, text, tmp_path, capsys
):
    """tools.convert_checkpoint from-safetensors writes weights only: a resume is refused saying so and what to
    use; --init_from the safetensors file starts a new run from those weights (step 0, a fresh optimizer), whose
    first validation loss is the loss of the weights it started from."""
    from tools.convert_checkpoint import main as convert

    source = interrupted["dir"] / "checkpoints" / "step_00000009"
    weights, folder = tmp_path / "model.safetensors", tmp_path / "weights_dcp"
    assert convert(["to-safetensors", str(source), str(weights)]) == 0
    assert convert(["from-safetensors", str(weights), str(folder)]) == 0
    refused = run_in_process(
        train_gpt, [*CHECKPOINTED, "--text_files", str(text), "--resume_from_checkpoint", str(folder)],
        tmp_path / "resumed", capsys,
    )  # fmt: skip
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "a weights-only folder (tools.convert_checkpoint from-safetensors wrote it" in refused.stderr
    assert "start a new run with --init_from FILE.safetensors" in refused.stderr
    assert not (tmp_path / "resumed").exists()
    args = [
        *CHECKPOINTED,
        "--text_files",
        str(text),
        "--init_from",
        str(weights),
        "--max_steps",
        "3",
        "--parity_steps",
        "0",
    ]
    started = run_in_process(train_gpt, args, tmp_path / "fine_tuned", capsys)
    assert started.returncode == 0, started.stderr[-2000:]
    summary = started.summary
    assert summary["metrics"]["init_from"]["weights_sha256"] and summary["metrics"]["init_from"][
        "path"
    ] == str(weights)
    resumed_at_9 = run_in_process(
        train_gpt, [*CHECKPOINTED, "--text_files", str(text), "--resume_from_checkpoint", str(source),
                    "--max_steps", "12"], tmp_path / "at_9", capsys,
    )  # fmt: skip
    # the same weights, the same validation rows: the same loss (the optimizer state, not part of it, is fresh)
    assert summary["metrics"]["val_loss_before"] == pytest.approx(resumed_at_9.summary["metrics"]["val_loss_before"],
                                                                  abs=1e-6)  # fmt: skip
    assert "from the initial weights of --init_from" in summary["checks"]["loss_decreased"]["detail"]


def test_init_from_weights_of_another_architecture_is_refused_naming_both_values(
    interrupted, text, tmp_path, capsys
):
    """--n_head 2 and --n_head 4 split the same matrices into other heads: the shapes agree, the models do not. The
    exported file records the architecture it was trained as (from the checkpoint's flags); a run that asks for
    another is refused in one line, naming both values, before anything is written."""
    from safetensors import safe_open

    from tools.convert_checkpoint import main as convert

    weights = tmp_path / "model.safetensors"
    assert (
        convert(["to-safetensors", str(interrupted["dir"] / "checkpoints" / "step_00000009"), str(weights)])
        == 0
    )
    with safe_open(str(weights), framework="pt") as handle:
        assert json.loads(handle.metadata()["model_flags"])["n_head"] == 2
    args = [*CHECKPOINTED, "--text_files", str(text), "--init_from", str(weights), "--max_steps", "3",
            "--parity_steps", "0", "--n_head", "4"]  # fmt: skip
    refused = run_in_process(train_gpt, args, tmp_path / "other", capsys)
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "these weights were trained as another model: --n_head 2 (this run: 4)" in refused.stderr
    assert not (tmp_path / "other").exists()


def test_the_same_weights_score_the_same_validation_loss_on_1_2_and_4_ranks(
    interrupted, text, tmp_path, capsys
):
    """89 validation rows (--val_fraction 0.105): on 2 and 4 data-parallel ranks a share is one row short. Every row
    counts on every layout (the short shares padded with rows that score nothing), so the same weights score the
    same loss on one process, on 2 ranks (ddp) and on 4 (dp_shard 2 x tp 2); before, the row left over was
    dropped and the loss depended on the layout."""
    from tools.convert_checkpoint import main as convert

    weights = tmp_path / "model.safetensors"
    assert (
        convert(["to-safetensors", str(interrupted["dir"] / "checkpoints" / "step_00000009"), str(weights)])
        == 0
    )
    args = [*CHECKPOINTED, "--text_files", str(text), "--init_from", str(weights), "--val_fraction", "0.105",
            "--max_steps", "1", "--parity_steps", "0", "--sample_tokens", "0"]  # fmt: skip
    one = run_in_process(train_gpt, args, tmp_path / "one", capsys).summary["metrics"]["val_loss_before"]
    for ranks, layout in ((2, ["--strategy", "ddp"]), (4, ["--dp_shard", "2", "--tp", "2"])):
        finished = fork_launch(train_gpt, [*args, *layout], tmp_path / f"ranks{ranks}", num_processes=ranks)
        assert finished.summary["world_size"] == ranks, finished.stderr[-2000:]
        assert finished.summary["metrics"]["val_loss_before"] == pytest.approx(one, abs=1e-6), ranks


def test_a_resume_on_other_text_is_refused_naming_both_hashes(interrupted, text, tmp_path, capsys):
    out = copy_run(interrupted, tmp_path)
    other_text = tmp_path / "topics.txt"
    other_text.write_text(text.read_text().replace("the", "a"))
    before = snapshot(out)
    refused = run_in_process(
        train_gpt,
        [*CHECKPOINTED, "--text_files", str(other_text), "--resume_from_checkpoint", "latest"],
        out,
        capsys,
    )
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    saved = json.loads((out / "checkpoints" / "step_00000009" / "step.json").read_text())["data"]
    assert f"data_sha256 {saved['data_sha256']} in the checkpoint, " in refused.stderr
    assert f"tokenizer_sha256 {saved['tokenizer_sha256']} in the checkpoint, " in refused.stderr
    assert snapshot(out) == before
    # the same bytes under another spelling of the path are the same data
    shutil.copy(text, other_text)
    same = run_in_process(
        train_gpt,
        [
            *CHECKPOINTED,
            "--text_files",
            str(tmp_path / ".." / tmp_path.name / "topics.txt"),
            "--resume_from_checkpoint",
            "latest",
        ],
        out,
        capsys,
    )
    assert same.returncode == 0, same.stderr[-2000:]


def test_growing_max_steps_on_resume_cannot_stretch_the_schedule(interrupted, text, tmp_path, capsys):
    out = copy_run(interrupted, tmp_path)
    args = [
        *CHECKPOINTED,
        "--text_files",
        str(text),
        "--resume_from_checkpoint",
        "latest",
        "--max_steps",
        "15",
    ]
    refused = run_in_process(train_gpt, args, out, capsys)
    assert refused.returncode == 2 and "--lr_decay_steps: 12 in the checkpoint, 15 now" in refused.stderr
    kept = run_in_process(train_gpt, [*args, "--lr_decay_steps", "12"], out, capsys)
    assert kept.returncode == 0, kept.stderr[-2000:]
    lr = {record["step"]: record["lr"] for record in kept.metrics if "lr" in record}
    assert lr[12] == lr[15] == pytest.approx(3e-3 * 0.1)  # the 12-step schedule's end, then flat


def test_overwrite_starts_a_clean_run_and_moves_the_old_one_aside(interrupted, text, tmp_path, capsys):
    out = copy_run(interrupted, tmp_path)
    old = snapshot(out)
    fresh = run_in_process(
        train_gpt,
        [
            *CHECKPOINTED,
            "--text_files",
            str(text),
            "--max_steps",
            "4",
            "--parity_steps",
            "2",
            "--min_loss_drop",
            "0",
            "--overwrite",
        ],
        out,
        capsys,
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    (moved,) = tmp_path.glob("run.replaced-*")
    assert f"--overwrite: the earlier run in {out} was moved to {moved}" in fresh.stderr
    assert snapshot(moved) == {k: v for k, v in old.items() if k != ".lock"}  # nothing of it lost
    # only the new run's: step 3 and its last, step 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    assert [r["step"] for r in fresh.metrics if "loss" in r] == [3, 4]
    # a fresh run into a folder holding another run's checkpoints, without --overwrite: refused
    refused = run_in_process(train_gpt, [*CHECKPOINTED, "--text_files", str(text)], moved, capsys)
    assert (
        refused.returncode == 2
        and "holds checkpoints of an earlier run (newest step_00000009)" in refused.stderr
    )


def test_a_full_disk_during_a_sharded_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, text, capsys):
    disk = mount_small_tmpfs(tmp_path / "disk", "1300k")
    try:
        out = tmp_path / "run"
        out.mkdir()
        (out / "checkpoints").symlink_to(disk)
        finished = run_in_process(train_gpt, [*CHECKPOINTED, "--text_files", str(text)], out, capsys)
        on_disk = sorted(p.name for p in disk.iterdir())
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)
    assert finished.returncode == 2 and finished.stderr.strip().count("\n") == 0, finished.stderr[-3000:]
    assert "(disk full); newest complete checkpoint kept: step_00000003" in finished.stderr
    assert on_disk == ["step_00000003"] and not (out / "summary.json").exists()


def mount_small_tmpfs(folder: Path, size: str) -> Path:
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    return folder


# ------------------------------------------------------------------------------------ the converter
def convert(argv: list[str], capsys) -> tuple[int, str]:
    from tools.convert_checkpoint import main

    return run_main_in_process(main, argv, capsys)


def test_the_converter_verifies_both_ways(interrupted, tmp_path, capsys):
    checkpoint = interrupted["dir"] / "checkpoints" / "step_00000009"
    weights = tmp_path / "model.safetensors"
    assert convert(["to-safetensors", str(checkpoint), str(weights)], capsys)[0] == 0
    back = tmp_path / "back"
    assert convert(["from-safetensors", str(weights), str(back)], capsys)[0] == 0
    assert convert(["to-safetensors", str(back), str(tmp_path / "again.safetensors")], capsys)[0] == 0
    assert (tmp_path / "again.safetensors").read_bytes() == weights.read_bytes()

    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoint, corrupt)
    flip_a_byte(corrupt / "state" / "__0_0.distcp")
    flipped = tmp_path / "flipped.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x01  # in the last tensor's values
    flipped.write_bytes(bytes(data))
    foreign = tmp_path / "foreign.safetensors"
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(weights)), str(foreign))  # no digest recorded
    not_safetensors = tmp_path / "notes.txt"
    not_safetensors.write_text("hello")
    back_corrupt = tmp_path / "back_corrupt"
    shutil.copytree(back, back_corrupt)
    flip_a_byte(back_corrupt / "state" / "__0_0.distcp")
    cases = [
        (["to-safetensors", str(corrupt), str(tmp_path / "x.safetensors")], "differs from what was written"),
        (
            ["to-safetensors", str(back_corrupt), str(tmp_path / "x.safetensors")],
            "differs from what was written",
        ),
        (["to-safetensors", str(tmp_path / "nowhere"), str(tmp_path / "x.safetensors")], "is not a folder"),
        (
            ["to-safetensors", str(tmp_path), str(tmp_path / "x.safetensors")],
            "is not a checkpoint of this project",
        ),
        (["to-safetensors", str(checkpoint), str(weights)], "exists; choose a new output path"),
        (["to-safetensors", str(checkpoint), str(tmp_path / "no" / "x.safetensors")], "does not exist"),
        (["from-safetensors", str(flipped), str(tmp_path / "y")], "do not match the digest recorded in it"),
        (["from-safetensors", str(foreign), str(tmp_path / "y")], "records no weights_sha256"),
        (
            ["from-safetensors", str(not_safetensors), str(tmp_path / "y")],
            "is not a readable safetensors file",
        ),
        (["from-safetensors", str(tmp_path / "none.safetensors"), str(tmp_path / "y")], ": no such file"),
    ]
    for argv, message in cases:
        code, stderr = convert(argv, capsys)
        assert code == 2 and message in stderr and stderr.strip().count("\n") == 0, (argv, stderr)
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "y").exists()
    assert not list(tmp_path.glob("*.partial*"))


# -------------------------------------------------------------------------------------- 2 ranks
def test_ctrl_c_is_one_line_exit_130_and_the_last_checkpoint_verifies(tmp_path, text):
    """SIGINT to `accelerate launch` (what Ctrl-C in a terminal sends it; the launcher passes it to the
    ranks): no traceback from any rank, one line from the main one, and every checkpoint verifies. Under cp, whose
    all-gathers are functional collectives: none left in flight is warned of at the end (tests/test_config.py
    shows that deterministically)."""
    from common.checkpoint import verify_checkpoint

    out = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_DDP, "--main_process_port",
               str(free_port()), str(REPO / "experiments" / "train_gpt.py"), "--output_dir", str(out), *CHECKPOINTED,
               "--text_files", str(text), "--strategy", "cp", "--max_steps", "100000", "--checkpoint_every", "2"]  # fmt: skip
    launcher = subprocess.Popen(command, cwd=REPO, env=clean_env(HOME=str(tmp_path)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "step_00000006").exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    _stdout, stderr = launcher.communicate(timeout=60)
    ours = [line for line in stderr.splitlines() if "train_gpt" in line and "interrupted" in line]
    assert "Traceback" not in stderr and len(ours) == 1, stderr[-3000:]
    assert "unwaited collective" not in stderr, stderr[-3000:]
    assert (
        "interrupted (Ctrl-C) in step " in ours[0]
        and "continue with --resume_from_checkpoint latest" in ours[0]
    )
    assert launcher.returncode == 130  # 128 + SIGINT, from the ranks through the launcher
    kept = sorted((out / "checkpoints").iterdir())
    assert kept and all(verify_checkpoint(str(folder))[1] is None for folder in kept), [f.name for f in kept]
    resumed = fork_launch(train_gpt, [*CHECKPOINTED, "--text_files", str(text), "--strategy", "cp", "--max_steps",
                                      str(int(kept[-1].name[5:]) + 4), "--resume_from_checkpoint", "latest",
                                      "--lr_decay_steps", "100000"], out)  # fmt: skip
    assert resumed.returncode == 0, json.dumps(resumed.summary["checks"], indent=1)


@pytest.mark.launch
def test_a_ctrl_c_that_reaches_one_rank_first_is_still_one_line_and_130(tmp_path):
    """The launcher signals its ranks one after another; the worst order, made certain: rank 1 alone gets the
    Ctrl-C while rank 0 waits for it in a collective (rank 1 stalls at step 3, --hang_at_step; rank 0 enters step
    4), and rank 0 never gets one at all. Rank 1's mark beside the heartbeats tells rank 0 its failed collective
    was an interrupt: one line from rank 0, exit 130 from both, no traceback from either."""
    import psutil

    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(REPO / "experiments" / "ddp_linear.py"), "--output_dir", str(out), "--report_to", "none",
               "--max_steps", "100", "--hang_at_step", "3", "--hang_rank", "1"]  # fmt: skip
    launcher = subprocess.Popen(command, cwd=REPO, env=clean_env(HOME=str(tmp_path)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    beat = out / "heartbeat" / "rank0"
    deadline = time.monotonic() + 120
    while not (
        beat.exists() and struct.unpack("<d", beat.read_bytes()[:8])[0] == 3.5
    ):  # rank 0 waits in step 4
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    ranks = {p.environ().get("RANK"): p for p in psutil.Process(launcher.pid).children(recursive=True)}
    ranks["1"].send_signal(signal.SIGINT)
    _stdout, stderr = launcher.communicate(timeout=120)
    ours = [line for line in stderr.splitlines() if line.startswith("ddp_linear") and "interrupted" in line]
    assert len(ours) == 1 and "interrupted (Ctrl-C) in step 4" in ours[0], stderr[-3000:]
    assert "[rank0]" not in stderr and "[rank1]" not in stderr, stderr[-3000:]  # no rank's traceback
    assert "exitcode  : 130" in stderr or launcher.returncode == 130, stderr[-3000:]
