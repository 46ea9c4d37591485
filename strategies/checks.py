"""The checks every layout must pass, against the composed theory (strategies/theory.py) and against one
process:

  matches_single_process   the loss at every one of the first --parity_steps steps, and every parameter
                           after them, equal a one-process run (common/reference.py) on the same global
                           batches from the same state;
  grad_norm_is_global      the norm clipping used equals the one-process gradient norm at those steps;
  memory_per_rank          the bytes each rank really holds (a DTensor's local piece) equal that rank's
                           theory, rank by rank;
  communication_volume     the bytes every collective of one step's forwards and backwards moved on each
                           rank, counted as they pass the dispatcher (common/comm_counter.py), equal that
                           rank's theory, to the byte, kind by kind.

`Probe` is the job's instruments (job.Instruments): the job reports each phase and each finished
step to it, and it keeps what the checks need; the comparisons run at the end.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
from dataclasses import dataclass
from typing import ClassVar

import torch

from common.activations import SavedActivations
from common.checkpoint import load_full_optimizer_state
from common.comm_counter import CollectiveCounter
from common.config import flag
from common.device import device_time, peak_memory_bytes
from common.gpt import lm_loss
from common.hf_model import build_model
from common.moe import balance, moe_layers
from common.optim import clip_by_global_norm, set_lr
from common.reference import furthest, train_single_process
from strategies.job import Instruments
from strategies.piece import GatesSteps, having


@dataclass
class CheckArgs:
    """How close each check wants its figures (the flags of the checks; they change no result, so a resume may
    change them) and how many steps are compared with one process."""

    tolerances: ClassVar[tuple[str, ...]] = ("loss_atol", "param_atol", "grad_norm_rtol", "loss_atol_bf16",
                                             "param_atol_bf16", "grad_norm_rtol_bf16", "memory_rtol")  # fmt: skip
    # Parity with one process, float32: measured ~1e-6 (loss) and ~1e-5 (parameters) over 15 steps. Why 15:
    # FSDP x TP rounds differently in every forward (split matmuls, partial sums all-reduced) and AdamW
    # amplifies it: its loss difference was <= 9.5e-07 up to step 18, then 4.3e-06 and 9.1e-06 at 19-20.
    parity_steps: int = flag(15, "float32: steps compared with the one-process run (0: none)")
    loss_atol: float = flag(1e-5, "float32: largest |distributed - one process| loss in those steps")
    param_atol: float = flag(1e-4, "float32: largest |distributed - one process| parameter after them")
    grad_norm_rtol: float = flag(
        1e-3, "float32: largest relative |clipping norm - one-process gradient norm|"
    )
    # bf16 rounds to ~3 digits, and the differences grow faster: measured ~1e-3 over 12 steps, 0.1 at step 19.
    parity_steps_bf16: int = flag(10, "bf16: steps compared with the one-process run (0: none)")
    loss_atol_bf16: float = flag(5e-3, "bf16: largest |distributed - one process| loss in those steps")
    param_atol_bf16: float = flag(1e-2, "bf16: largest |distributed - one process| parameter after them")
    grad_norm_rtol_bf16: float = flag(
        1e-2, "bf16: largest relative |clipping norm - one-process gradient norm|"
    )
    memory_rtol: float = flag(0.01, "allowed relative difference of bytes held per rank from the theory")
    min_loss_drop: float = flag(0.3, "validation loss must fall by more than this (nats) from the initialisation; "
                                "a resumed run's must fall")  # fmt: skip

    def parity(self, bf16: bool) -> dict:
        """How many steps are compared with one process, and within what, for this precision."""
        suffix = "_bf16" if bf16 else ""
        names = (("steps", "parity_steps"), ("loss_atol", "loss_atol"), ("param_atol", "param_atol"),
                 ("grad_norm_rtol", "grad_norm_rtol"))  # fmt: skip
        return {name: getattr(self, f"{flag_name}{suffix}") for name, flag_name in names}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Probe(Instruments):
    """What the checks need, as the job reports it: the bytes this rank holds between forward and backward
    (first forward) and at rest (first step), each step's loss and gradient norm, the full state right after
    step `parity_steps` (a collective for sharded models: every rank takes it), the seconds spent in forward /
    backward / optimizer per step, the collectives of the job's first steady step, and the bytes autograd
    keeps for backward in that step's first forward (not under a pipeline, whose forward phase is its whole
    step: its backwards free them as they go)."""

    def __init__(self, job, start_step: int, parity_steps: int, max_steps: int):
        self.job, job.instruments = job, self
        self.step = start_step + 1  # the step in progress
        self.parity_steps = min(parity_steps, max_steps - start_step)  # a resumed run may have fewer left
        self.parity_step = start_step + self.parity_steps
        # the job's first step free of one-time work, if this run gets that far (None: no step is counted)
        # which of this process's steps is counted (its first free of one-time work), if it trains that many: by
        # this process's own count (a healed replica group's steps are numbered from its peer's)
        self.count_at = job.steady_step if start_step + job.steady_step <= max_steps else None
        self.held: dict = {}
        self.step_losses, self.grad_norms, self.at_parity_step = [], [], None
        self.recorded_steps: list[int] = []  # the step of each loss and norm
        self.collectives = {"calls": {}, "bytes": {}}
        self.phase_s: dict[str, float] = {}  # this step's seconds per phase, over its micro-batches
        self.step_times: list[dict] = []

    @contextlib.contextmanager
    def watch(self, phase: str):
        # the forward's and backward's collectives, which the layout's theory counts (the clipping's all-reduces of
        # a few bytes each and the optimizer's are not in it)
        counting = self.counting and phase in ("forward", "backward", "after_backward")
        counter = CollectiveCounter() if counting else None
        first_forward = counting and phase == "forward" and "saved_activation_bytes" not in self.held
        saved = SavedActivations() if first_forward and not self.job.forward_is_whole_step else None
        device = self.job.accelerator.device
        # the device's time for the phase (on a GPU: its kernels, not their launch)
        started = device_time(device)
        with counter or contextlib.nullcontext(), saved or contextlib.nullcontext():
            yield
        if saved:
            self.held["saved_activation_bytes"] = saved.bytes
        if phase == "forward" and "params_between_forward_and_backward" not in self.held:
            self.held["params_between_forward_and_backward"] = self.job.measure_window()
        # the pieces' work after backward is the backward's, in the step's time
        timed = "backward" if phase == "after_backward" else phase
        self.phase_s[timed] = self.phase_s.get(timed, 0.0) + device_time(device) - started
        if counter and phase == "forward":  # what the pieces' closed forms take as input (an MoE's routing)
            for key, records in self.job.theory_inputs().items():
                self.collectives.setdefault(key, []).extend(records)
        if counter:
            for kind in counter.calls:
                self.collectives["calls"][kind] = self.collectives["calls"].get(kind, 0) + counter.calls[kind]
                self.collectives["bytes"][kind] = self.collectives["bytes"].get(kind, 0) + counter.bytes[kind]

    @property
    def counting(self) -> bool:
        return self.count_at is not None and len(self.recorded_steps) + 1 == self.count_at

    def recount(self, committed: bool) -> None:
        """The step now counted is not the one its theory describes (a step not committed, one trained by fewer
        replica groups than a full quorum): forget what it sent and count the next one instead."""
        if self.counting:
            self.collectives = {"calls": {}, "bytes": {}}
            self.count_at += committed

    def after_step(self, job, loss: torch.Tensor, grad_norm: float, step: int | None = None) -> None:
        if (
            step is not None
        ):  # a piece moved the run (a group healed from a peer): its steps before were not here
            self.step = step
        if "params" not in self.held:
            self.held.update(job.measure_held())
        self.recorded_steps.append(self.step)
        self.step_losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.step_times.append(self.phase_s)
        self.phase_s = {}
        if self.parity_steps and self.step == self.parity_step:
            self.at_parity_step = job.checkpointer().full_state()[0]
        self.step += 1

    def median_step_time_ms(self) -> dict:
        """Median milliseconds per optimizer step in each phase, the first step (warm-up) left out."""
        steps = self.step_times[1:] or self.step_times
        return {
            phase: 1000 * statistics.median(t[phase] for t in steps) for phase in (steps[0] if steps else {})
        }


def check_layout(session, job, probe: Probe, model_cfg, budget: dict, memory_rtol: float, replay) -> None:
    """The layout's checks at the end of a run (every rank calls it: it gathers what each rank held and counted):
    each rank's bytes held and sent against its theory, and, on several ranks, the first parity steps against one
    process. `replay(start_state)` runs the one-process reference (compare_with_one_process's keyword arguments
    bound by the experiment) and returns what it needs."""
    accelerator = session.accelerator
    step_losses = accelerator.reduce(torch.stack(probe.step_losses), "mean").tolist()  # global, per step
    # the host's peak, and on a GPU the device's (torch's allocator: max_memory_allocated), beside the theory's bytes
    peaks = {"peak_rss_bytes": peak_rss_bytes(), "peak_device_bytes": peak_memory_bytes(accelerator.device)}
    every_rank = accelerator.gather_for_metrics([probe.held | peaks], use_gather_object=True)
    counted = accelerator.gather_for_metrics([probe.collectives], use_gather_object=True)
    # the first step's time holds a compile's cost (--compile)
    first_step_ms = 1000 * sum(probe.step_times[0].values()) if probe.step_times else None
    grad_norms = [norm.item() if torch.is_tensor(norm) else norm for norm in probe.grad_norms]
    session.metrics.update(step_losses=step_losses, grad_norms=grad_norms, bytes_per_rank=every_rank,
                           step_time_ms=probe.median_step_time_ms(), first_step_ms=first_step_ms,
                           layout=job.layout.degrees())  # fmt: skip
    if not session.is_main:
        return
    reference = build_model(model_cfg, 0)  # the undistributed model the theory is written for (its shapes)
    check_memory(session, job, reference, every_rank, memory_rtol)
    if job.layout.world_size > 1 and (probe.count_at is None or len(probe.step_losses) < probe.count_at):
        session.skip_check("communication_volume", f"this run trains {len(probe.step_losses)} step(s) and none is free of "
                           f"one-time work (the layout's first steady step is step {job.steady_step} of a run): train "
                           f"at least {job.steady_step} steps to count the bytes sent")  # fmt: skip
    elif job.layout.world_size > 1:
        check_communication(session, job, reference, counted)
    unlike = [
        why for piece in having(job.pieces, GatesSteps) if (why := piece.unlike_one_process(job.ctx.plan))
    ]
    if unlike:
        session.skip_check("matches_single_process", unlike[0])
        session.skip_check("grad_norm_is_global", unlike[0])
    elif (job.layout.world_size > 1 or job.gate) and probe.at_parity_step is not None:
        compare_with_one_process(session, model_cfg, probe, step_losses, budget=budget, **replay())
    elif job.gate and probe.parity_steps:  # a replica group that healed from a peer after the steps compared
        why = (
            f"this group healed from a peer after the {probe.parity_steps} steps compared: they ran elsewhere"
        )
        session.skip_check("matches_single_process", why)
        session.skip_check("grad_norm_is_global", why)


def check_memory(session, job, reference, every_rank: list[dict], rtol: float) -> None:
    """Each rank's held bytes against its theory, within rtol."""
    theories = [job.held_bytes(reference, rank) for rank in range(len(every_rank))]
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
    # a GPU run: the device's own peak beside the theory's bytes
    if any(held.get("peak_device_bytes") for held in every_rank):
        session.print("device memory, peak allocated / held at rest by theory: " + "; ".join(
            f"rank {rank}: {held['peak_device_bytes'] / 2**20:,.1f} / {sum(theory.values()) / 2**20:,.1f} MiB"
            for rank, (held, theory) in enumerate(zip(every_rank, theories, strict=True))))  # fmt: skip


def check_communication(session, job, reference, every_rank: list[dict]) -> None:
    """Every rank's counted collectives of one steady step against its theory, to the byte, kind by kind."""
    theories = [job.sent_bytes(reference, rank, every_rank[rank]) for rank in range(len(every_rank))]
    wrong = []
    for rank, (counted, theory) in enumerate(zip(every_rank, theories, strict=True)):
        expected = theory["by_kind"]
        kinds = sorted(
            k for k in {**expected, **counted["bytes"]} if expected.get(k) or counted["bytes"].get(k)
        )
        if any(counted["bytes"].get(kind, 0) != expected.get(kind, 0) for kind in kinds):
            wrong.append(f"rank {rank}: " + ", ".join(
                f"{kind} {counted['bytes'].get(kind, 0):,}/{expected.get(kind, 0):,} ({counted['calls'].get(kind, 0)} calls)"
                for kind in kinds))  # fmt: skip
    first, theory = every_rank[0], theories[0]
    kinds = sorted(
        k
        for k in {**theory["by_kind"], **first["bytes"]}
        if theory["by_kind"].get(k) or first["bytes"].get(k)
    )
    rank0 = ", ".join(
        f"{kind} {first['bytes'].get(kind, 0):,}/{theory['by_kind'].get(kind, 0):,} ({first['calls'].get(kind, 0)} calls)"
        for kind in kinds
    )
    session.metrics["communication"] = {"counted": first, "theory": theory, "counted_per_rank": every_rank,
                                        "theory_per_rank": theories}  # fmt: skip
    session.check(
        "communication_volume",
        not wrong,
        f"bytes per step, counted/theory: {'; '.join(wrong) if wrong else f'rank 0: {rank0 or chr(8212)}'}; "
        f"{'every rank equals its theory; ' if not wrong else ''}{theory['wire_bytes']:,.0f} bytes on the wire "
        "from rank 0",
    )


def compare_with_one_process(session, model_cfg, probe: Probe, step_losses, *, start_state, global_batches, lr_at,
                             make_optimizer, max_norm: float, accumulation: int, bf16: bool, budget: dict,
                             exact_shares: int = 0) -> None:  # fmt: skip
    """This run's first parity steps (from its start, or from the checkpoint it resumed) against the same steps
    in ONE process (common/reference.py), from the same state, on the same global batches: each step one batch
    holding every rank's micro-batches, one mean loss over all its tokens, the same AdamW, schedule
    (`lr_at(step)`) and clipping. `start_state`: (model state, optimizer state by name or None). `exact_shares`:
    the run's exact accumulation over that many data-parallel ranks (common/reference.py's `exact_shares`)."""
    n = probe.parity_steps
    model_state, optimizer_state = start_state
    device = session.accelerator.device
    model = build_model(model_cfg, 0)  # (fork_rng: the process's random state untouched) then the start state
    model.load_state_dict(model_state)
    # on the device BEFORE the optimizer exists: a resumed run's AdamW state is loaded onto its parameters' device
    # (fused AdamW takes its moments and step counts where the parameters are)
    model.to(device)
    optimizer = make_optimizer(model.parameters())
    if optimizer_state:  # a resumed run: AdamW's moments and step counts as loaded
        load_full_optimizer_state(optimizer, model, optimizer_state)

    def clip_and_schedule(i: int) -> float:
        set_lr(optimizer, lr_at(session.start_step + i))
        # the step's loads move the balancing bias, as the distributed job's clip does
        if model_cfg.n_experts:
            balance(model)
        return clip_by_global_norm(model.parameters(), max_norm, exact=bool(exact_shares))

    # a balancing loss (a product of two means over a micro-batch's tokens) is computed per global micro-batch by
    # the run, each its gradient / the micro-batches: the reference accumulates as the run does
    aux_per_micro_batch = bool(model_cfg.n_experts) and model_cfg.aux_loss_coef > 0 and accumulation > 1
    if aux_per_micro_batch:
        for layer in moe_layers(model):
            layer.aux_loss_scale = 1 / accumulation
    reference = train_single_process(
        model, optimizer, global_batches, n, accumulation, accumulate=aux_per_micro_batch, exact_shares=exact_shares,
        loss_fn=lambda m, x, y: lm_loss(m(x), y),
        device=device,
        autocast=lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
        before_update=clip_and_schedule,
    )  # fmt: skip
    # each recorded step against the reference's same step (a healed group recorded only the steps it trained)
    compared = [(i, step - session.start_step - 1) for i, step in enumerate(probe.recorded_steps)
                if step - session.start_step <= n]  # fmt: skip
    loss_diffs = [abs(step_losses[i] - reference["losses"][r]) for i, r in compared]
    loss_diff = max(loss_diffs)
    # where a run left the reference: the first step past the loss tolerance (a routing flip, a missed reduction)
    first_off = next((compared[i][1] for i, d in enumerate(loss_diffs) if d > budget["loss_atol"]), None)
    norm_diff = max(
        abs(float(probe.grad_norms[i]) - reference["figures"][r]) / max(reference["figures"][r], 1e-12)
        for i, r in compared
    )
    furthest_name, param_diff = furthest(probe.at_parity_step, model.state_dict())
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
        f"({furthest_name}; tolerance {budget['param_atol']:.0e}); the larger share of its tolerance"
        + (
            f"; the loss first off at step {session.start_step + first_off + 1}"
            if first_off is not None
            else ""
        ),
    )
    session.parity_check(
        "grad_norm_is_global",
        norm_diff,
        budget["grad_norm_rtol"],
        f"max relative |norm clipped by - one process's gradient norm| over the {n} steps after step {session.start_step}",
    )
