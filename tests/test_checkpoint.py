"""common/checkpoint/ on hand-made checkpoints, in this process: what verification catches, what
`latest` picks, what pruning keeps, what a failed write leaves. (Real training runs that resume, and
refuse, are in test_checkpoint_integrity.py.)"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from common.checkpoint import (
    FORMAT,
    STEP_FILE,
    ResumableArgs,
    checkpoint_folders,
    files_manifest,
    find_checkpoint,
    refuse_incompatible,
    refuse_mixed_lineage,
    save_checkpoint,
    seal,
    tidy_checkpoints,
    verify_checkpoint,
)
from common.config import UsageError


def make_checkpoint(output_dir: Path, step: int, payload: bytes = b"weights", **meta) -> Path:
    """A checkpoint as save_checkpoint writes one: a state file, and a sealed step.json recording it."""
    folder = output_dir / "checkpoints" / f"step_{step:08d}"
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "__0_0.distcp").write_bytes(payload * 100)
    record = {"format": FORMAT, "step": step, "samples_seen": 8 * step, "world_size": 1, "layout": {},
              "trajectory": {}, "data": {}, "state_digest": "x", "files": files_manifest(str(folder)), **meta}  # fmt: skip
    (folder / STEP_FILE).write_text(json.dumps(seal(record)))
    return folder


def latest(output_dir: Path):
    return find_checkpoint(ResumableArgs(resume_from_checkpoint="latest"), str(output_dir))


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_checkpoint_verifies_as_written(tmp_path):
    folder = make_checkpoint(tmp_path, 3)
    meta, problem = verify_checkpoint(str(folder))
    assert problem is None and meta["step"] == 3 and meta["samples_seen"] == 24


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: flip_a_byte(f / "state" / "__0_0.distcp"), "state/__0_0.distcp differs from what was written"),
        (lambda f: (f / "state" / "__0_0.distcp").write_bytes(b"weights" * 50), "has 350 bytes, 700 were written"),
        (lambda f: (f / "state" / "__0_0.distcp").unlink(), "state/__0_0.distcp is missing"),
        (lambda f: (f / STEP_FILE).unlink(), "no step.json"),
        (lambda f: (f / STEP_FILE).write_text("{not json"), "step.json is not the JSON that was written"),
        (lambda f: (f / STEP_FILE).write_bytes(b"\xff\xfe"), "step.json is not the JSON that was written"),
        (lambda f: (f / STEP_FILE).write_text("[1, 2]"), "step.json is not a JSON object"),
        # hand edits: the digest over step.json no longer matches
        (lambda f: edit(f, step=-3), "step.json was changed after it was written"),
        (lambda f: edit(f, samples_seen=12.5), "step.json was changed after it was written"),
        # ... and even re-sealed by hand, the values must make sense
        (lambda f: edit(f, reseal=True, step=-3), "'step' must be a whole number >= 1, got -3"),
        (lambda f: edit(f, reseal=True, samples_seen=-8), "'samples_seen' must be a whole number >= 0, got -8"),
        (lambda f: edit(f, reseal=True, step=3.0), "'step' must be a whole number >= 1, got 3.0"),
        (lambda f: edit(f, reseal=True, step=True), "'step' must be a whole number >= 1, got True"),
        (lambda f: edit(f, reseal=True, step=6), "the folder is step 3 but step.json says step 6"),
        (lambda f: edit(f, reseal=True, trajectory=None), "'trajectory' must be an object"),
        (lambda f: edit(f, reseal=True, format=1), "has format 1, not 2 (written by an older version"),
    ],
    ids=["bit-flip", "truncated", "missing-shard", "no-step-json", "corrupt-step-json", "binary-step-json",
         "not-an-object", "edited-step", "edited-float", "resealed-negative-step", "resealed-negative-samples",
         "resealed-float-step", "resealed-bool-step", "resealed-other-step", "resealed-no-trajectory", "old-format"],
)  # fmt: skip
def test_verification_catches_every_kind_of_damage(tmp_path, damage, message):
    folder = make_checkpoint(tmp_path, 3)
    damage(folder)
    meta, problem = verify_checkpoint(str(folder))
    assert meta is None and message in problem


def edit(folder: Path, reseal: bool = False, **changes) -> None:
    record = {**json.loads((folder / STEP_FILE).read_text()), **changes}
    (folder / STEP_FILE).write_text(json.dumps(seal(record) if reseal else record))


def test_latest_is_the_newest_that_verifies_and_names_those_it_passed_over(tmp_path):
    make_checkpoint(tmp_path, 3)
    make_checkpoint(tmp_path, 6)
    flip_a_byte(make_checkpoint(tmp_path, 9) / "state" / "__0_0.distcp")
    (tmp_path / "checkpoints" / "step_00000012.partial").mkdir()  # killed while saving
    (tmp_path / "checkpoints" / "step_00000015.deleting").mkdir()  # killed while pruning
    found = latest(tmp_path)
    assert found.path.endswith("step_00000006") and found.meta["step"] == 6
    assert [name for name, _ in found.rejected] == ["step_00000009"]
    tidy_checkpoints(str(tmp_path), found.rejected)  # at the start of the run that resumes
    assert checkpoint_folders(str(tmp_path)) == ["step_00000003", "step_00000006"]
    assert (tmp_path / "checkpoints" / "rejected" / "step_00000009").is_dir()  # kept for a look
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["rejected", "step_00000003", "step_00000006"]


def test_latest_with_no_checkpoint_starts_fresh_but_with_only_bad_ones_refuses(tmp_path):
    assert latest(tmp_path / "empty").path is None
    flip_a_byte(make_checkpoint(tmp_path, 3) / "state" / "__0_0.distcp")
    with pytest.raises(
        UsageError, match=r"no checkpoint in .* verifies \(step_00000003: state/__0_0.distcp differs"
    ):
        latest(tmp_path)


def test_an_explicit_bad_checkpoint_is_refused_naming_the_newest_good_one(tmp_path):
    make_checkpoint(tmp_path, 3)
    bad = make_checkpoint(tmp_path, 6)
    (bad / "state" / "__0_0.distcp").unlink()
    with pytest.raises(UsageError) as refused:
        find_checkpoint(ResumableArgs(resume_from_checkpoint=str(bad)), str(tmp_path / "new"))
    assert "state/__0_0.distcp is missing" in str(refused.value)
    assert str(refused.value).endswith(
        f"the newest checkpoint there that verifies is {tmp_path}/checkpoints/step_00000003"
    )
    with pytest.raises(UsageError, match="cannot be used: not a folder"):
        find_checkpoint(ResumableArgs(resume_from_checkpoint="no/such/folder"), str(tmp_path))


def test_one_runs_checkpoints_per_folder(tmp_path):
    make_checkpoint(tmp_path, 3)
    make_checkpoint(tmp_path, 6)
    fresh = ResumableArgs()
    with pytest.raises(
        UsageError, match="holds checkpoints of an earlier run .newest step_00000006.: continue it"
    ):
        refuse_mixed_lineage(fresh, str(tmp_path), find_checkpoint(fresh, str(tmp_path)))
    older = ResumableArgs(resume_from_checkpoint=str(tmp_path / "checkpoints" / "step_00000003"))
    with pytest.raises(UsageError, match="which holds newer checkpoints"):
        refuse_mixed_lineage(older, str(tmp_path), find_checkpoint(older, str(tmp_path)))
    elsewhere = make_checkpoint(tmp_path / "other", 9)
    foreign = ResumableArgs(resume_from_checkpoint=str(elsewhere))
    with pytest.raises(UsageError, match="which holds other checkpoints"):
        refuse_mixed_lineage(foreign, str(tmp_path), find_checkpoint(foreign, str(tmp_path)))
    resume = ResumableArgs(resume_from_checkpoint="latest")
    refuse_mixed_lineage(
        resume, str(tmp_path), find_checkpoint(resume, str(tmp_path))
    )  # its own newest: fine
    overwrite = ResumableArgs(overwrite=True)
    refuse_mixed_lineage(overwrite, str(tmp_path), find_checkpoint(overwrite, str(tmp_path)))  # moved aside


def test_a_resume_on_other_data_is_refused_naming_both_hashes(tmp_path):
    cfg = ResumableArgs(max_steps=20)
    meta = {
        "step": 5,
        "trajectory": cfg.trajectory(1),
        "data": {"data_sha256": "aaa", "tokenizer_sha256": "ttt"},
    }
    refuse_incompatible(cfg, "ckpt", meta, 1, {"data_sha256": "aaa", "tokenizer_sha256": "ttt"})
    with pytest.raises(UsageError) as refused:
        refuse_incompatible(cfg, "ckpt", meta, 1, {"data_sha256": "bbb", "tokenizer_sha256": "ttt"})
    assert "data_sha256 aaa in the checkpoint, bbb now" in str(refused.value)
    assert "tokenizer_sha256" not in str(refused.value)


class OneProcess:
    """What save_checkpoint needs of an Accelerator, for one process."""

    is_main_process, num_processes = True, 1

    def wait_for_everyone(self):
        pass


# what TrainLoop puts into step.json beside the step and the files
META = {"samples_seen": 8, "world_size": 1, "layout": {}, "trajectory": {}, "data": {}, "state_digest": "x"}


def write_weights(folder: str) -> None:
    os.makedirs(os.path.join(folder, "state"))
    with open(os.path.join(folder, "state", "__0_0.distcp"), "wb") as handle:
        handle.write(os.urandom(1000))


def test_pruning_keeps_the_newest_and_a_failed_write_leaves_nothing(tmp_path):
    for step in (3, 6, 9):
        save_checkpoint(OneProcess(), str(tmp_path), step, 2, META, write_weights)
    assert checkpoint_folders(str(tmp_path)) == ["step_00000006", "step_00000009"]
    assert latest(tmp_path).path.endswith("step_00000009")  # and it verifies

    def disk_full(folder: str) -> None:
        write_weights(folder)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UsageError) as refused:
        save_checkpoint(OneProcess(), str(tmp_path), 12, 2, META, disk_full)
    assert str(refused.value).endswith("(disk full); newest complete checkpoint kept: step_00000009")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000006", "step_00000009"]  # no partial


def test_a_dcp_exception_is_a_write_failure_but_a_timeout_is_not(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    def dcp_refused(folder: str) -> None:
        raise CheckpointException("save failed", {1: (PermissionError(13, "Permission denied"), None)})

    with pytest.raises(UsageError, match=r"\(Permission denied\); newest complete checkpoint kept: none"):
        save_checkpoint(OneProcess(), str(tmp_path), 3, 2, META, dcp_refused)

    def timed_out(folder: str) -> None:
        raise RuntimeError("[Gloo] Timed out waiting 5000ms for recv operation")

    with pytest.raises(RuntimeError, match="Timed out"):
        save_checkpoint(OneProcess(), str(tmp_path), 3, 2, META, timed_out)


def test_overwrite_and_latest_contradict(capsys):
    from common.config import parse_config

    with pytest.raises(SystemExit):
        parse_config(ResumableArgs, ["--overwrite", "--resume_from_checkpoint", "latest"])
    assert (
        "--overwrite starts afresh and --resume_from_checkpoint latest continues" in capsys.readouterr().err
    )


def test_the_schedule_length_is_part_of_a_resumes_settings():
    from experiments.train_gpt import Config

    short, grown = (
        Config(max_steps=12, warmup_steps=2),
        Config(max_steps=300, warmup_steps=2, strategy="none"),
    )
    assert short.trajectory(1)["lr_decay_steps"] == 12 and grown.trajectory(1)["lr_decay_steps"] == 300
    kept = Config(max_steps=300, warmup_steps=2, lr_decay_steps=12, strategy="none")
    assert kept.trajectory(1)["lr_decay_steps"] == 12  # what a resume of the 12-step run must pass
    assert [kept.lr_schedule()(s) for s in (9, 10, 12)] == [short.lr_schedule()(s) for s in (9, 10, 12)]
    assert kept.lr_schedule()(200) == pytest.approx(kept.lr * kept.min_lr_ratio)  # flat after the decay
    meta = {
        "step": 6,
        "trajectory": short.trajectory(1),
        "data": {},
        "layout": {"strategy": "none"},
        "world_size": 1,
    }
    with pytest.raises(
        UsageError, match="--lr_decay_steps: 12 in the checkpoint, 300 now .* pass --lr_decay_steps 12"
    ):
        refuse_incompatible(grown, "ckpt", meta, 1, {})
    refuse_incompatible(kept, "ckpt", meta, 1, {})


def test_an_interrupt_is_recognised_where_a_library_wrapped_it():
    from torch.distributed.checkpoint.api import CheckpointException

    from common.reliability import is_interrupt

    assert is_interrupt(KeyboardInterrupt())
    assert is_interrupt(CheckpointException("save", {0: (KeyboardInterrupt(), None)}))
    wrapped = RuntimeError("a collective failed")
    wrapped.__context__ = KeyboardInterrupt()
    assert is_interrupt(wrapped)
    assert not is_interrupt(RuntimeError("Connection closed by peer"))
