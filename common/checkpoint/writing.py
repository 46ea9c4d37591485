"""Writing a checkpoint whole or not at all (every rank writes, the ranks agree, the main process seals and
renames), pruning, tidying what a killed run left, and loading a verified one."""

from __future__ import annotations

import errno
import json
import os
import shutil

from common.checkpoint.finding import newest_verified
from common.checkpoint.flags import CHECKPOINT_PREFIX, FORMAT, REJECTED_FOLDER, STEP_FILE
from common.checkpoint.integrity import checkpoint_folders, checkpoint_root, files_manifest, seal
from common.config import UsageError


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
