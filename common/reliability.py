"""One run per folder, fault injection and "who is stuck" diagnostics for experiments that train
(checkpoints and resume: common/checkpoint/).

- `OutputLock`: one run at a time per --output_dir (an exclusive `flock`, held by the main process).
- `inject_fault`: `--fail_at_step K --fail_rank R` kills rank R after step K, `--hang_at_step` stalls
  it. Only in the first attempt (TORCHELASTIC_RESTART_COUNT=0), so `--max_restarts` can recover.
- `Heartbeat`: each rank records its progress in <output_dir>/heartbeat/rank<R>; when a collective
  times out, the ranks that are behind are named in the error.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import signal
import struct
import sys
import time
from dataclasses import dataclass

from common.config import TrainArgs, UsageError, flag, require


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


class OutputLock:
    """One run at a time per --output_dir: an exclusive `flock` on <output_dir>/.lock, held by the main
    process for the whole run. The kernel drops it when the process dies, however it dies, so a killed
    run never leaves a stale lock; a second run is refused with the holder's pid."""

    NAME = ".lock"

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, self.NAME)
        self.descriptor: int | None = None

    def acquire(self) -> None:
        self.descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.descriptor)
            self.descriptor = None
            raise self.in_use(os.path.dirname(self.path), holder) from None
        os.ftruncate(self.descriptor, 0)
        os.pwrite(self.descriptor, f"{os.getpid()}\n".encode(), 0)

    @staticmethod
    def in_use(output_dir: str, holder: str) -> UsageError:
        return UsageError(
            f"--output_dir {output_dir} is in use by another run (pid {holder}); "
            "wait for it to finish or choose another --output_dir"
        )

    @classmethod
    def refuse_if_held(cls, output_dir: str) -> None:
        """Refuse a folder a live run holds, before anything reads its files as an earlier run's (a live run's
        folder has a config.json and no summary.json yet: it is not a run that did not finish). Takes nothing:
        a shared lock tried and dropped at once."""
        try:
            descriptor = os.open(os.path.join(output_dir, cls.NAME), os.O_RDONLY)
        except OSError:
            return  # no lock file (no run has held it), or unreadable: acquire() says what is wrong
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            raise cls.in_use(output_dir, holder) from None
        finally:
            os.close(descriptor)  # closing the descriptor drops the shared lock, if it was taken

    def release(self) -> None:
        if self.descriptor is not None:
            os.close(self.descriptor)  # closing the descriptor drops the flock
            self.descriptor = None


def inject_fault(cfg: FaultArgs, step: int, rank: int) -> None:
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


INTERRUPTED = "interrupted.rank{rank}"  # in <output_dir>/heartbeat/: this rank received Ctrl-C


@contextlib.contextmanager
def marking_ctrl_c(output_dir: str, rank: int):
    """While the body runs, a Ctrl-C on this rank first leaves a mark beside its heartbeat, then raises
    KeyboardInterrupt as usual; the handler that was there before is restored after. A peer whose collective
    fails because this rank stopped reads the mark (is_interrupt): the launcher signals the ranks one after
    another, and the rank that stops first must not look like a crash to the others; a SIGTERM after a peer's mark
    (torchrun ending the rest of the ranks) is that Ctrl-C too. A signal handler can only be set from the main
    thread; elsewhere nothing is marked."""
    folder = os.path.join(output_dir, "heartbeat")
    mark = os.path.join(folder, INTERRUPTED.format(rank=rank))

    def on_ctrl_c(signum, frame):
        try:
            os.makedirs(folder, exist_ok=True)
            with open(mark, "w"):
                pass
        except OSError:
            pass  # an unwritable folder: the peers fall back to waiting for their own signal
        raise KeyboardInterrupt

    def on_end(signum, frame):
        # the launcher ends the other ranks once one has stopped: after a peer's Ctrl-C (its mark here), this rank
        # was interrupted too, and says so as a Ctrl-C (before this, the launcher's SIGTERM could end it before its
        # failed collective said so, under load); after anything else, SIGTERM does what it did
        if a_rank_was_interrupted(output_dir):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, previous_term)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        previous = signal.signal(signal.SIGINT, on_ctrl_c)
        previous_term = signal.signal(signal.SIGTERM, on_end)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)


def a_rank_was_interrupted(output_dir: str) -> bool:
    """Whether some rank of the run left its Ctrl-C mark (marking_ctrl_c) beside the heartbeats."""
    folder = os.path.join(output_dir, "heartbeat")
    return os.path.isdir(folder) and any(name.startswith("interrupted.rank") for name in os.listdir(folder))


def clear_ctrl_c_marks(output_dir: str) -> None:
    """A new run's start: the marks an earlier interrupted run left are not this run's."""
    folder = os.path.join(output_dir, "heartbeat")
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith("interrupted.rank"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))


def is_interrupt(error: BaseException | None, output_dir: str | None = None) -> bool:
    """Ctrl-C, also where a library caught it and raised its own error (DCP wraps it in a
    CheckpointException), or where this rank's collective failed first because a peer had already
    stopped on its own Ctrl-C: its mark beside the heartbeats says so (marking_ctrl_c), however the
    launcher's signals interleave; without a shared folder to read it, this rank waits a moment for its own."""
    seen, first = set(), error
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, KeyboardInterrupt):
            return True
        failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict) and any(
            isinstance(f[0] if isinstance(f, tuple) else f, KeyboardInterrupt) for f in failures.values()
        ):
            return True
        error = error.__cause__ or error.__context__
    peer_gone = any(sign in str(first) for sign in PEER_GONE)
    if peer_gone and output_dir is not None and a_rank_was_interrupted(output_dir):
        return True
    grace_s = PEER_SIGNAL_GRACE_S if peer_gone else 0.0
    try:
        _a_python_call()  # a Ctrl-C that arrived while C++ code waited runs its handler here
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            time.sleep(0.05)
    except KeyboardInterrupt:
        return True
    return False


PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
PEER_SIGNAL_GRACE_S = 1.0


def _a_python_call() -> None:
    pass
