"""Everything a training loop does besides its idea, behind one object (as torchtitan's trainer keeps
checkpointing, metrics and fault handling out of its step):

    loop = TrainLoop(session, model, optimizer, samples_per_micro_batch=64)
    for x, y in loop.micro_batches(batches):
        with accelerator.accumulate(model):
            ...the idea: forward, backward, step...
        loop.record(loss)

`TrainLoop` resumes from the run's checkpoint (already verified byte for byte by common/run.py) and
proves the loaded state is the saved one, by digest, before any step (`resume_restored_state`; a
failure ends the run there), counts optimizer steps (one per `gradient_accumulation_steps`
micro-batches) and samples seen (the resume position), keeps a loss window and logs
`step | loss | samples/s` every --log_every steps, draws the progress bar, beats the heartbeat that
names a stuck rank, stops at the first non-finite loss, writes checkpoints every --checkpoint_every
steps and at the end (common/checkpoint/), and injects the faults that --fail_at_step / --hang_at_step ask for.
The experiment's loop stays the idea.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from common.checkpoint import AccelerateCheckpointer, load_checkpoint, save_checkpoint
from common.config import UsageError
from common.device import device_time
from common.reliability import Heartbeat, inject_fault


class TrainLoop:
    def __init__(
        self,
        session,
        model,
        optimizer,
        samples_per_micro_batch: int,
        checkpointer=None,
        tokens_per_sample: int | None = None,
        one_time_steps: int = 0,
    ):
        """`samples_per_micro_batch`: over every rank (the global micro-batch). `tokens_per_sample`: report
        throughput as tokens/s (a language model's sample is a block of tokens) instead of samples/s.
        `checkpointer`: common/checkpoint.ShardedCheckpointer for sharded models (default: Accelerate's).
        `one_time_steps`: this run's first steps that hold one-time work (warm-up, a state snapshot,
        profiled steps); the throughput figure leaves them out (the whole loop's is reported beside it)."""
        self.session, self.cfg, self.accelerator = session, session.cfg, session.accelerator
        self.model, self.optimizer = model, optimizer
        self.samples_per_micro_batch, self.tokens_per_sample = samples_per_micro_batch, tokens_per_sample
        # samples an optimizer step trains over every rank (`steps` says it for a trainer that owns a step)
        self.samples_per_step = samples_per_micro_batch * getattr(
            session.cfg, "gradient_accumulation_steps", 1
        )
        self.steps_redone = 0
        self.unit = "tokens" if tokens_per_sample else "samples"
        self.checkpointer = checkpointer or AccelerateCheckpointer(self.accelerator, model, optimizer)
        self.step = self.start_step = session.start_step
        # where in the data the run is, in samples (not steps: a resume at another world size has
        # another global batch)
        self.samples_seen = session.samples_seen
        self.state_digests: dict[int, str] = {}
        self.resumed_full_state = None  # the full state right after loading (main process), if resumed
        if session.checkpoint:
            same_layout = session.checkpoint_meta["world_size"] == self.accelerator.num_processes
            load_checkpoint(self.checkpointer, session.checkpoint, same_layout)
            self._check_restored_state()
        session.heartbeat = self.heartbeat = Heartbeat(
            session.output_dir, self.accelerator.process_index, self.accelerator.num_processes
        )
        session.progress_bar = self.progress = tqdm(
            total=self.cfg.max_steps, initial=self.step, desc=session.experiment, disable=not session.is_main
        )
        self.window_loss = torch.zeros((), device=self.accelerator.device)
        self.window_micro_batches, self.window_samples, self.in_step = 0, 0, False
        self.last_interval: dict = {}
        self.latest: dict = {}
        self.first_step_unix_time = None  # benchmarks/startup.py reads it from summary.json
        self.train_start = self.window_start = device_time(self.accelerator.device)
        # the steady state: from the end of the one-time steps (if the run goes on past them) to the end
        self.steady_from_step = self.start_step + one_time_steps
        self.steady_start = self.train_start if one_time_steps == 0 else None

    def _check_restored_state(self) -> None:
        """The state right after loading must be, bit for bit, the state the checkpoint was saved from.
        If it is not, nothing trained from here would mean anything: the run ends now (exit 1)."""
        from accelerate.utils import broadcast_object_list

        saved = self.session.checkpoint_meta.get("state_digest")
        self.resumed_full_state = self.checkpointer.full_state()
        loaded = self.resumed_state_digest = self.checkpointer.digest(self.resumed_full_state)
        verdict = [loaded == saved]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(verdict, from_process=0)  # the digest exists on the main process only
        if self.session.is_main:
            self.session.check(
                "resume_restored_state",
                verdict[0],
                f"state digest after loading {self.session.checkpoint}: {loaded[:16]}..., saved with it: {str(saved)[:16]}...",
            )
            self.session.print(f"resumed from {self.session.checkpoint} at step {self.step}")
        if not verdict[0]:
            self.session.metrics.update(resumed_from_step=self.start_step, resumed_state_digest=loaded)
            self.session.end_now()

    def micro_batches(self, batches):
        """Micro-batches from `batches` until --max_steps optimizer steps are done."""
        while self.step < self.cfg.max_steps:
            if not self.in_step:
                self.heartbeat.entering(self.step + 1)
                self.in_step = True
            yield next(batches)
        self._close()

    def steps(self, batch_at, micro_batches_per_step: int, begin_step=None):
        """Each optimizer step's micro-batches, `batch_at(position)`: the list of them from that sample of the data,
        until --max_steps steps are done: for a trainer that owns a whole step (strategies/job.Job.train_step),
        recorded by `record_step`. `begin_step(step)`, asked before each: (the step to train, which global batch,
        None: the next in the data) or None: none can start now, ask again. A trainer may move the run (a replica
        group healed from a peer is at the peer's step, and reads that step's batch)."""
        self.samples_per_step = self.samples_per_micro_batch * micro_batches_per_step
        while self.step < self.cfg.max_steps:
            begun = begin_step(self.step) if begin_step else (self.step, None)
            if begun is None:
                continue
            step, batch = begun
            if step != self.step:
                self.progress.update(step - self.step)
                self.step, self.samples_seen = step, step * self.samples_per_step
                if step >= self.cfg.max_steps:
                    break
            self.heartbeat.entering(self.step + 1)
            yield batch_at(self.samples_seen if batch is None else batch * self.samples_per_step)
        self._close()

    def _close(self) -> None:
        self.progress.close()
        self.train_end = device_time(self.accelerator.device)
        self.train_time_s = self.train_end - self.train_start

    def record_step(self, losses: list, committed: bool = True, **latest) -> None:
        """After an optimizer step (all its micro-batches): each micro-batch's loss, the step's other figures. A step
        that did not count (`committed` False: a replica group's quorum lost a peer in it) moves nothing: the same
        step is trained again on the same batch."""
        if not committed:
            self.steps_redone += 1
            return
        for index, loss in enumerate(losses):
            last = index == len(losses) - 1
            self.record(
                loss, ends_step=last, samples=self.samples_per_step if last else 0, **(latest if last else {})
            )

    def record(
        self, loss: torch.Tensor, ends_step: bool | None = None, samples: int | None = None, **latest: float
    ) -> None:
        """After each micro-batch: the loss window; after each optimizer step everything else.
        `ends_step`: whether this micro-batch is its step's last (None: Accelerate's sync_gradients says so).
        `latest` (e.g. lr=..., grad_norm=...) goes into the next interval's record as its last value (None:
        not known at this micro-batch). `samples`: what it trained over every rank (None: a global micro-batch)."""
        self.latest.update({name: value for name, value in latest.items() if value is not None})
        samples = self.samples_per_micro_batch if samples is None else samples
        self.window_loss += loss.detach()
        self.window_micro_batches += 1
        self.window_samples += samples
        self.samples_seen += samples
        if not (self.accelerator.sync_gradients if ends_step is None else ends_step):
            return
        self.step += 1
        self.in_step = False
        self.first_step_unix_time = self.first_step_unix_time or time.time()
        if self.step == self.steady_from_step:
            self.steady_start = device_time(self.accelerator.device)
        self.progress.update(1)
        self.heartbeat.finished(self.step)
        if self.step % self.cfg.log_every == 0 or self.step == self.cfg.max_steps:
            self._log_interval()
        checkpoint_every = getattr(self.cfg, "checkpoint_every", 0)
        # every --checkpoint_every steps, and the finished run's final state (torchtitan does the same): its
        # weights can be exported, and a resume with a larger --max_steps continues from the end
        if checkpoint_every and (self.step % checkpoint_every == 0 or self.step == self.cfg.max_steps):
            self._stop_if_diverged()  # never a checkpoint of a diverged run
            self.state_digests[self.step] = self.checkpointer.digest()
            meta = {
                "samples_seen": self.samples_seen,
                "steps_redone": self.steps_redone,
                "world_size": self.accelerator.num_processes,
                "layout": {name: getattr(self.cfg, name) for name in self.cfg.layout_flags},
                "trajectory": self.cfg.trajectory(self.accelerator.num_processes),
                "data": self.session.data_identity,
                "state_digest": self.state_digests[self.step],
            }
            save_checkpoint(self.accelerator, self.session.output_dir, self.step, self.cfg.keep_checkpoints, meta,
                            self.checkpointer.save)  # fmt: skip
        inject_fault(self.cfg, self.step, self.accelerator.process_index)

    def _per_second(self, samples: int, seconds: float) -> float:
        return samples * (self.tokens_per_sample or 1) / seconds if seconds > 0 else math.nan

    def _stop_if_diverged(self) -> None:
        """Stop on a non-finite loss since the last log. Checked where the loop reads the device anyway (a log
        interval, a checkpoint), not every step: on a GPU each read waits for the device."""
        if not torch.isfinite(self.window_loss):
            value = (self.window_loss / max(1, self.window_micro_batches)).item()
            raise UsageError(
                f"loss is {value} at step {self.step} on rank {self.accelerator.process_index}: "
                "training diverged; lower --lr" + (f" (now {self.cfg.lr})" if hasattr(self.cfg, "lr") else "")
            )

    def _log_interval(self) -> None:
        self._stop_if_diverged()
        mean_loss = self.accelerator.reduce(self.window_loss / self.window_micro_batches, "mean").item()
        # the window's time once the device has run its work (the .item() above waited for it)
        throughput = self._per_second(self.window_samples, time.perf_counter() - self.window_start)
        latest = {
            name: value.item() if torch.is_tensor(value) else value for name, value in self.latest.items()
        }
        self.last_interval = {"loss": mean_loss, f"{self.unit}_per_s": throughput, **latest}
        if self.step < self.cfg.max_steps:  # the last interval goes out with the experiment's final figures
            self.session.log(self.step, self.last_interval)
        self.window_loss.zero_()
        self.window_micro_batches, self.window_samples, self.window_start = 0, 0, time.perf_counter()

    def metrics(self, final_state: tuple[dict, dict] | None = None) -> dict:
        """Figures for summary.json: throughput, where the run resumed, state digests. `final_state`: the
        full state at the end if the caller already gathered it (else gathered here: a collective)."""
        steps_run = self.step - self.start_step
        loop_rate = (
            self._per_second(steps_run * self.samples_per_step, self.train_time_s) if steps_run else math.nan
        )
        steady_steps = self.step - self.steady_from_step
        steady = self.steady_start is not None and steady_steps > 0
        figures = {
            "train_time_s": self.train_time_s,
            "resumed_from_step": self.start_step,
            "first_step_unix_time": self.first_step_unix_time,
            # the steady state's rate (the whole loop's when the run is not longer than its one-time steps)
            f"{self.unit}_per_s": self._per_second(
                steady_steps * self.samples_per_step, self.train_end - self.steady_start
            )
            if steady
            else loop_rate,
            f"loop_{self.unit}_per_s": loop_rate,
            "steady_steps": steady_steps if steady else steps_run,
            "samples_seen": self.samples_seen,
            "steps_redone": self.steps_redone,
            "state_digests": {str(step): digest for step, digest in self.state_digests.items()},
            "final_state_digest": self.checkpointer.digest(final_state),
        }
        if self.start_step:
            figures["resumed_state_digest"] = self.resumed_state_digest
        return figures
