"""Checkpoints that cannot lie: written whole or not at all, verified before use, tied to their data.

A checkpoint is a folder `<output_dir>/checkpoints/step_XXXXXXXX/` holding the training state (written
by a checkpointer, below) and `step.json`, which records:
  step, samples_seen      where the run was (the data position in samples, so a resume at another
                          world size, with another global batch, continues at the same sample);
  trajectory, world_size, every flag that changes what the run computes, the layout it ran under, and
  layout, data            content hashes of its training data (and tokenizer): a resume that differs
                          in any of them is refused, naming the field and both values;
  state_digest            sha256 of the FULL state (every parameter and optimizer tensor, gathered
                          whole, by name): the same at any world size and strategy, so the state
                          right after a load must have the digest it was saved with;
  files                   the sha256 and size of every file of the checkpoint, computed from disk
                          once every rank had written;
  digest                  sha256 of everything above: a step.json edited by hand, or flipped by the
                          disk, is refused like a corrupt shard.
Every one of them is checked BEFORE any training step uses the checkpoint (`verify_checkpoint`): a bad
checkpoint is refused in one line naming it and the newest good one, exit 2, nothing written.
`--resume_from_checkpoint latest` takes the newest checkpoint that verifies and says which newer ones
it passed over, and why.

Writing (`save_checkpoint`, a collective): every rank writes into step_XXXXXXXX.partial, the ranks
agree that every write succeeded, the main process hashes the files, writes step.json and renames the
folder: a half-written checkpoint is never "latest". Any failure (a full disk, a permission, DCP's
CheckpointException on any rank) is one line on every rank, the partial folder removed, the newest
complete checkpoint kept. Pruning (`--keep_checkpoints K`) happens only after the new checkpoint is
complete, so the newest verified one is never deleted.

Two checkpointers with the same save / load / full_state / digest:
- `AccelerateCheckpointer`: Accelerate's save_state / load_state (model, optimizer, every rank's RNG
  state) for a model every rank holds whole (ddp_linear);
- `ShardedCheckpointer`: PyTorch's distributed checkpoint (DCP): `get_state_dict` gives the state in
  this run's layout (DTensor shards under FSDP / TP) keyed by parameter NAME, `dcp.save` has each rank
  write its pieces plus a metadata file, and `dcp.load` reads them into whatever layout the resuming
  run has: saved by fsdp on 2 ranks, resumed by fsdp on 3, by ddp, or by one process (train_gpt).
Both digest the full state the same way (`full_state_digest`).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field

from common.config import UsageError, flag, require, require_positive
from common.reliability import FaultArgs

CHECKPOINT_PREFIX = "step_"
CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")
STEP_FILE = "step.json"
WEIGHTS_FILE = "weights.json"  # beside state/ in the weights-only folder tools.convert_checkpoint from-safetensors writes
FORMAT = 2  # format 1 (before 2026-12-04) had no file digests: refused, it cannot be verified
REJECTED_FOLDER = (
    "rejected"  # checkpoints/rejected/: newer checkpoints that failed verification, kept for a look
)
STATE_FOLDER = "state"  # inside a DCP checkpoint: one .distcp per rank + .metadata


class CheckpointUnreadable(UsageError):
    """A checkpoint that could not be READ (a permission, an I/O error): not a damaged one. The run stops in one
    line naming what could not be read, and nothing is passed over or moved to rejected/."""

    def __init__(self, what: str, error: OSError):
        super().__init__(
            f"cannot read {what} ({error.strerror or type(error).__name__}): a read error, not a damaged checkpoint; "
            "nothing was passed over or moved. Fix the permissions or the disk, then run again",
            same_on_every_rank=True,
        )


@dataclass
class ResumableArgs(FaultArgs):
    checkpoint_every: int = flag(0, "save a checkpoint every N optimizer steps (0: never)")
    keep_checkpoints: int = flag(2, "how many complete checkpoints to keep (oldest pruned, never the newest)")
    resume_from_checkpoint: str = flag(
        "",
        "'latest' (the newest checkpoint in --output_dir that verifies; none yet = start fresh) or a "
        "checkpoint folder",
    )

    def validate(self) -> None:
        super().validate()
        require(self.checkpoint_every >= 0, f"--checkpoint_every must be >= 0, got {self.checkpoint_every}")
        require_positive(self, "keep_checkpoints")
        require(
            not (self.overwrite and self.resume_from_checkpoint == "latest"),
            "--overwrite starts afresh and --resume_from_checkpoint latest continues: pass one of them",
        )


# ------------------------------------------------------------------------------------------ digests
def digest_named_values(items) -> str:
    """sha256 over (name, value) pairs in the order given: a tensor's raw bytes, anything else its repr."""
    import torch

    digest = hashlib.sha256()
    for name, value in items:
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def full_state_digest(model_state: dict, optimizer_state: dict) -> str:
    """sha256 of a full (model, optimizer) state keyed by parameter name: names and bytes of every
    parameter and every optimizer tensor (exp_avg, exp_avg_sq, step), learning rates excluded (a
    function of the step, set before each update). Independent of how the state was split."""
    states = optimizer_state.get("state", {})
    return digest_named_values(
        [(name, model_state[name]) for name in sorted(model_state)]
        + [
            (f"optimizer.{name}.{key}", value)
            for name in sorted(states)
            for key, value in sorted(states[name].items())
        ]
    )


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise CheckpointUnreadable(path, error) from None
    return digest.hexdigest()


def _size(path: str) -> int | None:
    """The file's size; None if there is no such file; CheckpointUnreadable if it cannot be looked at."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointUnreadable(path, error) from None


def files_manifest(folder: str) -> dict:
    """{relative path: {"bytes", "sha256"}} of every file under `folder` but step.json."""
    manifest = {}
    for parent, _folders, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, folder)
            if relative != STEP_FILE:
                manifest[relative] = {"bytes": os.path.getsize(path), "sha256": file_sha256(path)}
    return dict(sorted(manifest.items()))


def seal(meta: dict) -> dict:
    """`meta` plus "digest": the sha256 of its canonical JSON (what verify_checkpoint recomputes)."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return {**body, "digest": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


# -------------------------------------------------------------------------------- finding, verifying
def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def checkpoint_folders(output_dir: str) -> list[str]:
    """Names of the step_XXXXXXXX folders (complete or not, verified or not), oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    try:
        return sorted(name for name in os.listdir(root) if CHECKPOINT_NAME.match(name))
    except OSError as error:
        raise CheckpointUnreadable(root, error) from None


def _whole_number(meta: dict, key: str, least: int) -> str | None:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        return f"{STEP_FILE}: {key!r} must be a whole number >= {least}, got {value!r}"
    return None


def read_sealed(folder: str, name: str = STEP_FILE) -> tuple[dict | None, str | None]:
    """(the JSON record `name` in folder, None) if it is readable, ours and unchanged since it was
    sealed; else (None, what is wrong)."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            meta = json.load(handle)
    except FileNotFoundError:
        if name == STEP_FILE and os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
            return None, ("a weights-only folder (tools.convert_checkpoint from-safetensors wrote it: no optimizer "
                          "state, no step, no data position), which no run resumes; to train from these weights, "
                          "start a new run with --init_from FILE.safetensors (to-safetensors writes one from it)")  # fmt: skip
        return None, f"no {name}: not a checkpoint folder, or one whose writing never finished"
    except IsADirectoryError:
        return None, folder_in_place_of(name)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"{name} is not the JSON that was written ({type(error).__name__})"
    except OSError as error:  # a permission or an I/O error: the checkpoint may be whole
        raise CheckpointUnreadable(os.path.join(folder, name), error) from None
    if not isinstance(meta, dict):
        return None, f"{name} is not a JSON object"
    if meta.get("format") != FORMAT:
        return (
            None,
            f"{name} has format {meta.get('format')!r}, not {FORMAT} (written by an older version, unverifiable)",
        )
    if seal(meta)["digest"] != meta.get("digest"):
        return None, f"{name} was changed after it was written (its digest does not match)"
    return meta, None


def folder_in_place_of(name: str) -> str:
    """One fault, one message: a folder where a checkpoint's file was written (its size or its read would
    otherwise say 4,096 bytes in one place and a read error in another)."""
    return f"{name} is a folder where a file was written"


def verify_files(folder: str, files) -> str | None:
    """None if every file recorded is there with its size and sha256, else what is wrong."""
    if not isinstance(files, dict) or not files:
        return "no files recorded"
    for relative, record in files.items():
        path = os.path.join(folder, relative)
        if os.path.isdir(path):
            return folder_in_place_of(relative)
        size = _size(path)
        if not isinstance(record, dict) or size is None:
            return f"{relative} is missing"
        if size != record.get("bytes"):
            return f"{relative} has {size:,} bytes, {record.get('bytes')!r} were written"
        try:
            if file_sha256(path) != record.get("sha256"):
                return f"{relative} differs from what was written (sha256 mismatch)"
        except FileNotFoundError:
            return f"{relative} is missing"
    return None


def verify_checkpoint(path: str) -> tuple[dict | None, str | None]:
    """(step.json, None) when every recorded fact holds, else (None, what is wrong, in a few words).
    Reads every byte of the checkpoint: a bit flipped anywhere, a file missing, truncated or added
    to the record, or step.json edited, each fails here, before anything is loaded."""
    if not os.path.isdir(path):
        return None, "not a folder"
    try:
        os.listdir(path)
    except OSError as error:
        raise CheckpointUnreadable(path, error) from None
    meta, problem = read_sealed(path)
    if problem:
        return None, problem
    for key, least in (("step", 1), ("samples_seen", 0), ("world_size", 1)):
        if problem := _whole_number(meta, key, least):
            return None, problem
    for key in ("trajectory", "layout", "data"):
        if not isinstance(meta.get(key), dict):
            return None, f"{STEP_FILE}: {key!r} must be an object, got {meta.get(key)!r}"
    match = CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))
    if match and int(match.group(1)) != meta["step"]:
        return None, f"the folder is step {int(match.group(1))} but {STEP_FILE} says step {meta['step']}"
    if problem := verify_files(path, meta.get("files")):
        return None, problem
    return meta, None


@dataclass
class Found:
    """What --resume_from_checkpoint resolved to: the checkpoint (None: start fresh), its step.json, and
    the newer checkpoints `latest` passed over because they failed verification (name, why)."""

    path: str | None = None
    meta: dict = field(default_factory=lambda: {"step": 0, "samples_seen": 0})
    rejected: list[tuple[str, str]] = field(default_factory=list)


def newest_verified(output_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest checkpoint folder of output_dir that verifies, [(newer name, why it failed)])."""
    rejected = []
    for name in reversed(checkpoint_folders(output_dir)):
        path = os.path.join(checkpoint_root(output_dir), name)
        _meta, problem = verify_checkpoint(path)
        if problem is None:
            return path, rejected
        rejected.append((name, problem))
    return None, rejected


def find_checkpoint(cfg, output_dir: str) -> Found:
    """--resume_from_checkpoint -> Found, or UsageError. 'latest': the newest checkpoint of output_dir
    that verifies (none at all: start fresh, which is what an elastic restart of a run that had not
    checkpointed yet needs; only failing ones: refused). A path: that checkpoint, refused if it fails,
    naming the newest good one beside it."""
    wanted = getattr(cfg, "resume_from_checkpoint", "")
    if not wanted:
        return Found()
    if wanted == "latest":
        path, rejected = newest_verified(output_dir)
        if path is None and rejected:
            reasons = "; ".join(f"{name}: {why}" for name, why in rejected)
            raise UsageError(
                f"--resume_from_checkpoint latest: no checkpoint in {checkpoint_root(output_dir)} verifies ({reasons}); "
                "nothing to resume: start afresh with --overwrite or another --output_dir"
            )
        if path is None:
            return Found()
        return Found(path, verify_checkpoint(path)[0], rejected)
    path = os.path.abspath(wanted)
    meta, problem = verify_checkpoint(path)
    if problem:
        parent = os.path.dirname(os.path.dirname(path))
        good, _ = (
            newest_verified(parent)
            if os.path.basename(os.path.dirname(path)) == "checkpoints"
            else (None, [])
        )
        hint = (
            f"the newest checkpoint there that verifies is {good}"
            if good
            else "no checkpoint beside it verifies"
        )
        raise UsageError(f"--resume_from_checkpoint {wanted}: cannot be used: {problem}; {hint}")
    return Found(path, meta)


def first_difference(saved: dict, now: dict, where: str = "in the checkpoint") -> str | None:
    """'--lr: 0.1 in the checkpoint, 0.2 now' for the first field of `now` that differs, else None.
    Fields only `saved` has (a flag since declared result-neutral, for instance) are not compared."""
    for name in sorted(now):
        if saved.get(name) != now[name]:
            label = name if name in ("world_size", "global_batch_size") else f"--{name}"  # not flags
            return f"{label}: {saved.get(name)!r} {where}, {now[name]!r} now"
    return None


def refuse_incompatible(cfg, path: str, meta: dict, world_size: int, data_identity: dict) -> None:
    """A resume continues the SAME run: the flags that determine the trajectory (and the world size,
    unless the checkpoint reshards) and the training data must be the checkpoint's. --max_steps may
    grow, never shrink past it (what it does to a learning-rate schedule is in the trajectory)."""
    if cfg.max_steps <= meta["step"]:
        raise UsageError(
            f"--max_steps {cfg.max_steps}: the checkpoint {path} is already at step {meta['step']}; "
            f"pass --max_steps > {meta['step']} to train on"
        )
    saved = meta.get("trajectory")
    if not isinstance(saved, dict):
        raise UsageError(f"--resume_from_checkpoint: {path} records no trajectory; start afresh")
    now = {k: v for k, v in cfg.trajectory(world_size).items() if k != "max_steps"}
    difference = first_difference({k: v for k, v in saved.items() if k != "max_steps"}, now)
    if difference:
        hint = cfg.resume_hint(difference) if hasattr(cfg, "resume_hint") else ""
        raise UsageError(
            f"cannot resume {path}: {difference}{hint}; resume with the checkpoint's settings or start a new --output_dir"
        )
    if hasattr(cfg, "refuse_resume"):
        cfg.refuse_resume(meta, world_size)
    saved_data = meta.get("data", {})
    changed = [
        key
        for key in sorted(set(saved_data) | set(data_identity))
        if saved_data.get(key) != data_identity.get(key)
    ]
    if changed:
        both = "; ".join(
            f"{key} {saved_data.get(key)} in the checkpoint, {data_identity.get(key)} now" for key in changed
        )
        raise UsageError(
            f"cannot resume {path}: the training data is not the checkpoint's ({both}); "
            "resume on the same data, or start a new --output_dir"
        )


def refuse_mixed_lineage(cfg, output_dir: str, found: Found) -> None:
    """One run's checkpoints per folder: a fresh run into a folder that holds checkpoints, or a resume
    from elsewhere (or from an older checkpoint) into a folder holding newer ones, would interleave two
    runs' checkpoints and make `latest` pick the other run's. Refused, unless --overwrite."""
    if cfg.overwrite:
        return
    kept = checkpoint_folders(output_dir)
    if not kept:
        return
    newest = kept[-1]
    if found.path is None:
        raise UsageError(
            f"--output_dir {output_dir} holds checkpoints of an earlier run (newest {newest}): continue it with "
            "--resume_from_checkpoint latest, or start afresh with --overwrite or another --output_dir"
        )
    inside = os.path.dirname(found.path) == checkpoint_root(output_dir)
    newer = [name for name in kept if name > os.path.basename(found.path)]
    rejected = {name for name, _ in found.rejected}
    if not inside or [name for name in newer if name not in rejected]:
        raise UsageError(
            f"--resume_from_checkpoint {found.path} into --output_dir {output_dir}, which holds "
            f"{'other' if not inside else 'newer'} checkpoints (newest {newest}): the two runs' checkpoints would mix; "
            "resume into a new --output_dir"
        )


# ------------------------------------------------------------------------------------------ writing
def _write_failure(error: BaseException, folder: str) -> str | None:
    """A short reason when `error` is a failed write (disk full, permission, DCP's exception wrapping
    one), else None: a timed-out collective is not a write failure and is re-raised."""
    from torch.distributed.checkpoint.api import CheckpointException

    causes = [error]
    if isinstance(error, CheckpointException):
        causes = [
            failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()
        ]
    text = " ".join(f"{type(c).__name__}: {c}" for c in causes)
    disk_full = any(getattr(c, "errno", None) == errno.ENOSPC for c in causes) or "No space left" in text
    try:
        disk_full = disk_full or shutil.disk_usage(folder).free < 2**20
    except OSError:
        pass
    if disk_full:
        return "disk full"
    # torch.save reports I/O as a RuntimeError of its zip writer ("iostream error", "file write failed")
    io_words = (
        "iostream",
        "write failed",
        "Permission denied",
        "Read-only file system",
        "Errno",
        "I/O error",
    )
    if any(isinstance(c, OSError) for c in causes) or any(word in text for word in io_words):
        first = next((c for c in causes if isinstance(c, OSError)), causes[0])
        return getattr(first, "strerror", None) or str(first).strip().splitlines()[-1][:200]
    return None


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int, meta: dict, write_state) -> str:
    """A collective: every rank writes its part with `write_state(folder)`; the ranks agree that all
    writes succeeded; then the main process records the files' digests in step.json and renames the
    folder. On any failure every rank raises the same one-line UsageError; the partial folder is
    removed and the newest complete checkpoint kept."""
    from accelerate.utils import broadcast_object_list, gather_object

    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"{CHECKPOINT_PREFIX}{step:08d}")
    partial = final + ".partial"
    failure = None
    try:
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
            os.makedirs(partial)
        accelerator.wait_for_everyone()
        write_state(partial)
    except (Exception, _checkpoint_exception()) as error:  # noqa: B014 (CheckpointException is a BaseException)
        failure = _write_failure(error, root)
        if failure is None:
            _remove_partial_if_interrupted(accelerator, partial, error)
            raise  # a timed-out collective, say: not a write failure
    except KeyboardInterrupt as error:
        _remove_partial_if_interrupted(accelerator, partial, error)
        raise
    failures = gather_object([failure]) if accelerator.num_processes > 1 else [failure]
    failure = next((f for f in failures if f), None)
    if failure is None and accelerator.is_main_process:
        try:
            with open(os.path.join(partial, STEP_FILE), "w") as handle:
                json.dump(
                    seal({"format": FORMAT, "step": step, **meta, "files": files_manifest(partial)}),
                    handle,
                    indent=1,
                )
                handle.flush()
                os.fsync(handle.fileno())
            _remove(final)  # a checkpoint of an abandoned run at this step (refused unless --overwrite)
            os.replace(partial, final)  # atomic on one filesystem: the checkpoint exists whole or not at all
        except OSError as error:
            failure = _write_failure(error, root) or (error.strerror or str(error))
    if accelerator.num_processes > 1:
        verdict = [failure]
        broadcast_object_list(verdict, from_process=0)
        failure = verdict[0]
    if failure:
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        kept, _ = newest_verified(output_dir)
        raise UsageError(
            f"could not write the step-{step} checkpoint in {root} ({failure}); "
            f"newest complete checkpoint kept: {os.path.basename(kept) if kept else 'none'}",
            same_on_every_rank=True,
        )
    if accelerator.is_main_process:
        for old in checkpoint_folders(output_dir)[:-keep]:
            _remove(os.path.join(root, old))
    accelerator.wait_for_everyone()
    return final


def _remove_partial_if_interrupted(accelerator, partial: str, error: BaseException) -> None:
    """Ctrl-C while saving (perhaps wrapped by DCP): the main process removes the half-written folder."""
    from common.reliability import is_interrupt

    if accelerator.is_main_process and is_interrupt(error):
        shutil.rmtree(partial, ignore_errors=True)


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _remove(folder: str) -> None:
    """Rename, then delete: a checkpoint half-deleted by a kill is never mistaken for one (no step_ name)."""
    if os.path.exists(folder):
        doomed = folder + ".deleting"
        os.replace(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def tidy_checkpoints(output_dir: str, rejected: list[tuple[str, str]]) -> None:
    """Main process, at the start of a run (the folder locked): remove what killed runs left half-written
    or half-deleted, and move the checkpoints `latest` passed over into checkpoints/rejected/ (kept for a
    look; never counted, never resumed, never pruned)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.endswith((".partial", ".deleting")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name, _why in rejected:
        target = os.path.join(root, REJECTED_FOLDER, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        copies = 1
        while os.path.exists(target):  # an earlier rejection of this step is kept too
            copies += 1
            target = os.path.join(root, REJECTED_FOLDER, f"{name}.{copies}")
        os.replace(os.path.join(root, name), target)


def load_checkpoint(checkpointer, path: str, same_layout: bool) -> None:
    """checkpointer.load(path), a checkpoint verified moments ago. If it is gone by now (another run pruned it,
    someone deleted it), one line saying so, not the loader's traceback."""
    try:
        checkpointer.load(path, same_layout)
    except (Exception, _checkpoint_exception()) as error:  # noqa: B014 (DCP wraps each rank's FileNotFoundError in its CheckpointException, a BaseException)
        causes, seen = [], error
        while seen is not None:
            causes.append(seen)
            seen = seen.__cause__ or seen.__context__
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            causes += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        if os.path.isdir(path) and not any(isinstance(c, FileNotFoundError) for c in causes):
            raise
        raise UsageError(
            f"the checkpoint {path} was verified, then disappeared while it was loaded (another run pruning its "
            "folder?); nothing was trained: run again (--resume_from_checkpoint latest takes the newest left)",
            same_on_every_rank=True,
        ) from None


# ------------------------------------------------------------------------------------- checkpointers
def _unwrap(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer holds the real one


class FullState:
    """The contract every checkpointer keeps beside save and load: the full state (every tensor whole, keyed
    by parameter name, on the main process) and its digest, the same whatever the layout. Here for a model
    every rank holds whole; ShardedCheckpointer gathers it from any layout, DeepSpeed's through its engine."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, _unwrap(optimizer)

    def full_state(self) -> tuple[dict, dict]:
        """(model, optimizer) state with every tensor whole, keyed by name, on the main process (empty
        dicts elsewhere); a collective for sharded models. Cloned: for a plain CPU tensor the state dict
        holds the live tensor, which the next step would change."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        return copy.deepcopy(model_state), copy.deepcopy(optimizer_state)

    def digest(self, full_state: tuple[dict, dict] | None = None) -> str | None:
        """full_state_digest of the state (main process; None elsewhere). A collective unless the full
        state is passed in."""
        import torch.distributed as dist

        model_state, optimizer_state = full_state or self.full_state()
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        return full_state_digest(model_state, optimizer_state)


class AccelerateCheckpointer(FullState):
    """Accelerate's save_state / load_state (model, optimizer, every rank's RNG states), for a model every
    rank holds whole (one process, DDP)."""

    def __init__(self, accelerator, model, optimizer):
        super().__init__(model, optimizer)
        self.accelerator = accelerator

    def save(self, folder: str) -> None:
        self.accelerator.save_state(folder)

    def load(self, folder: str, same_layout: bool) -> None:
        self.accelerator.load_state(folder)


@contextlib.contextmanager
def one_process_dcp():
    """DCP warns, on every save and load, that it assumes one process when there is no process group:
    that is what one process means. The warning is silenced for that call only."""
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
            )
        yield


class ShardedCheckpointer(FullState):
    """PyTorch's distributed checkpoint: each rank writes its pieces, any layout reads them.

    What it holds is independent of how a layout groups or names things for its own sake:
    - the optimizer's STATE, by parameter name (DCP's get_state_dict keys it so), and no param_groups: how
      AdamW groups parameters is a matter of speed (fused AdamW takes one kind of tensor per group: tensor
      parallelism groups DTensor and plain parameters apart), and a checkpoint that stored groups by index
      could not be resumed by a layout that groups otherwise. A load takes the resuming run's own groups;
    - `aliases` {name here: name in the checkpoint}: a pipeline's last stage keeps the tied embedding's copy as
      head.weight, its optimizer state stored under tok_emb.weight (the tie is one weight in any layout).
    `restore_optimizer=False` loads the parameters only: the classic half-resume that train_gpt's
    `resume_without_optimizer_state` shows failing its check. `gathers_full_state`: whether this rank's
    piece goes into the full state (a pipeline stage's first rank; the others hold copies or pieces of it)."""

    def __init__(self, model, optimizer, restore_optimizer: bool = True, aliases: dict | None = None,
                 gathers_full_state: bool = True):  # fmt: skip
        super().__init__(model, optimizer)
        self.restore_optimizer, self.aliases, self.gathers_full_state = (
            restore_optimizer,
            aliases or {},
            gathers_full_state,
        )

    def _named_state(self, options=None) -> tuple[dict, dict]:
        """get_state_dict, the optimizer's state under the checkpoint's names (a copy whose original this rank
        also holds is dropped: equal by construction)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        state = dict(optimizer_state["state"])
        for here, there in self.aliases.items():
            if here in state:
                copy_state = state.pop(here)
                state.setdefault(there, copy_state)
        return model_state, {"state": state, "param_groups": optimizer_state["param_groups"]}

    def save(self, folder: str) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        model_state, optimizer_state = self._named_state()
        with one_process_dcp():
            dcp.save(
                {"model": model_state, "optimizer": {"state": optimizer_state["state"]}},
                checkpoint_id=os.path.join(folder, STATE_FOLDER),
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(torch.get_rng_state(), os.path.join(folder, f"rng_rank{rank}.pt"))

    def load(self, folder: str, same_layout: bool) -> None:
        """Read the checkpoint into this run's layout: its own groups, the state by name. The CPU RNG comes back
        only at the same layout (a rank of another world size has no counterpart); train_gpt draws no random
        numbers while training."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        if not self.restore_optimizer:
            with one_process_dcp():
                dcp.load({"model": model_state}, checkpoint_id=os.path.join(folder, STATE_FOLDER))
            set_model_state_dict(self.model, model_state)
            return
        state = dict(optimizer_state["state"])
        renamed = {
            here: there for here, there in self.aliases.items() if here in state and there not in state
        }
        for here, there in renamed.items():
            state[there] = state.pop(here)
        wanted = {"model": model_state, "optimizer": {"state": state}}
        with one_process_dcp():
            dcp.load(wanted, checkpoint_id=os.path.join(folder, STATE_FOLDER))
        state = dict(wanted["optimizer"]["state"])
        for here, there in self.aliases.items():  # renamed back, or a copy filled from its original here
            if here in renamed:
                state[here] = state.pop(there)
            elif here in optimizer_state["state"] and there in state:
                state[here] = _cloned(state[there])
        set_state_dict(self.model, self.optimizer, model_state_dict=wanted["model"],
                       optim_state_dict={"state": state, "param_groups": optimizer_state["param_groups"]})  # fmt: skip
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng = os.path.join(folder, f"rng_rank{rank}.pt")
        if same_layout and os.path.exists(rng):
            torch.set_rng_state(torch.load(rng))

    def full_state(self) -> tuple[dict, dict]:
        """Every tensor whole, by name, on the main process (empty elsewhere): each rank gathers its own piece
        whole (a collective over its tensor-parallel and sharding ranks), the first rank of each pipeline stage
        sends it to the main process, which puts the pieces together by name."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        model_state, optimizer_state = self._named_state(options)
        mine = (
            (_to_cpu(model_state), _to_cpu(optimizer_state["state"])) if self.gathers_full_state else ({}, {})
        )
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return copy.deepcopy(mine[0]), {"state": copy.deepcopy(mine[1])}
        pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, pieces, dst=0)
        if dist.get_rank() != 0:
            return {}, {}
        model_full = {name: value for piece, _ in pieces for name, value in piece.items()}
        state_full = {name: value for _, piece in pieces for name, value in piece.items()}
        return dict(sorted(model_full.items())), {"state": dict(sorted(state_full.items()))}


def _to_cpu(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {key: _to_cpu(value) for key, value in tree.items()}
    return copy.deepcopy(tree)


def _cloned(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return {key: _cloned(value) for key, value in tree.items()} if isinstance(tree, dict) else tree


def load_full_optimizer_state(optimizer, model, full_state: dict) -> None:
    """Load a name-keyed full optimizer state ({"state": {name: {...}}}, as full_state gives it) into a plain
    one-process optimizer, whose own state_dict is keyed by parameter position in its own groups. No
    collective: for the one-process reference, which runs on the main process alone."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    own = optimizer.state_dict()
    position = {}  # the optimizer numbers its parameters in the order its groups list them
    for group in optimizer.param_groups:
        for param in group["params"]:
            position[name_of[id(param)]] = len(position)
    state = {position[name]: value for name, value in full_state["state"].items() if name in position}
    optimizer.load_state_dict({"state": state, "param_groups": own["param_groups"]})
