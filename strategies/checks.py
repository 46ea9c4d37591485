"""The checks every strategy must pass, against its module's theory and against one process:

  matches_single_process   the loss at every one of the first --parity_steps steps, and every parameter
                           after them, equal a one-process run (common/reference.py) on the same global
                           batches from the same state;
  grad_norm_is_global      the norm clipping used equals the one-process gradient norm at those steps;
  memory_per_rank          the bytes each rank really holds (a DTensor's local shard) equal
                           strategy.held_bytes, per rank;
  communication_volume     the bytes every collective of one step's forward and backward moved,
                           counted as they pass the dispatcher (common/comm_counter.py), equal
                           strategy.sent_bytes, to the byte.

`Probe` gathers, from inside the training loop, what they need; the comparisons run at the end.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time

import torch

from common.activations import SavedActivations
from common.checkpoint import load_full_optimizer_state
from common.comm_counter import CollectiveCounter
from common.gpt import GPT, build_gpt
from common.optim import clip_by_global_norm, set_lr
from common.reference import max_abs_difference, train_single_process


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Probe:
    """What the checks need from inside the loop, one call per place: the bytes this rank holds between
    forward and backward and at rest (first step), each step's loss and gradient norm, the full state
    right after step --parity_steps (a collective for sharded models: every rank takes it), the seconds
    spent in forward / backward / optimizer per step, and the collectives of step `count_step`'s
    forwards and backwards."""

    def __init__(self, accelerator, strategy, checkpointer, cfg, start_step: int):
        self.accelerator, self.strategy, self.checkpointer = accelerator, strategy, checkpointer
        self.accumulation = cfg.gradient_accumulation_steps
        # a resumed run may have fewer steps left than --parity_steps
        self.parity_steps = min(cfg.parity()["steps"], cfg.max_steps - start_step)
        self.parity_step = start_step + self.parity_steps
        # the first step free of one-time work (strategies/defaults.py STEADY_STEP)
        self.count_step = min(start_step + strategy.STEADY_STEP, cfg.max_steps)
        self.held: dict = {}
        self.step_losses, self.grad_norms, self.at_parity_step = [], [], None
        self.step_loss = torch.zeros((), device=accelerator.device)
        self.collectives = {"calls": {}, "bytes": {}}
        self.phase_s: dict[str, float] = {}  # this step's seconds per phase, over its micro-batches
        self.step_times: list[dict] = []

    @contextlib.contextmanager
    def watch(self, phase: str, step: int):
        """Time a phase; in forward and backward of step count_step, also count its collectives, and in its
        first forward the bytes autograd keeps for backward (not under pp: its forward phase is the whole
        pipeline step, whose backwards free them as they go)."""
        counter = CollectiveCounter() if step == self.count_step and phase != "optimizer" else None
        saved = None
        if (
            counter
            and phase == "forward"
            and "saved_activation_bytes" not in self.held
            and self.strategy.NAME != "pp"
        ):
            saved = SavedActivations()
        started = time.perf_counter()
        with counter or contextlib.nullcontext(), saved or contextlib.nullcontext():
            yield
        if saved:
            self.held["saved_activation_bytes"] = saved.bytes
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - started
        if counter:
            for kind in counter.calls:
                self.collectives["calls"][kind] = self.collectives["calls"].get(kind, 0) + counter.calls[kind]
                self.collectives["bytes"][kind] = self.collectives["bytes"].get(kind, 0) + counter.bytes[kind]

    def after_forward(self, model) -> None:
        if not self.held:
            self.held["params_between_forward_and_backward"] = self.strategy.measure_window(model)

    def after_micro_batch(self, model, optimizer, loss: torch.Tensor, step: int) -> None:
        """After each micro-batch's update; once per optimizer step (the last micro-batch) it also closes
        the step: its loss, its phase times, the bytes held at rest, the parity snapshot."""
        self.step_loss += loss.detach() / self.accumulation
        if not self.accelerator.sync_gradients:
            return
        if "params" not in self.held:
            self.held.update(self.strategy.measure_held(model, optimizer))
        self.step_losses.append(self.step_loss.clone())
        self.step_loss.zero_()
        self.step_times.append(self.phase_s)
        self.phase_s = {}
        if self.parity_steps and step == self.parity_step:
            self.at_parity_step = self.checkpointer.full_state()[0]

    def latest(self, optimizer) -> dict:
        """The learning rate and gradient norm of the last optimizer step, for the logged interval."""
        return (
            {"lr": optimizer.param_groups[0]["lr"], "grad_norm": self.grad_norms[-1]}
            if self.grad_norms
            else {}
        )

    def median_step_time_ms(self) -> dict:
        """Median milliseconds per optimizer step in each phase, the first step (warm-up) left out."""
        steps = self.step_times[1:] or self.step_times
        return {
            phase: 1000 * statistics.median(t[phase] for t in steps) for phase in (steps[0] if steps else {})
        }


def check_memory(session, strategy, layout, cfg, reference: GPT, every_rank: list[dict], rtol: float) -> None:
    """Each rank's held bytes against strategy.held_bytes, within rtol."""
    theories = [strategy.held_bytes(reference, layout, rank, cfg) for rank in range(len(every_rank))]
    worst = max(
        abs(held[kind] - theory[kind]) / max(theory[kind], 1)  # a theory of 0 bytes: exact
        for held, theory in zip(every_rank, theories, strict=True)
        for kind in theory
    )
    lines = [
        f"rank {rank}: " + ", ".join(f"{kind} {held[kind]:,}/{theory[kind]:,}" for kind in theory)
        for rank, (held, theory) in enumerate(zip(every_rank, theories, strict=True))
    ]
    session.metrics["bytes_theory"] = theories
    session.check(
        "memory_per_rank",
        worst <= rtol,
        f"held/theory bytes: {'; '.join(lines)}; worst relative difference {worst:.4f}, tolerance {rtol}",
    )


def check_communication(session, strategy, layout, cfg, reference: GPT, counted: dict) -> None:
    """The main process's counted collectives of one step against strategy.sent_bytes, to the byte (the main
    process stands for every rank: each sends the same amount, in every strategy here)."""
    theory = strategy.sent_bytes(reference, layout, cfg)
    expected = theory["by_kind"]
    kinds = [
        kind for kind in {**expected, **counted["bytes"]} if expected.get(kind) or counted["bytes"].get(kind)
    ]
    session.metrics["communication"] = {"counted": counted, "theory": theory}
    session.check(
        "communication_volume",
        all(counted["bytes"].get(kind, 0) == expected.get(kind, 0) for kind in kinds),
        "bytes per step, counted/theory: "
        + ", ".join(
            f"{kind} {counted['bytes'].get(kind, 0):,}/{expected.get(kind, 0):,} ({counted['calls'].get(kind, 0)} calls)"
            for kind in kinds
        )
        + f"; {theory['wire_bytes']:,.0f} bytes on the wire per rank",
    )


def compare_with_one_process(
    session, cfg, gpt_cfg, start_state, global_batches, probe: Probe, step_losses, lr_at
) -> None:
    """This run's first --parity_steps steps (from its start, or from the checkpoint it resumed) against the
    same steps in ONE process (common/reference.py), from the same state, on the same global batches: each
    step one batch holding every rank's micro-batches, one mean loss over all its tokens, the same AdamW,
    schedule (`lr_at(step)`) and clipping. `start_state`: (model state, optimizer state by name or None)."""
    budget, n = cfg.parity(), probe.parity_steps
    model_state, optimizer_state = start_state
    model = build_gpt(gpt_cfg, 0)  # (fork_rng: the process's random state untouched) then the start state
    model.load_state_dict(model_state)
    optimizer = model.configure_optimizers(cfg.lr, cfg.weight_decay)
    if optimizer_state:  # a resumed run: AdamW's moments and step counts as loaded
        load_full_optimizer_state(optimizer, model, optimizer_state)

    def clip_and_schedule(i: int) -> float:
        set_lr(optimizer, lr_at(session.start_step + i))
        return clip_by_global_norm(model, cfg.grad_clip)

    device_type = session.accelerator.device.type
    reference = train_single_process(
        model,
        optimizer,
        global_batches,
        n,
        cfg.gradient_accumulation_steps,
        loss_fn=lambda m, x, y: m(x, y)[1],
        device=session.accelerator.device,
        autocast=lambda: torch.autocast(
            device_type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16"
        ),
        before_update=clip_and_schedule,
    )
    loss_diff = max(abs(a - b) for a, b in zip(step_losses[:n], reference["losses"], strict=True))
    norm_diff = max(
        abs(a - b) / max(b, 1e-12) for a, b in zip(probe.grad_norms[:n], reference["figures"], strict=True)
    )
    param_diff = max_abs_difference(probe.at_parity_step, model.state_dict())
    session.metrics.update(
        loss_max_abs_diff=loss_diff,
        grad_norm_max_rel_diff=norm_diff,
        param_max_abs_diff=param_diff,
        reference_losses=reference["losses"],
    )
    session.parity_check(
        "matches_single_process",
        max(loss_diff / budget["loss_atol"], param_diff / budget["param_atol"]),
        1.0,
        f"over the {n} steps after step {session.start_step}: max |loss - one process| {loss_diff:.2e} "
        f"(tolerance {budget['loss_atol']:.0e}), max |parameter - one process| after them {param_diff:.2e} "
        f"(tolerance {budget['param_atol']:.0e}); the larger share of its tolerance",
    )
    session.parity_check(
        "grad_norm_is_global",
        norm_diff,
        budget["grad_norm_rtol"],
        f"max relative |norm clipped by - one process's gradient norm| over the {n} steps after step {session.start_step}",
    )
