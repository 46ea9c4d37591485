"""Checkpoint / resume, fault injection and "who is stuck" diagnostics for experiments that train.

- `save_checkpoint`: Accelerate's `save_state` (model, optimizer, every rank's RNG states) into
  checkpoints/step_XXXXXXXX.partial, then one rename: a half-written checkpoint is never "latest".
  `--keep_checkpoints K` prunes the oldest.
- `find_checkpoint`: "latest" (the highest complete step; none yet = start fresh, which is what an
  elastic restart of a run that had not checkpointed needs) or an explicit path.
- `inject_fault`: `--fail_at_step K --fail_rank R` kills rank R after step K, `--hang_at_step` stalls
  it. Only in the first attempt (TORCHELASTIC_RESTART_COUNT=0), so `--max_restarts` can recover.
- `Heartbeat`: each rank records its progress in <output_dir>/heartbeat/rank<R>; when a collective
  times out, the ranks that are behind are named in the error.
"""

from __future__ import annotations

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
class ResumableArgs(TrainArgs):
    checkpoint_every: int = flag(0, "save a checkpoint every N optimizer steps (0: never)")
    keep_checkpoints: int = flag(2, "how many complete checkpoints to keep (oldest pruned)")
    resume_from_checkpoint: str = flag("", "'latest' (newest complete checkpoint in --output_dir; none = start fresh) or a checkpoint folder")
    fail_at_step: int = flag(0, "fault injection: rank --fail_rank exits with status 13 after this step (first attempt only)")
    fail_rank: int = flag(0, "the rank --fail_at_step kills")
    hang_at_step: int = flag(0, "fault injection: rank --hang_rank stops responding after this step (first attempt only)")
    hang_rank: int = flag(0, "the rank --hang_at_step stalls")

    def validate(self) -> None:
        super().validate()
        for name in ("checkpoint_every", "fail_at_step", "hang_at_step", "fail_rank", "hang_rank"):
            require(getattr(self, name) >= 0, f"--{name} must be >= 0, got {getattr(self, name)}")
        require_positive(self, "keep_checkpoints")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete_checkpoints(output_dir: str) -> list[str]:
    """Names of the complete checkpoints (renamed from .partial, with step.json), oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root) if name.startswith(CHECKPOINT_PREFIX) and not name.endswith(".partial")
                  and os.path.isfile(os.path.join(root, name, "step.json")))


def find_checkpoint(cfg: ResumableArgs, output_dir: str) -> tuple[str | None, int]:
    """(checkpoint folder, its step), or (None, 0) to start from scratch."""
    if not cfg.resume_from_checkpoint:
        return None, 0
    if cfg.resume_from_checkpoint == "latest":
        complete = complete_checkpoints(output_dir)
        if not complete:
            return None, 0
        path = os.path.join(checkpoint_root(output_dir), complete[-1])
    else:
        path = os.path.abspath(cfg.resume_from_checkpoint)
    try:
        with open(os.path.join(path, "step.json")) as handle:
            return path, int(json.load(handle)["step"])
    except (FileNotFoundError, NotADirectoryError, KeyError, ValueError, json.JSONDecodeError):
        raise UsageError(f"--resume_from_checkpoint {cfg.resume_from_checkpoint!r}: {path} is not a complete checkpoint "
                         "(no valid step.json); use 'latest' or a checkpoints/step_XXXXXXXX folder") from None


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int) -> str:
    """Every rank calls this (each saves its own RNG state); the main process publishes it atomically."""
    final = os.path.join(checkpoint_root(output_dir), f"{CHECKPOINT_PREFIX}{step:08d}")
    partial = final + ".partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
        os.makedirs(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(partial)
    accelerator.wait_for_everyone()  # every rank's files are in before the folder counts
    if accelerator.is_main_process:
        with open(os.path.join(partial, "step.json"), "w") as handle:
            json.dump({"step": step}, handle)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # atomic on one filesystem: the checkpoint exists whole or not at all
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(os.path.join(checkpoint_root(output_dir), old), ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def inject_fault(cfg: ResumableArgs, step: int, rank: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return  # a restarted attempt runs clean, so elastic recovery can be shown
    if cfg.fail_at_step and step == cfg.fail_at_step and rank == cfg.fail_rank:
        print(f"rank {rank}: injected failure after step {step} (--fail_at_step); exiting with status 13", file=sys.stderr, flush=True)
        os._exit(13)  # like a crash: no cleanup, no goodbye to the other ranks
    if cfg.hang_at_step and step == cfg.hang_at_step and rank == cfg.hang_rank:
        print(f"rank {rank}: injected hang after step {step} (--hang_at_step); not responding", file=sys.stderr, flush=True)
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

    def laggards(self) -> str:
        """'rank 1 (finished step 50, never entered step 51)' for the ranks behind this one."""
        progress = {}
        for rank in range(self.world_size):
            try:
                with open(os.path.join(self.folder, f"rank{rank}"), "rb") as handle:
                    progress[rank] = self.BEAT.unpack(handle.read(self.BEAT.size))[0]
            except (FileNotFoundError, struct.error):
                progress[rank] = -1.0  # never reported: it did not start, or it is on another node without a shared disk
        mine = progress[self.rank]
        behind = [r for r, p in progress.items() if p < mine]
        if not behind:
            return "none visible from here (the stuck rank may be on another node)"
        return ", ".join(f"rank {r} (finished step {int(progress[r])}, never entered step {int(progress[r]) + 1})" if progress[r] >= 0
                         else f"rank {r} (never reported)" for r in behind)


def explain_timeout(error: RuntimeError, heartbeat: Heartbeat, cfg: TrainArgs, step: int) -> RuntimeError:
    """A gloo/NCCL timeout says nothing about who is missing; name the laggards."""
    text = str(error)
    if "imed out" not in text and "imeout" not in text and "closed" not in text:
        return error
    return RuntimeError(f"rank {heartbeat.rank}: a collective at step {step + 1} failed after waiting up to "
                        f"{cfg.dist_timeout_s:.0f}s (--dist_timeout_s); ranks behind: {heartbeat.laggards()}. "
                        f"Cause: {text.splitlines()[0][:200]}")
