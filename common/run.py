"""The life of one run, owned in one place: `with start_run(cfg, "ddp_linear") as session:`.

On entry, in this order. Each step can refuse with one line and exit status 2, and none of them
writes anything before the steps that could refuse have passed:
1. --output_dir resolved; a folder holding a finished run is refused unless --overwrite (resuming a
   finished run is a no-op that says so, when its settings and data are the same);
2. the checkpoint to resume from found and verified, every byte against the digests it was saved with
   (common/checkpoint/), and refused if it fails, if its settings or training data differ from this
   run's, or if it would mix two runs' checkpoints in one folder;
3. the folder locked by the main process: a second run into it is refused, naming the holder. With
   --overwrite, the earlier run's files (checkpoints, metrics, heartbeats, W&B run) are moved aside
   to <output_dir>.replaced-<time>, said in one line: a clean run, and nothing lost;
4. trackers resolved (W&B offline without a key; a resumed run continues its W&B run);
5. the Accelerator (CPU over gloo where torch sees no GPU; a timeout on every collective);
6. config.json, metrics.jsonl and the trackers started (main process only);
7. the `distributed` check: the ranks Accelerate sees are the ranks that were launched. If not, the
   run ends right here (summary.json says why, exit 1): training on a broken launch proves nothing.

In the `with` body the experiment does its idea, adding `session.metrics`, `session.check(...)`,
`session.parity_check(...)` and `session.log(...)`. On a normal exit: summary.json, the verdict broadcast so
every rank exits with the same code (`run.exit_code`: 0 passed, 1 a check failed), then the shutdown
in the order gloo needs. On an exception: trackers closed, lock released, and a timed-out collective
re-raised naming the rank that is behind.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import sys

import torch

from common.checkpoint import (
    Found,
    checkpoint_folders,
    find_checkpoint,
    first_difference,
    newest_verified,
    refuse_incompatible,
    refuse_mixed_lineage,
    tidy_checkpoints,
)
from common.config import INTERRUPTED_EXIT_CODE, RunArgs, UsageError
from common.device import backend_for
from common.reliability import OutputLock, clear_ctrl_c_marks, explain_timeout, is_interrupt, marking_ctrl_c
from common.runtime import check_distributed, launched_world_size, make_accelerator
from common.tracking import RunRecorder, resolve_trackers


class RunEnded(SystemExit):
    """The run ended early but cleanly (a failed `distributed` check, nothing to resume): exit with `code`."""


def resolve_output_dir(cfg: RunArgs, experiment: str) -> str:
    """--output_dir, or runs/<experiment>; under a W&B sweep (the agent sets WANDB_SWEEP_ID and
    WANDB_RUN_ID) one folder per trial, <folder of WANDB_SWEEP_PARAM_PATH or runs/sweeps/<id>>/<run id>."""
    default = os.path.join("runs", experiment)
    sweep_id, run_id = os.environ.get("WANDB_SWEEP_ID"), os.environ.get("WANDB_RUN_ID")
    if sweep_id and run_id:
        param_path = os.environ.get("WANDB_SWEEP_PARAM_PATH")
        default = os.path.join(
            os.path.dirname(param_path) if param_path else os.path.join("runs", "sweeps", sweep_id), run_id
        )
    output_dir = os.path.abspath(cfg.output_dir or default)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"--output_dir {output_dir} exists and is not a directory")
    return output_dir


def parity_check(difference: float, atol: float, what: str) -> dict:
    """A check that a distributed result equals its reference: passes when |difference| <= atol (NaN fails)."""
    return {"passed": bool(difference <= atol), "detail": f"{what} = {difference:.2e}, tolerance {atol:.0e}"}


class Run:
    """One run's owner from start to shutdown; see the module docstring for the order of things."""

    def __init__(
        self,
        cfg: RunArgs,
        experiment: str,
        *,
        needs_process_group: bool = False,
        backend: str | None = None,
        data_identity: dict | None = None,
        **accelerator_kwargs,
    ):
        self.cfg, self.experiment = cfg, experiment
        self.needs_process_group, self.backend, self.accelerator_kwargs = (
            needs_process_group,
            backend,
            accelerator_kwargs,
        )
        # content hashes of what the run trains on ({"data_sha256": ..., ...}): recorded in every
        # checkpoint and in summary.json; a resume on other data is refused, naming both
        self.data_identity = data_identity or {}
        self.metrics: dict = {}
        self.checks: dict = {}
        self.exit_code: int | None = None
        self.heartbeat = None  # set by a TrainLoop, read when a collective times out
        self.progress_bar = None  # set by a TrainLoop, cleared when the run stops on an error
        self.accelerator = self.recorder = None
        self.own_group = self.finished = self.ended_early = False
        self.lock: OutputLock | None = None
        self.scoped = contextlib.ExitStack()  # what the run sets for its own time only (the Ctrl-C handler)

    # ------------------------------------------------------------------------------------------ start
    def __enter__(self) -> Run:
        try:
            self._start()
        except UsageError as error:
            # refused before the run started: every rank read the same flags and files and refused alike
            if self.accelerator is None:
                error.same_on_every_rank = True
            self._abort()
            raise
        except BaseException:
            self._abort()
            raise
        # a Ctrl-C on this rank leaves a mark its peers read if their collective fails first (is_interrupt)
        self.scoped.enter_context(marking_ctrl_c(self.output_dir, self.accelerator.process_index))
        return self

    def _start(self) -> None:
        cfg = self.cfg
        world_size = launched_world_size(cfg)
        self.output_dir = resolve_output_dir(cfg, self.experiment)
        resumable = hasattr(cfg, "resume_from_checkpoint")
        found = find_checkpoint(cfg, self.output_dir) if resumable else Found()
        self.checkpoint, self.checkpoint_meta = found.path, found.meta
        self.start_step, self.samples_seen = found.meta["step"], found.meta["samples_seen"]
        if (
            cfg.overwrite
            and self.checkpoint
            and os.path.commonpath([self.checkpoint, self.output_dir]) == self.output_dir
        ):
            raise UsageError(
                f"--resume_from_checkpoint {self.checkpoint} lies inside --output_dir {self.output_dir}, which "
                "--overwrite moves aside: resume into another --output_dir"
            )
        if int(os.environ.get("RANK", "0")) == 0:
            # a live run's folder is in use, not an earlier run's (the main process only: the other ranks would
            # see their own run's lock once rank 0 has taken it)
            OutputLock.refuse_if_held(self.output_dir)
        self._refuse_finished_run(world_size)
        if resumable:
            refuse_mixed_lineage(cfg, self.output_dir, found)
        if self.checkpoint:
            refuse_incompatible(cfg, self.checkpoint, self.checkpoint_meta, world_size, self.data_identity)
        if int(os.environ.get("RANK", "0")) == 0:  # the main process, before any Accelerator exists
            self._take_folder(found)
        self.trackers = resolve_trackers(cfg.report_to, self.output_dir, continuing=bool(self.checkpoint))
        self.accelerator = make_accelerator(
            cfg, self.output_dir, self.trackers.log_with, backend=self.backend, **self.accelerator_kwargs
        )
        self.recorder = RunRecorder(
            self.accelerator,
            self.experiment,
            cfg,
            self.output_dir,
            self.trackers,
            resume_step=self.start_step if self.checkpoint else None,
            data_identity=self.data_identity,
        )
        self.checks["distributed"] = check_distributed(self.accelerator, cfg)
        if not self.checks["distributed"]["passed"]:
            self.end_now()
        if self.needs_process_group and not torch.distributed.is_initialized():
            # Experiments about the raw torch.distributed API need a group even in one process, where
            # Accelerate makes none: a 1-rank group of the run's device's backend (gloo for the CPU, NCCL for a
            # GPU, whose tensors the experiment puts on accelerator.device) on a port the OS picks.
            torch.distributed.init_process_group(
                backend_for(self.accelerator.device),
                init_method="tcp://127.0.0.1:0",
                rank=0,
                world_size=1,
                device_id=self.accelerator.device if self.accelerator.device.type != "cpu" else None,
            )
            self.own_group = True

    def _take_folder(self, found: Found) -> None:
        """Main process: lock --output_dir (one run at a time); with --overwrite move the earlier run's
        files aside, whole; tidy the checkpoints (half-written ones removed, those `latest` passed over
        set aside) and say what happened."""
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            self.lock = OutputLock(self.output_dir)
            self.lock.acquire()
            if self.cfg.overwrite and set(os.listdir(self.output_dir)) - {OutputLock.NAME}:
                moved = f"{self.output_dir}.replaced-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S-%f}"
                os.replace(self.output_dir, moved)  # the lock's file moves with it, still held
                os.makedirs(self.output_dir)
                earlier, self.lock = self.lock, OutputLock(self.output_dir)
                self.lock.acquire()
                earlier.release()
                os.remove(os.path.join(moved, OutputLock.NAME))
                print(f"{self.experiment}: --overwrite: the earlier run in {self.output_dir} was moved to {moved}",
                      file=sys.stderr, flush=True)  # fmt: skip
            tidy_checkpoints(self.output_dir, found.rejected)
            clear_ctrl_c_marks(self.output_dir)
        except OSError as error:
            raise UsageError(
                f"--output_dir {self.output_dir}: cannot write there ({error.strerror or error})"
            ) from None
        if found.rejected:
            passed_over = "; ".join(f"{name} ({why})" for name, why in found.rejected)
            print(f"{self.experiment}: --resume_from_checkpoint latest: resuming from {os.path.basename(found.path)}, "
                  f"the newest checkpoint that verifies; passed over {passed_over}: moved to "
                  "checkpoints/rejected/", file=sys.stderr, flush=True)  # fmt: skip

    def _refuse_finished_run(self, world_size: int) -> None:
        """A folder holding a finished run: refused (unless --overwrite), or, asked to resume it with the same
        trajectory and data, a no-op that says so (exit 0). A folder holding an earlier run that never
        finished (its config.json or metrics.jsonl, no checkpoint to continue from) is refused too: a fresh
        run would overwrite them without a word (unless it resumes: with no checkpoint yet, an elastic restart)."""
        summary_path = os.path.join(self.output_dir, "summary.json")
        resuming = bool(getattr(self.cfg, "resume_from_checkpoint", ""))
        if self.cfg.overwrite:
            return
        if not os.path.exists(summary_path):
            earlier = [
                name
                for name in ("config.json", "metrics.jsonl")
                if os.path.isfile(os.path.join(self.output_dir, name))  # regular files, as a run leaves them
            ]
            # (a folder with checkpoints: refuse_mixed_lineage says how to continue; resuming with none to resume:
            # an elastic restart of this very run)
            if earlier and not resuming and not checkpoint_folders(self.output_dir):
                raise UsageError(
                    f"--output_dir {self.output_dir} holds an earlier run that did not finish ({', '.join(earlier)}, "
                    "no checkpoint to continue from); pass --overwrite (it is moved aside) or another --output_dir"
                )
            return
        if not resuming:
            raise UsageError(
                f"--output_dir {self.output_dir} already holds a finished run (summary.json); "
                "pass --overwrite or another --output_dir"
            )
        try:
            with open(summary_path) as handle:
                finished = json.load(handle)
        except (OSError, ValueError):
            raise UsageError(
                f"--output_dir {self.output_dir}: its summary.json is unreadable; pass --overwrite or another --output_dir"
            ) from None
        then = {**finished.get("trajectory", {}), "data": finished.get("data", {})}
        if (
            "trajectory" not in finished
        ):  # written before summaries recorded it: the flags, less the neutral ones
            config = finished.get("config", {})
            then = {**{k: v for k, v in config.items() if k not in self.cfg.result_neutral},
                    "world_size": finished.get("world_size"), "data": finished.get("data", {})}  # fmt: skip
        now = {**self.cfg.trajectory(world_size), "data": self.data_identity}
        difference = first_difference(then, now, where="in that run")
        if difference:
            raise UsageError(
                f"--output_dir {self.output_dir} already holds a finished run with other settings ({difference}); "
                "pass --overwrite or another --output_dir"
            )
        print(
            f"{self.experiment}: the run in {self.output_dir} already finished (summary.json); nothing to resume",
            flush=True,
        )
        raise RunEnded(0)

    # ----------------------------------------------------------------------------------- during the run
    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def print(self, line: str) -> None:
        self.recorder.print(line)

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        self.recorder.log(step, metrics, console)

    def log_table(self, name: str, rows: list[dict], image_path: str | None = None) -> None:
        self.recorder.log_table(name, rows, image_path)

    def check(self, name: str, passed: bool, detail: str) -> None:
        self.checks[name] = {"passed": bool(passed), "detail": detail}

    def skip_check(self, name: str, why: str) -> None:
        """A check this run cannot make (`why` says what would let it): neither passed nor failed (`passed` null,
        `skipped` true), shown as SKIP; the run's verdict is that of the checks that ran."""
        self.checks[name] = {"passed": None, "skipped": True, "detail": f"not run: {why}"}

    def parity_check(self, name: str, difference: float, atol: float, what: str) -> None:
        """`what` = difference, within atol: e.g. ("matches_single_process", 3e-8, 1e-5, "max |DDP - one process|")."""
        self.checks[name] = parity_check(difference, atol, what)

    # ------------------------------------------------------------------------------------------- end
    def end_now(self) -> None:
        """End the run here, cleanly: summary.json with the checks so far, shutdown, exit code. For a
        check whose failure makes the rest meaningless (`distributed`, `resume_restored_state`). summary.json
        says the run did not run to its end (`completed`: false)."""
        self.ended_early = True
        self.__exit__(None, None, None)
        raise RunEnded(self.exit_code)

    def __exit__(self, exc_type, error, traceback) -> bool:
        if self.finished:  # end_now() already wrote the summary and shut down
            return False
        if exc_type is None:
            self.finished = True
            self.exit_code = self.recorder.finish(self.metrics, self.checks, completed=not self.ended_early)
            shutdown(self.accelerator, self.own_group, self.recorder)
            self._release()
            return False
        self._abort()
        if is_interrupt(error, self.output_dir):
            self._say_interrupted()
            raise RunEnded(INTERRUPTED_EXIT_CODE) from None
        if isinstance(error, RuntimeError) and self.heartbeat is not None:
            explained = explain_timeout(error, self.heartbeat, self.cfg.dist_timeout_s)
            if explained is not error:
                raise explained from None
        return False

    def _say_interrupted(self) -> None:
        """One line, from the main process only: where the run stopped and what to resume."""
        if int(os.environ.get("RANK", "0")) != 0:
            return
        where = ""
        if self.heartbeat is not None:
            where = f" in step {int(self.heartbeat.progress()[self.heartbeat.rank] + 1)}"
        newest = newest_verified(self.output_dir)[0] if getattr(self.cfg, "checkpoint_every", 0) else None
        resume = (f"newest checkpoint {newest}: continue with --resume_from_checkpoint latest" if newest
                  else "no checkpoint to continue from")  # fmt: skip
        print(f"{self.experiment}: interrupted (Ctrl-C){where}; {resume}", file=sys.stderr, flush=True)

    def _abort(self) -> None:
        """After an error: clear the progress bar (the error is the last line the user sees), close the
        trackers (marks the W&B run as ended) and free the folder; no barrier, since the other ranks may
        be the reason we are here."""
        if self.progress_bar is not None:
            self.progress_bar.leave = False
            self.progress_bar.close()
        if self.recorder is not None:
            self.recorder.close_trackers()
        self._release()

    def _release(self) -> None:
        self.scoped.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def start_run(cfg: RunArgs, experiment: str, **options) -> Run:
    """`with start_run(cfg, "name", gradient_accumulation_steps=..., mixed_precision=...) as session:`.
    Options: needs_process_group (a 1-rank gloo group in one process), backend, data_identity (content
    hashes of the training data, checked on resume), and Accelerator kwargs."""
    return Run(cfg, experiment, **options)


def shutdown(accelerator, own_group: bool = False, recorder: RunRecorder | None = None) -> None:
    """Accelerate's end_training, in the order that lets gloo shut down cleanly.

    We saw `terminate called without an active exception` (SIGABRT) on the non-main rank in about
    1 of 15 two-rank runs when it tore its process group down while rank 0 was still closing W&B, and
    while DDP-wrapped models still held the group. So: trackers first, then every rank waits for the
    others, drops Accelerate's references to prepared models, destroys the group, and collects what
    still refers to it while the interpreter is fully alive."""
    if recorder is not None:
        recorder.close_trackers()
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
    accelerator.free_memory()
    if own_group:
        torch.distributed.destroy_process_group()
    accelerator.state.destroy_process_group()
    gc.collect()
