"""A rank's part of a parallelized GPT at run time (what strategies/parallelize.py returns, and what DeepSpeed's
engine becomes in strategies/deepspeed.py): one micro-batch's forward and backward, the clipping by the global
norm, the optimizer step, the evaluation, the checkpointer, and the bytes it really holds beside its theory.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from common import moe
from common.checkpoint import ShardedCheckpointer
from common.data import IGNORED_TARGET
from common.gpt import lm_loss
from common.optim import clip_by_global_norm
from strategies import cp, ep, pp, shard, tp
from strategies.layout import Layout, Workload
from strategies.theory import held_bytes, sent_bytes


class Instruments:
    """Where a job reports what it does, for whoever measures it (strategies/checks.Probe): no-ops here."""

    def watch(self, phase: str):
        return contextlib.nullcontext()

    def after_step(self, job, loss: torch.Tensor, grad_norm: float) -> None:
        pass


class Job:
    """A rank's part of the parallelized GPT. `model`: what the rank holds as one module under the GPT's names
    (its optimizer, checkpoints and bytes held); `stages`: what runs (the model itself, or a pipeline's stages
    sharing its modules)."""

    def __init__(self, layout: Layout, rank: int, model, stages, optimizer, accelerator, args, work: Workload,
                 max_norm: float, pipeline: pp.Pipeline | None, attentions: list, exchanges: list = (),
                 expert_replicas=None):  # fmt: skip
        self.layout, self.rank, self.model, self.stages = layout, rank, model, stages
        self.optimizer, self.accelerator, self.args, self.work = optimizer, accelerator, args, work
        self.max_norm = max_norm
        self.pipeline, self.attentions = pipeline, attentions
        # expert parallelism's all-to-alls (their routing is the theory's) and the group of the experts' replicas
        self.exchanges, self.expert_replicas = list(exchanges), expert_replicas
        self.balance_history: list[dict] = []  # each step's MoE loads (common/moe.balance)
        self.instruments = Instruments()
        self._step_loss, self._micro_batches = torch.zeros((), device=accelerator.device), 0

    # The first step free of one-time work, whose collectives communication_volume counts. Step 1 is, once the
    # evaluation before it has resharded FSDP2's root (evaluate_rows): DDP rebuilds its buckets and broadcasts
    # rank 0's order only in the forward of step 2 (144 to 268 bytes, measured), so step 1 never sees it. A
    # pipeline's first schedule step initialises it (a vote and the shapes sent once, measured: 179 bytes): 2.
    @property
    def steady_step(self) -> int:
        return 2 if self.pipeline else 1

    @property
    def forward_is_whole_step(self) -> bool:
        """A pipeline runs every micro-batch's forward and backward in one schedule step: nothing to see between."""
        return self.pipeline is not None

    def split_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """This rank's tokens of its data-parallel rank's rows (context parallelism keeps its chunks)."""
        return cp.split_batch(x, y, self.layout, self.rank, self.args) if self.layout.cp > 1 else (x, y)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One micro-batch: the mean loss over its tokens, its gradients accumulated (a pipeline: the
        schedule's step over its micro-batches, then the gradients divided by m and the tied ones summed)."""
        x, y = self.split_batch(x, y)
        watch = self.instruments.watch
        if self.pipeline:
            with watch("forward"), self.accelerator.autocast():
                loss = self.pipeline.step(x, y)
            with watch("backward"):
                if self.layout.tp > 1:
                    tp.align_gradients(self.model)
                self.pipeline.after_backward()
        else:
            shard.set_gradient_sync(self.model, self.accelerator.sync_gradients)  # FSDP2's no_sync
            ep.forget_routing(self.exchanges)
            with watch("forward"), self.accelerator.autocast():
                loss = lm_loss(self.model(x), y)
            with watch("backward"):
                self.accelerator.backward(loss)  # divided by the accumulation steps
                if self.exchanges and self.accelerator.sync_gradients:
                    ep.reduce_gradients(self.model, self.expert_replicas, self.layout.dp)
        self._step_loss += loss.detach()
        self._micro_batches += 1
        return loss

    def clip(self) -> float:
        """Clip to max_norm (--grad_clip) by the global norm and return it (local_grad_norm: each rank its own
        piece's). First, a mixture of experts' step loads (summed over the data-parallel ranks) move its balancing
        bias."""
        if self.work.model.n_experts:
            self.balance_history.append(moe.balance(self.model))
        return clip_by_global_norm(
            self.model.parameters(),
            self.max_norm,
            local_only=self.args.wrong_variant == "local_grad_norm",
            across=self.pipeline.groups["pp"] if self.pipeline else None,
            counted_elsewhere=[self.pipeline.tied_copy()]
            if self.pipeline and self.pipeline.tied_copy() is not None
            else (),
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
            return self.pipeline.evaluate(x, y) if self.pipeline else lm_loss(self.model(x), y)

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
        shard.reshard(self.model)  # the next step all-gathers the root, as its theory says
        total = self.accelerator.reduce(total, "sum")
        return (total[0] / total[1]).item()

    def checkpointer(self, restore_optimizer: bool = True) -> ShardedCheckpointer:
        """PyTorch's distributed checkpoint: any layout reads any other's. The full state is gathered from the
        first rank of each pipeline stage (the others hold copies or pieces of what it gathers)."""
        first_of_stage = all(
            self.layout.coordinate(self.rank, d) == 0 for d in ("dp_replicate", "dp_shard", "ep", "cp", "tp")
        )
        return ShardedCheckpointer(self.model, self.optimizer, restore_optimizer,
                                   aliases=self.pipeline.aliases if self.pipeline else {},
                                   gathers_full_state=first_of_stage)  # fmt: skip

    def report(self, session) -> None:
        """What the pieces measure beyond the checks, at the end (every rank calls it)."""
        if self.pipeline:
            self.pipeline.report(session)
        if self.attentions:
            cp.report(session, self.attentions, self.args.cp_load_balance)
        if self.balance_history:
            # the forward's all-to-all seconds twice (the backward's send the same bytes back; not timed apart)
            # over the forward and backward seconds of every step (this rank's)
            trained = sum(
                t.get("forward", 0) + t.get("backward", 0)
                for t in getattr(self.instruments, "step_times", [])
            )
            a2a = sum(exchange.seconds for exchange in self.exchanges)
            moe.report(
                session, self.balance_history, 2 * a2a / trained if self.exchanges and trained else None
            )

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
        return held_bytes(reference, self.layout, rank, self.args, self.work)

    def sent_bytes(self, reference, rank: int, counted: dict | None = None) -> dict:
        """`counted`: what rank `rank` counted in the step (the routing of its MoE blocks, ep's theory's input)."""
        routing = (counted or {}).get("routing", [])
        return sent_bytes(reference, self.layout, rank, self.args, self.work, routing)

    def step_figures(self) -> dict:
        """What a step adds to the logged metrics (W&B, metrics.jsonl): a mixture of experts' load imbalance (max /
        mean tokens per expert, the blocks' mean) and dropped share."""
        if not self.balance_history:
            return {}
        last = self.balance_history[-1]
        return {"expert_imbalance": sum(last["imbalance"]) / len(last["imbalance"]),
                "expert_dropped_fraction": last["dropped_fraction"]}  # fmt: skip

    def routing(self) -> list[dict]:
        """What this rank's MoE exchanges sent and received in the last forward (strategies/ep.py)."""
        return [record for exchange in self.exchanges for record in exchange.routing]


def unique_tensors(parameters) -> list:
    return list({id(p): p for p in parameters}.values())


def local_bytes(tensor) -> int:
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return tensor.numel() * tensor.element_size()
