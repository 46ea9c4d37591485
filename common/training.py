"""Everything a training loop does besides its idea, behind one object (as torchtitan's trainer keeps
checkpointing, metrics and fault handling out of its step):

    loop = TrainLoop(run, model, optimizer, global_micro_batch_size=64)
    for x, y in loop.micro_batches(batches):
        with accelerator.accumulate(model):
            ...the idea: forward, backward, step...
        loop.record(loss)

`TrainLoop` resumes from the run's checkpoint (and proves the loaded state is the saved one, by
digest), counts optimizer steps (one per `gradient_accumulation_steps` micro-batches), keeps a loss
window and logs `step | loss | samples/s` every --log_every steps, draws the progress bar, beats the
heartbeat that names a stuck rank, stops at the first non-finite loss, writes checkpoints every
--checkpoint_every steps with the state digest of each, and injects the faults that --fail_at_step /
--hang_at_step ask for. The experiment's loop stays the idea.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from common.config import UsageError
from common.reliability import Heartbeat, inject_fault, save_checkpoint, state_digest


class AccelerateCheckpointer:
    """Checkpoints through Accelerate's save_state / load_state (model, optimizer, every rank's RNG
    states), for a model every rank holds whole (one process, DDP). Sharded models use
    common/sharded_checkpoint.ShardedCheckpointer, which has the same three methods."""

    def __init__(self, accelerator, model, optimizer):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def save(self, folder: str) -> None:
        self.accelerator.save_state(folder)

    def load(self, folder: str, same_layout: bool) -> None:
        self.accelerator.load_state(folder)

    def digest(self) -> str | None:
        """sha256 of parameters + optimizer state (main process; DDP keeps every rank's state equal)."""
        if not self.accelerator.is_main_process:
            return None
        return state_digest(self.accelerator.unwrap_model(self.model), self.optimizer)


class TrainLoop:
    def __init__(
        self, run, model, optimizer, global_micro_batch_size: int, unit: str = "samples", checkpointer=None
    ):
        self.run, self.cfg, self.accelerator = run, run.cfg, run.accelerator
        self.model, self.optimizer = model, optimizer
        self.global_micro_batch_size, self.unit = global_micro_batch_size, unit
        self.checkpointer = checkpointer or AccelerateCheckpointer(self.accelerator, model, optimizer)
        self.step = self.start_step = run.start_step
        # where in the data the run is, in samples / tokens (not steps: a resume at another world size
        # has another global batch)
        per_step = global_micro_batch_size * getattr(self.cfg, "gradient_accumulation_steps", 1)
        self.seen = run.checkpoint_meta.get(f"{unit}_seen", self.start_step * per_step)
        self.state_digests: dict[int, str] = {}
        if run.checkpoint:
            same_layout = run.checkpoint_meta.get("world_size", self.accelerator.num_processes) == (
                self.accelerator.num_processes
            )
            self.checkpointer.load(run.checkpoint, same_layout)
            self._check_restored_state()
        run.heartbeat = self.heartbeat = Heartbeat(
            run.output_dir, self.accelerator.process_index, self.accelerator.num_processes
        )
        run.progress_bar = self.progress = tqdm(
            total=self.cfg.max_steps, initial=self.step, desc=run.experiment, disable=not run.is_main
        )
        self.window_loss = torch.zeros((), device=self.accelerator.device)
        self.window_micro_batches, self.in_step = 0, False
        self.last_interval: dict = {}
        self.latest: dict = {}
        self.first_step_unix_time = None  # benchmarks/startup.py reads it from summary.json
        self.train_start = self.window_start = time.perf_counter()

    def _check_restored_state(self) -> None:
        """The state right after loading must be, bit for bit, the state the checkpoint was saved from."""
        saved = self.run.checkpoint_meta.get("state_digest")
        loaded = self.digest()
        self.resumed_state_digest = loaded
        if self.run.is_main:
            self.run.check(
                "resume_restored_state",
                loaded == saved,
                f"state digest after loading {self.run.checkpoint}: "
                f"{loaded[:16]}..., saved with it: {str(saved)[:16]}...",
            )
            self.run.print(f"resumed from {self.run.checkpoint} at step {self.step}")

    def digest(self) -> str | None:
        """sha256 of the whole training state, on the main process (a collective for sharded models)."""
        return self.checkpointer.digest()

    def micro_batches(self, batches):
        """Micro-batches from `batches` until --max_steps optimizer steps are done."""
        while self.step < self.cfg.max_steps:
            if not self.in_step:
                self.heartbeat.entering(self.step + 1)
                self.in_step = True
            yield next(batches)
        self.progress.close()
        self.train_time_s = time.perf_counter() - self.train_start

    def record(self, loss: torch.Tensor, **latest: float) -> None:
        """After each micro-batch: the loss window; after each optimizer step everything else.
        `latest` (e.g. lr=..., grad_norm=...) goes into the next interval's record as its last value."""
        self.latest.update(latest)
        self.window_loss += loss.detach()
        self.window_micro_batches += 1
        self.seen += self.global_micro_batch_size
        if not self.accelerator.sync_gradients:
            return
        self.step += 1
        self.in_step = False
        self.first_step_unix_time = self.first_step_unix_time or time.time()
        if not torch.isfinite(self.window_loss):  # one scalar check per step: stop before training on NaN
            value = (self.window_loss / self.window_micro_batches).item()
            raise UsageError(
                f"loss is {value} at step {self.step} on rank {self.accelerator.process_index}: "
                "training diverged; lower --lr" + (f" (now {self.cfg.lr})" if hasattr(self.cfg, "lr") else "")
            )
        self.progress.update(1)
        self.heartbeat.finished(self.step)
        if self.step % self.cfg.log_every == 0 or self.step == self.cfg.max_steps:
            self._log_interval()
        checkpoint_every = getattr(self.cfg, "checkpoint_every", 0)
        if checkpoint_every and self.step % checkpoint_every == 0:
            self.state_digests[self.step] = self.digest()
            if self.step < self.cfg.max_steps:
                meta = {
                    "trajectory": self.cfg.trajectory(self.accelerator.num_processes),
                    "state_digest": self.state_digests[self.step],
                    "world_size": self.accelerator.num_processes,
                    "layout": {name: getattr(self.cfg, name) for name in self.cfg.layout_flags},
                    f"{self.unit}_seen": self.seen,
                }
                save_checkpoint(
                    self.accelerator,
                    self.run.output_dir,
                    self.step,
                    self.cfg.keep_checkpoints,
                    meta,
                    self.checkpointer.save,
                )
        inject_fault(self.cfg, self.step, self.accelerator.process_index)

    def _log_interval(self) -> None:
        mean_loss = self.accelerator.reduce(self.window_loss / self.window_micro_batches, "mean").item()
        throughput = (
            self.window_micro_batches
            * self.global_micro_batch_size
            / (time.perf_counter() - self.window_start)
        )
        self.last_interval = {"loss": mean_loss, f"{self.unit}_per_s": throughput, **self.latest}
        if self.step < self.cfg.max_steps:  # the last interval goes out with the experiment's final figures
            self.run.log(self.step, self.last_interval)
        self.window_loss.zero_()
        self.window_micro_batches, self.window_start = 0, time.perf_counter()

    def metrics(self) -> dict:
        """Figures for summary.json: throughput, where the run resumed, state digests."""
        steps_run = self.step - self.start_step
        per_step = self.global_micro_batch_size * getattr(self.cfg, "gradient_accumulation_steps", 1)
        figures = {
            "train_time_s": self.train_time_s,
            "resumed_from_step": self.start_step,
            "first_step_unix_time": self.first_step_unix_time,
            f"{self.unit}_per_s": steps_run * per_step / self.train_time_s
            if steps_run and self.train_time_s > 0
            else math.nan,
            "state_digests": {str(step): digest for step, digest in self.state_digests.items()},
            "final_state_digest": self.digest(),
        }
        if self.start_step:
            figures["resumed_state_digest"] = self.resumed_state_digest
        return figures
