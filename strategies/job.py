"""A rank's part of a parallelized GPT at run time (what strategies/parallelize.py returns, and what DeepSpeed's
engine becomes in strategies/deepspeed.py): a training step (`train_step`: its micro-batches' forwards and
backwards, the clipping by the global norm, the optimizer step), the evaluation, the checkpointer, and the bytes it
really holds beside its theory. Every program that trains calls train_step: train_gpt's loop (each replica group
of a fault-tolerant run included), DeepSpeed's job, and the fake ranks of experiments/at_scale.py
(planning/fake_ranks.py), whose instruments measure what it does.

Exact accumulation (a piece's trait `exact_accumulation`: fault tolerance's): each micro-batch's gradient (its loss /
every micro-batch of the global batch) added in float64 and rounded to float32 once, after a piece that gates steps
(`GatesSteps`) has summed the sums of everyone who shared the step. A sum of a few float32 numbers in float64 is
exact, so the gradient does not depend on who computed which micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from common.checkpoint import ShardedCheckpointer
from common.data import IGNORED_TARGET, on_device
from common.gpt import lm_loss
from common.moe import local
from common.optim import clip_by_global_norm, set_lr
from strategies.layout import DIMS, unique_tensors
from strategies.piece import Context, GatesSteps, HooksTheStep, Measures, RunsTheStep, Theory, having


class Instruments:
    """Where a job reports what it does, for whoever measures it (strategies/checks.Probe): no-ops here."""

    def watch(self, phase: str):
        return contextlib.nullcontext()

    def after_step(self, job, loss: torch.Tensor, grad_norm: float, step: int | None = None) -> None:
        """`step`: the step just trained, where a piece moved it (a healed group); None: the next."""

    def recount(self, committed: bool) -> None:
        """The step in progress is not the one the theory describes (not committed, or trained by fewer replica
        groups than the run has): whoever counts its collectives counts another."""

    def passed(self, dim: str) -> None:
        """A send or receive between the ranks of `dim` that this run does not make (a fake rank: its peers do not
        run), where the real step makes it."""


@dataclass
class StepResult:
    """What one optimizer step did: each micro-batch's loss (a tensor on the device: read where it is logged), the
    global gradient norm it clipped by, and what the pieces add to the logged metrics."""

    losses: list
    grad_norm: torch.Tensor | None
    figures: dict = field(default_factory=dict)
    committed: bool = (
        True  # False: a piece that gates steps said it did not count: redo it with the same batch
    )


class Job:
    """A rank's part of the parallelized GPT. `model`: what the rank holds as one module under the GPT's names
    (its optimizer, checkpoints and bytes held); `stages`: what runs (the model itself, or a pipeline's stages
    sharing its modules). The pieces that run (`ctx.plan.on`) do the rest through their hooks
    (strategies/piece.py); the job knows none of them by name."""

    def __init__(self, ctx: Context, model, optimizer, max_norm: float):
        self.ctx, self.model, self.stages, self.optimizer = ctx, model, ctx.stages, optimizer
        self.layout, self.rank, self.args, self.work = ctx.layout, ctx.rank, ctx.args, ctx.work
        self.accelerator, self.max_norm = ctx.accelerator, max_norm
        self.pieces = ctx.plan.on
        self.instruments = Instruments()
        # the piece that says whether a step counts (fault tolerance: torchft's should_commit), if one runs
        self.gate = next(iter(having(self.pieces, GatesSteps)), None)
        self.hooks, self.runner = (
            having(self.pieces, HooksTheStep),
            next(iter(having(self.pieces, RunsTheStep)), None),
        )
        self.exact = "exact_accumulation" in ctx.plan.traits
        # the global batch's micro-batches (each every data-parallel rank's rows), shared by the replica groups
        self.units_per_step = self.work.micro_batches * ctx.plan.launches
        self._step_loss, self._micro_batches = torch.zeros((), device=ctx.accelerator.device), 0

    def state(self, piece):
        """What `piece` kept when it was applied (its run-time state)."""
        return self.ctx.runtime.get(piece.name)

    # The first step free of one-time work, whose collectives communication_volume counts: the latest any piece
    # says. Step 1 is, once the evaluation before it has resharded FSDP2's root (evaluate_rows): DDP rebuilds its
    # buckets and broadcasts rank 0's order only in the forward of step 2 (144 to 268 bytes, measured), so step 1
    # never sees it.
    @property
    def steady_step(self) -> int:
        return max([1, *(piece.steady_step(self) for piece in self.hooks)])

    @property
    def forward_is_whole_step(self) -> bool:
        """A piece that runs every micro-batch's forward and backward in one step (a pipeline): nothing between."""
        return self.runner is not None

    def split_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """This rank's tokens of its data-parallel rank's rows (context parallelism keeps its chunks)."""
        for piece in self.hooks:
            x, y = piece.split_batch(self, x, y)
        return x, y

    def begin_step(self, step: int) -> tuple[int, int | None] | None:
        """Before a step: (the step to train, the global batch to read, None: the next in the stream). A piece that
        gates steps may move the step (a group healed from a peer) or say None: no step can start now, ask again."""
        if self.gate is None:
            return step, None
        return self.state(self.gate).begin(self, step)

    def train_step(self, micro_batches: list, lr: float, local_only: bool = False) -> StepResult:
        """One optimizer step over the global batch's micro-batches (each (x, y) of this rank's rows, from the
        host): under Accelerate's accumulate() each micro-batch's forward and backward (DDP's no_sync and loss / k
        on all but the last), then on the last the clipping by the global norm (`local_only`: the mistake of
        clipping by each rank's own piece) and AdamW at learning rate `lr` (set before the backward: DeepSpeed steps
        inside it). Under a piece that gates steps this rank trains its share of the micro-batches."""
        if self.exact:
            return self.exact_step(micro_batches, lr, local_only)
        gate = self.state(self.gate) if self.gate else None
        if gate:
            micro_batches = [micro_batches[u] for u in gate.share(len(micro_batches))]
        losses, grad_norm = [], None
        for x, y in micro_batches:
            with self.accelerator.accumulate(self.model):
                set_lr(self.optimizer, lr)
                losses.append(self.forward_backward(x, y))
                grad_norm = self.clip(local_only=local_only) if self.accelerator.sync_gradients else None
                self.step(grad_norm)
        if gate:  # DiLoCo: an inner step (the optimizer's hook synced the groups on every --sync_every-th)
            gate.after_inner_step(losses[-1].detach())
        return StepResult(losses, grad_norm, self.step_figures())

    def exact_step(self, micro_batches: list, lr: float, local_only: bool = False) -> StepResult:
        """Exact accumulation: this rank's micro-batches (a gate's share of them) each forward and backward on its
        own (FSDP reduce-scatters each in float64, summed, not averaged), its gradient / every micro-batch of the
        global batch added in float64; the gate sums those sums over the groups; rounded to float32 once, clipped
        (the norm in float64), and AdamW if the step counts. The loss reported is the global batch's."""
        gate = self.state(self.gate) if self.gate else None
        units = gate.share(len(micro_batches)) if gate else range(len(micro_batches))
        parameters = unique_tensors(self.model.parameters())
        device = self.accelerator.device
        sums = torch.zeros(sum(local(p).numel() for p in parameters), dtype=torch.float64, device=device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        set_lr(self.optimizer, lr)
        for unit in units:
            self.optimizer.zero_grad()
            loss = self.forward_backward(*micro_batches[unit])
            sums += torch.cat([local(grad_or_zeros(p)).reshape(-1) for p in parameters]).double()
            loss_sum += loss.detach().double() / self.exact_divisor
        self._step_loss, self._micro_batches = torch.zeros_like(self._step_loss), 0
        # the group's loss: every data-parallel rank's (the others of a row, tp's, hold the same)
        if self.layout.world_size > 1:
            loss_sum = self.accelerator.reduce(loss_sum, "sum") / (self.layout.world_size // self.layout.dp)
        tally = (
            gate.reduce(self, sums, units, micro_batches[0][0].shape[0] * self.layout.dp, loss_sum)
            if gate
            else None
        )
        offset = 0
        for p in parameters:
            piece = local(grad_or_zeros(p))
            piece.copy_(sums[offset : offset + piece.numel()].view_as(piece))
            offset += piece.numel()
        grad_norm = self.clip(local_only=local_only, exact=True)
        committed = gate.commit(tally) if gate else True
        if gate and not (committed and gate.full_quorum):  # not what the theory counts: count another step
            self.instruments.recount(committed)
        loss = (tally[3] if gate else loss_sum).float()
        if committed:
            with self.instruments.watch("optimizer"):
                self.optimizer.step()
            self.instruments.after_step(self, loss, grad_norm, step=gate.step + 1 if gate else None)
        self.optimizer.zero_grad()
        return StepResult([loss], grad_norm, self.step_figures() if committed else {}, committed)

    @property
    def exact_divisor(self) -> int:
        """Exact accumulation's loss scale: every data-parallel rank's micro-batch of every unit of the step."""
        return self.units_per_step * self.layout.dp

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One micro-batch: the mean loss over its tokens, its gradients accumulated (a piece that runs the
        micro-batch itself, a pipeline, runs its schedule's whole step). The batch comes from the host: it goes to
        the run's device here, for every layout (no wrapper moves it: DDP and FSDP2 move a forward's inputs,
        never the targets, and a plain module, tp, pp and cp move nothing)."""
        x, y = self.split_batch(*on_device((x, y), self.accelerator.device))
        watch = self.instruments.watch
        for piece in self.hooks:
            piece.before_micro_batch(self)
        runner = self.runner
        with watch("forward"), self.accelerator.autocast():
            loss = runner.run_micro_batch(self, x, y) if runner else lm_loss(self.model(x), y)
        with watch("backward"):
            if not runner:
                start = loss
                for piece in self.hooks:
                    start = piece.loss_for_backward(self, start)
                if self.exact:  # its share of the global batch's gradient (summed, never averaged, after)
                    (start / self.exact_divisor).backward()
                else:
                    self.accelerator.backward(start)  # divided by the accumulation steps
        with watch("after_backward"):  # the pieces' work on the gradients (their collectives: the backward's)
            self.after_backward()
        self._step_loss += loss.detach()
        self._micro_batches += 1
        return loss

    def after_backward(self) -> None:
        """Every piece's work on the gradients, in reverse order (the backward unwinds the forward)."""
        for piece in reversed(self.hooks):
            piece.after_backward(self)

    def clip(self, local_only: bool = False, exact: bool = False) -> float:
        """Clip to max_norm (--grad_clip) by the global norm and return it (`local_only`: the mistake of each
        rank clipping by its own piece's norm)."""
        with self.instruments.watch("clip"):
            for piece in self.hooks:
                piece.before_clip(self)
            options = self.runner.clip_options(self) if self.runner else {}
            return clip_by_global_norm(
                self.model.parameters(), self.max_norm, local_only=local_only, exact=exact, **options
            )

    def step(self, grad_norm: float | None = None) -> None:
        """AdamW on a step's last micro-batch (Accelerate's prepared optimizer skips the others), then zero."""
        with self.instruments.watch("optimizer"):
            self.optimizer.step()
        if self.accelerator.sync_gradients:  # before zero_grad: the gradients held are part of the bytes held
            self.instruments.after_step(self, self._step_loss / self._micro_batches, grad_norm)
            self._step_loss, self._micro_batches = torch.zeros_like(self._step_loss), 0
        self.optimizer.zero_grad()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss over the tokens of a batch, no gradients."""
        x, y = self.split_batch(x, y)
        with self.accelerator.autocast():
            return self.runner.evaluate(self, x, y) if self.runner else lm_loss(self.model(x), y)

    def evaluate_rows(self, rows: tuple[torch.Tensor, torch.Tensor], batch_size: int) -> float:
        """The mean loss over the scored tokens of every rank's `rows` (inputs, targets; a target of
        IGNORED_TARGET scores nothing: common/data.padded_share), `batch_size` rows a forward. Every rank runs the
        same number of forwards (FSDP all-gathers in each); each forward's mean is weighed by the tokens it
        scored on this rank (cp: its chunks'), so every token counts once however the rows are split."""
        device = self.accelerator.device
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for start in range(0, len(rows[0]), batch_size):
            x, y = (t[start : start + batch_size].to(device) for t in rows)
            scored = (self.split_batch(x, y)[1] != IGNORED_TARGET).sum().double()
            loss = self.evaluate(x, y).double()
            total += torch.stack([loss * scored if scored else torch.zeros_like(loss), scored])
        for piece in self.hooks:
            piece.after_evaluate(self)
        total = self.accelerator.reduce(total, "sum")
        return (total[0] / total[1]).item()

    def checkpointer(self, restore_optimizer: bool = True) -> ShardedCheckpointer:
        """PyTorch's distributed checkpoint: any layout reads any other's. The full state is gathered from the
        first rank of each coordinate of a piece whose ranks hold different parameters (a pipeline's stages);
        the others hold copies or pieces of what it gathers."""
        apart = {self.runner.dim} if self.runner else set()
        first = all(self.layout.coordinate(self.rank, d) == 0 for d in DIMS if d not in apart)
        aliases = self.runner.checkpoint_aliases(self) if self.runner else {}
        return ShardedCheckpointer(self.model, self.optimizer, restore_optimizer, aliases=aliases,
                                   gathers_full_state=first)  # fmt: skip

    def report(self, session) -> None:
        """What the pieces measure beyond the checks, at the end (every rank calls it)."""
        for piece in having(self.pieces, Measures):
            piece.report(self, session)

    def measure_held(self) -> dict:
        """Bytes this rank really holds at rest: parameters, gradients, optimizer state (local pieces)."""
        unique = unique_tensors(self.model.parameters())
        state = getattr(
            self.optimizer, "optimizer", self.optimizer
        ).state  # Accelerate's wrapper holds the real one
        return {
            "params": sum(local_bytes(p) for p in unique),
            "grads": sum(local_bytes(p.grad) for p in unique if p.grad is not None),
            "optimizer": sum(
                local_bytes(v) for s in state.values() for v in s.values() if torch.is_tensor(v)
            ),
        }

    def measure_window(self) -> int:
        """Parameter bytes held between forward and backward (ZeRO-3 has freed the blocks' gathered copies)."""
        return sum(local_bytes(p) for p in unique_tensors(self.model.parameters()))

    def held_bytes(self, reference, rank: int) -> dict:
        return Theory(reference, self.ctx.plan, rank).held_bytes()

    def sent_bytes(self, reference, rank: int, counted: dict | None = None) -> dict:
        """`counted`: what rank `rank` recorded in the step that a piece's theory takes as input (an MoE's
        routing: theory_inputs)."""
        return Theory(reference, self.ctx.plan, rank, counted).sent_bytes()

    def step_figures(self) -> dict:
        """What a step adds to the logged metrics (W&B, metrics.jsonl): each piece's (an MoE's load imbalance)."""
        figures = {}
        for piece in having(self.pieces, Measures):
            figures.update(piece.step_figures(self))
        return figures

    def theory_inputs(self) -> dict:
        """What the pieces recorded in the last forward that their closed forms take as input."""
        inputs = {}
        for piece in having(self.pieces, Measures):
            inputs.update(piece.theory_inputs(self))
        return inputs


def grad_or_zeros(p) -> torch.Tensor:
    """`p`'s gradient, zeros where it has none yet (a group that trained no micro-batch of a step)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def local_bytes(tensor) -> int:
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return tensor.numel() * tensor.element_size()
