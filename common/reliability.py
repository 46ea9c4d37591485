"""Checkpoint / resume, fault injection and "who is stuck" diagnostics for experiments that train.

- `save_checkpoint`: Accelerate's `save_state` (model, optimizer, every rank's RNG states) into
  checkpoints/step_XXXXXXXX.partial, then one rename: a half-written checkpoint is never "latest".
  Its step.json records the step, the run's trajectory (every flag that changes what it computes, and
  the world size) and `state_digest`, a sha256 of every parameter and optimizer-state byte.
  `--keep_checkpoints K` prunes the oldest, only once the new one is complete.
- `find_checkpoint`: "latest" (the highest complete step; none yet = start fresh, which is what an
  elastic restart of a run that had not checkpointed needs) or an explicit path; `refuse_incompatible`
  refuses a resume whose trajectory differs from the checkpoint's, naming the field.
- `OutputLock`: one run at a time per --output_dir (an exclusive `flock`, held by the main process).
- `inject_fault`: `--fail_at_step K --fail_rank R` kills rank R after step K, `--hang_at_step` stalls
  it. Only in the first attempt (TORCHELASTIC_RESTART_COUNT=0), so `--max_restarts` can recover.
- `Heartbeat`: each rank records its progress in <output_dir>/heartbeat/rank<R>; when a collective
  times out, the ranks that are behind are named in the error.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass

from common.config import TrainArgs, UsageError, flag, require, require_positive

CHECKPOINT_PREFIX = "step_"


@dataclass
class FaultArgs(TrainArgs):
    """Fault injection, to see what a crash or a hang does to a run (and that resume repairs it)."""

    fail_at_step: int = flag(
        0, "fault injection: rank --fail_rank exits with status 13 after this step (first attempt only)"
    )
    fail_rank: int = flag(0, "the rank --fail_at_step kills")
    hang_at_step: int = flag(
        0, "fault injection: rank --hang_rank stops responding after this step (first attempt only)"
    )
    hang_rank: int = flag(0, "the rank --hang_at_step stalls")

    def validate(self) -> None:
        super().validate()
        from common.runtime import launched_world_size

        for name in ("fail_at_step", "hang_at_step", "fail_rank", "hang_rank"):
            require(getattr(self, name) >= 0, f"--{name} must be >= 0, got {getattr(self, name)}")
        world_size = launched_world_size(self)
        for step_flag, rank_flag in (("fail_at_step", "fail_rank"), ("hang_at_step", "hang_rank")):
            rank = getattr(self, rank_flag)
            require(
                not getattr(self, step_flag) or rank < world_size,
                f"--{rank_flag} {rank}: this launch has ranks 0..{world_size - 1}",
            )


@dataclass
class ResumableArgs(FaultArgs):
    checkpoint_every: int = flag(0, "save a checkpoint every N optimizer steps (0: never)")
    keep_checkpoints: int = flag(2, "how many complete checkpoints to keep (oldest pruned)")
    resume_from_checkpoint: str = flag(
        "", "'latest' (newest complete checkpoint in --output_dir; none = start fresh) or a checkpoint folder"
    )

    def validate(self) -> None:
        super().validate()
        require(self.checkpoint_every >= 0, f"--checkpoint_every must be >= 0, got {self.checkpoint_every}")
        require_positive(self, "keep_checkpoints")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete_checkpoints(output_dir: str) -> list[str]:
    """Names of the complete checkpoints (renamed from .partial, with step.json), oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    return sorted(
        name
        for name in os.listdir(root)
        if name.startswith(CHECKPOINT_PREFIX)
        and not name.endswith(".partial")
        and os.path.isfile(os.path.join(root, name, "step.json"))
    )


def find_checkpoint(cfg: ResumableArgs, output_dir: str) -> tuple[str | None, dict]:
    """(checkpoint folder, its step.json), or (None, {"step": 0}) to start from scratch."""
    if not getattr(cfg, "resume_from_checkpoint", ""):
        return None, {"step": 0}
    if cfg.resume_from_checkpoint == "latest":
        complete = complete_checkpoints(output_dir)
        if not complete:
            return None, {"step": 0}
        path = os.path.join(checkpoint_root(output_dir), complete[-1])
    else:
        path = os.path.abspath(cfg.resume_from_checkpoint)
    try:
        with open(os.path.join(path, "step.json")) as handle:
            meta = json.load(handle)
        meta["step"] = int(meta["step"])
        return path, meta
    except (FileNotFoundError, NotADirectoryError, KeyError, ValueError, TypeError, json.JSONDecodeError):
        raise UsageError(
            f"--resume_from_checkpoint {cfg.resume_from_checkpoint!r}: {path} is not a complete checkpoint "
            "(no valid step.json); use 'latest' or a checkpoints/step_XXXXXXXX folder"
        ) from None


def first_difference(saved: dict, now: dict, where: str = "in the checkpoint") -> str | None:
    """'--lr: 0.1 in the checkpoint, 0.2 now' for the first field of `now` that differs, else None.
    Fields only `saved` has (a flag since declared result-neutral, for instance) are not compared."""
    for name in sorted(now):
        if saved.get(name) != now[name]:
            label = name if name == "world_size" else f"--{name}"
            return f"{label}: {saved.get(name)!r} {where}, {now[name]!r} now"
    return None


def refuse_incompatible(cfg: ResumableArgs, path: str, meta: dict, world_size: int) -> None:
    """A resume continues the SAME run: the flags that determine the trajectory (and the world size,
    which sets the global batch) must be the checkpoint's. --max_steps may grow, never shrink past it."""
    if cfg.max_steps <= meta["step"]:
        raise UsageError(
            f"--max_steps {cfg.max_steps}: the checkpoint {path} is already at step {meta['step']}; "
            f"pass --max_steps > {meta['step']} to train on"
        )
    saved = meta.get("trajectory")
    if saved is None:
        raise UsageError(
            f"--resume_from_checkpoint: {path} records no trajectory (written by an older version); start afresh"
        )
    now = {k: v for k, v in cfg.trajectory(world_size).items() if k != "max_steps"}
    difference = first_difference({k: v for k, v in saved.items() if k != "max_steps"}, now)
    if difference:
        raise UsageError(
            f"cannot resume {path}: {difference}; resume with the checkpoint's settings or start a new --output_dir"
        )


def state_digest(model, optimizer) -> str | None:
    """sha256 over every parameter / buffer and every optimizer-state value, names included: two states
    with the same digest are bitwise equal. `model` unwrapped (no DDP `module.` prefix). None for a
    sharded model: one rank's shards are not the state."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    optimizer_state = sorted(optimizer.state_dict()["state"].items())
    return digest_named_values(
        [*model.state_dict().items()]
        + [
            (f"optimizer.{index}.{key}", value)
            for index, state in optimizer_state
            for key, value in sorted(state.items())
        ]
    )


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


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int, meta: dict, write_state=None) -> str:
    """Every rank calls this (each saves its own RNG state); the main process publishes it atomically.
    `write_state(folder)` writes the state (default: Accelerate's save_state; train_gpt: DCP).
    `meta` (trajectory, state digest) goes into step.json beside the step. A full disk ends the run
    with one line; the newest complete checkpoint is kept, the half-written one removed."""
    final = os.path.join(checkpoint_root(output_dir), f"{CHECKPOINT_PREFIX}{step:08d}")
    partial = final + ".partial"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
            os.makedirs(partial)
        accelerator.wait_for_everyone()
        (write_state or accelerator.save_state)(partial)
        accelerator.wait_for_everyone()  # every rank's files are in before the folder counts
        if accelerator.is_main_process:
            with open(os.path.join(partial, "step.json"), "w") as handle:
                json.dump({"step": step, **meta}, handle)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)  # atomic on one filesystem: the checkpoint exists whole or not at all
            for old in complete_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(os.path.join(checkpoint_root(output_dir), old), ignore_errors=True)
    except (OSError, RuntimeError) as error:
        # torch.save reports a full disk as a RuntimeError of its zip writer ("iostream error"), not ENOSPC
        disk_full = (
            getattr(error, "errno", None) == errno.ENOSPC
            or shutil.disk_usage(checkpoint_root(output_dir)).free < 2**20
        )
        if isinstance(error, RuntimeError) and not disk_full:
            raise  # a timed-out collective, say: not a write failure
        shutil.rmtree(partial, ignore_errors=True)
        kept = complete_checkpoints(output_dir)
        reason = "disk full" if disk_full else (error.strerror or str(error))
        raise UsageError(
            f"could not write the step-{step} checkpoint in {checkpoint_root(output_dir)} ({reason}); "
            f"newest complete checkpoint kept: {kept[-1] if kept else 'none'}"
        ) from None
    accelerator.wait_for_everyone()
    return final


class OutputLock:
    """One run at a time per --output_dir: an exclusive `flock` on <output_dir>/.lock, held by the main
    process for the whole run. The kernel drops it when the process dies, however it dies, so a killed
    run never leaves a stale lock; a second run is refused with the holder's pid."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, ".lock")
        self.descriptor: int | None = None

    def acquire(self) -> None:
        self.descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.descriptor)
            self.descriptor = None
            raise UsageError(
                f"--output_dir {os.path.dirname(self.path)} is in use by another run (pid {holder}); "
                "wait for it to finish or choose another --output_dir"
            ) from None
        os.ftruncate(self.descriptor, 0)
        os.pwrite(self.descriptor, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.descriptor is not None:
            os.close(self.descriptor)  # closing the descriptor drops the flock
            self.descriptor = None


def inject_fault(cfg: ResumableArgs, step: int, rank: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return  # a restarted attempt runs clean, so elastic recovery can be shown
    if cfg.fail_at_step and step == cfg.fail_at_step and rank == cfg.fail_rank:
        print(
            f"rank {rank}: injected failure after step {step} (--fail_at_step); exiting with status 13",
            file=sys.stderr,
            flush=True,
        )
        os._exit(13)  # like a crash: no cleanup, no goodbye to the other ranks
    if cfg.hang_at_step and step == cfg.hang_at_step and rank == cfg.hang_rank:
        print(
            f"rank {rank}: injected hang after step {step} (--hang_at_step); not responding",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(3600)


class Heartbeat:
    """Each rank's progress in a small file: readable by any rank when the network is not.

    The value is the last finished step s, or s + 0.5 while the rank is inside step s + 1 (where the
    collectives are). A rank that timed out waiting in step 51 reads 50.5 for itself; a peer that
    died or hung after step 50 reads 50.0: that peer is named."""

    BEAT = struct.Struct("<d")  # one float64 per rank file

    def __init__(self, output_dir: str, rank: int, world_size: int):
        self.folder, self.rank, self.world_size = os.path.join(output_dir, "heartbeat"), rank, world_size
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"rank{rank}"), "wb") as handle:
            handle.write(bytes(self.BEAT.size))
        with open(os.path.join(self.folder, f"rank{rank}"), "r+b") as handle:
            # A memory map: a beat is an 8-byte store into the page cache, no system call (a pwrite per
            # beat cost ~0.1 ms per step here); other ranks of this host read it through the same cache.
            # Binary, not text: formatting the step as text cost 15-20 µs per 2-rank step here
            # (benchmarks/step_overhead.py), packing it 2-6 µs.
            self.page = mmap.mmap(handle.fileno(), self.BEAT.size)
        self.finished(0)

    def finished(self, step: int) -> None:
        self.BEAT.pack_into(self.page, 0, step)

    def entering(self, step: int) -> None:
        self.BEAT.pack_into(self.page, 0, step - 0.5)

    def progress(self) -> dict[int, float]:
        """Every rank's last beat; -1 for a rank that never reported (it did not start, or it runs on
        another node without a shared disk)."""
        progress = {}
        for rank in range(self.world_size):
            try:
                with open(os.path.join(self.folder, f"rank{rank}"), "rb") as handle:
                    progress[rank] = self.BEAT.unpack(handle.read(self.BEAT.size))[0]
            except (FileNotFoundError, struct.error):
                progress[rank] = -1.0
        return progress

    def laggards(self) -> str:
        """'rank 1 (finished step 50, never entered step 51)' for the ranks behind this one."""
        progress = self.progress()
        mine = progress[self.rank]
        behind = [r for r, p in progress.items() if p < mine]
        if not behind:
            return "none visible from here (the stuck rank may be on another node)"
        return ", ".join(
            f"rank {r} (finished step {int(progress[r])}, never entered step {int(progress[r]) + 1})"
            if progress[r] >= 0
            else f"rank {r} (never reported)"
            for r in behind
        )


def explain_timeout(error: RuntimeError, heartbeat: Heartbeat, timeout_s: float) -> RuntimeError:
    """A gloo/NCCL timeout says nothing about who is missing; name the laggards. Other errors pass through."""
    text = str(error)
    if "imed out" not in text and "imeout" not in text and "closed" not in text:
        return error
    step = heartbeat.progress()[heartbeat.rank] + 1
    return RuntimeError(
        f"rank {heartbeat.rank}: a collective at step {int(step)} failed after waiting up to "
        f"{timeout_s:.0f}s (--dist_timeout_s); ranks behind: {heartbeat.laggards()}. "
        f"Cause: {text.splitlines()[0][:200]}"
    )
