"""One parallelize: a layout applied to the GPT, each dimension's piece in the canonical order, and what each
rank holds and sends by theory, composed from each piece's closed form.

    job = parallelize(gpt, layout, args, work, accelerator, make_optimizer, max_norm)
    loss = job.forward_backward(x, y)        # one micro-batch (a pipeline: the schedule's whole step)
    norm = job.clip()                        # the GLOBAL gradient norm, on a step's last micro-batch
    job.step(norm)                           # AdamW on what each rank holds

The order is torchtitan's: the pipeline split first (each rank keeps its stages, each a GPT holding None for
what it does not run), then on each stage tensor parallelism -> context parallelism -> expert parallelism (a
mixture of experts: its counts summed over the data-parallel ranks, its experts split over ep) -> activation
checkpointing -> torch.compile per block (--compile) -> FSDP (dp_shard; HSDP with dp_replicate) or replicate,
each applied when its degree is > 1.
Each piece is one module that knows its own flags and nothing of the others: this file is the only place
that puts them together, and it asks the layout's degrees, never which preset ran.

The theory (`held_bytes`, `sent_bytes`) needs no process group: it runs on the undistributed GPT for any
rank of any layout, at 2 ranks or 16,384, and the checks compare it with what every rank really holds and
sends (strategies/checks.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common import moe
from common.checkpoint import ShardedCheckpointer
from common.data import IGNORED_TARGET
from common.gpt import lm_loss
from common.optim import clip_by_global_norm
from common.runtime import deepspeed_stage
from strategies import activation_checkpointing, compile, cp, ep, pp, replicate, shard, tp
from strategies.layout import Layout, Workload, submesh, unique_parameters


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


def parallelize(
    gpt, layout: Layout, args, work: Workload, accelerator, make_optimizer, max_norm: float
) -> Job:
    """Apply `layout` to `gpt` (the same initial weights on every rank), in the canonical order; AdamW
    (`make_optimizer(parameters)`) over what this rank holds, prepared by Accelerate; clipping at `max_norm`.
    Under a DeepSpeed accelerate config, DeepSpeed's engine does it all (strategies/deepspeed.py)."""
    if deepspeed_stage():
        from strategies import deepspeed

        return deepspeed.parallelize(gpt, layout, args, work, accelerator, make_optimizer, max_norm)
    # the rank in the process group the mesh is made of: Accelerate's process_index in a launch, the rank a fake
    # process group impersonates in experiments/at_scale.py
    rank, device = dist.get_rank() if dist.is_initialized() else 0, accelerator.device
    if next(gpt.parameters()).device.type not in (device.type, "meta"):  # meta: made real later (at_scale.py)
        gpt.to(device)
    mesh = layout.mesh(device.type) if layout.world_size > 1 else None
    pipeline = (
        pp.Pipeline(gpt, layout, rank, args, pp.activation_dtype(layout, work)) if layout.pp > 1 else None
    )
    stages = list(pipeline.stages) if pipeline else [gpt]
    attentions, exchanges = [], []
    data_dims = tuple(d for d in ("dp_replicate", "dp_shard", "ep") if getattr(layout, d) > 1)
    for index, stage in enumerate(stages):
        if layout.tp > 1:
            tp.apply(stage, mesh["tp"], args)
        if layout.cp > 1:
            attentions += cp.apply(stage, mesh["cp"], layout, rank, args)
        if moe.moe_layers(stage) and data_dims:
            ep_mesh = mesh["ep"] if layout.ep > 1 else None
            exchanges += ep.apply(stage, ep_mesh, submesh(mesh, data_dims).get_group(), layout, rank, args)
        activation_checkpointing.apply(stage, args.activation_checkpointing)
        if args.compile:
            compile.apply(stage)
        if layout.shard_dims:
            shard.apply(
                stage, fsdp_mesh(mesh, layout), args, layout, work, ignored=set(ep.expert_parameters(stage))
            )
        elif layout.replicate_dims:
            # every rank of an Accelerate launch a replica: Accelerate's DDP (a fake world of experiments/at_scale.py,
            # which Accelerate did not launch: PyTorch's replicate on the mesh)
            whole_world = layout.size(layout.replicate_dims) == layout.world_size == accelerator.num_processes
            if whole_world:
                ep.ignore_for_ddp(stage)
            stages[index] = replicate.apply(
                stage, submesh(mesh, layout.replicate_dims), accelerator, whole_world
            )
    if pipeline:
        pipeline.connect(layout, rank, mesh["pp"], device, args.wrong_variant)
    model = pipeline.model if pipeline else stages[0]
    unwrapped = getattr(model, "module", model)  # DDP's wrapped module
    optimizer = accelerator.prepare(make_optimizer(unwrapped.parameters()))
    # the ranks that hold the same experts (the data-parallel ranks of other ep coordinates' peers: not ep)
    replica_dims = tuple(d for d in data_dims if d != "ep")
    expert_replicas = submesh(mesh, replica_dims).get_group() if exchanges and replica_dims else None
    return Job(layout, rank, model, stages, optimizer, accelerator, args, work, max_norm, pipeline, attentions,
               exchanges, expert_replicas)  # fmt: skip


@contextlib.contextmanager
def quiet():
    """What the pieces say that is expected, silenced for the run only (restored after): FSDP2 warns that a root
    returns a view (the logits, cut out of tensor parallelism's padded all-gather; only an in-place change of it
    would be wrong, and nothing changes logits in place), DeviceMesh that slicing a flattened dimension will be
    deprecated, DTensor logs that gathering a 2-D-sharded parameter
    takes two all-gathers, and DeepSpeed calls torch.distributed's deprecated collective names every step."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        # torch 2.13 warns that slicing a flattened dimension (dp_shard_ep, dp_shard_cp) from the root mesh "will be
        # deprecated in PT 2.11" (it still works here); layout.submesh slices it by name after its first flatten
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor). is deprecated",
                                category=FutureWarning)  # fmt: skip
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def fsdp_mesh(mesh, layout: Layout):
    """FSDP2's mesh: the sharding ranks (dp_shard x cp flattened), with the replicas as an outer dimension (HSDP)."""
    sharding = submesh(mesh, layout.shard_dims)
    if layout.dp_replicate == 1:
        return sharding
    return mesh[("dp_replicate", "_".join(layout.shard_dims))]


# ---------------------------------------------------------------------------------- theory, composed
def held_pieces(model, layout: Layout, rank: int, args) -> list[tuple[str, list[int]]]:
    """(name, shape of the rank's tensor-parallel piece) of every parameter rank `rank` holds: the pipeline's
    choice of blocks and ends, the head's copy of a tied embedding on a last stage, tensor parallelism's split."""
    holding = pp.holding(layout, rank, args, model.cfg.n_layer, model.cfg.tie_weights)
    parameters = [(name, p.shape) for name, p in unique_parameters(model) if holding.holds(name)]
    if holding.tied_copy:
        parameters.append(("head.weight", model.tok_emb.weight.shape))
    return [(name, ep.local_shape(name, tp.local_shape(name, shape, layout, rank), layout))
            for name, shape in parameters]  # fmt: skip


def at_rest(name: str, shape, layout: Layout, rank: int) -> list[int]:
    """The piece of a parameter a rank holds at rest: FSDP's shard of its TP piece (experts split by ep: whole)."""
    return list(shape) if ep.split(name, layout) else shard.local_shape(shape, layout, rank)


def held_bytes(model, layout: Layout, rank: int, args, work: Workload) -> dict:
    """A rank's bytes by theory: each parameter's piece at rest (after the pipeline, tensor parallelism, FSDP),
    its gradient the same, AdamW's two moments the same plus a 4-byte step count per tensor; between forward and
    backward the gathered pieces of what FSDP keeps gathered (a pipeline's forward is its whole step: as at
    rest). `model` is the undistributed GPT (float32)."""
    pieces = held_pieces(model, layout, rank, args)
    params = sum(math.prod(at_rest(name, shape, layout, rank)) * 4 for name, shape in pieces)
    return {
        "params": params,
        "grads": params,
        "optimizer": 2 * params + 4 * len(pieces),
        "params_between_forward_and_backward": params
        if layout.pp > 1
        else gathered_bytes(model, layout, rank, args, work),  # fmt: skip
    }


def gathered_bytes(model, layout: Layout, rank: int, args, work: Workload) -> int:
    """Parameter bytes a rank holds between a micro-batch's forward and its backward: FSDP's gathered copies of
    what it keeps gathered (at the gathered precision: bf16 copies under --mixed_precision bf16), the rest at
    rest. (Under a pipeline, while its micro-batches run: experiments/at_scale.py sees inside the step.)"""
    gathered_element = 2 if work.mixed_precision == "bf16" and layout.shard_dims else 4
    total = 0
    for name, shape in held_pieces(model, layout, rank, args):
        gathered = (layout.shard_dims and not ep.split(name, layout)
                    and shard.gathered_between_forward_and_backward(name, args, layout))  # fmt: skip
        total += (
            math.prod(shape) * gathered_element
            if gathered
            else math.prod(at_rest(name, shape, layout, rank)) * 4
        )
    return total


def sent_traffic(model, layout: Layout, rank: int, args, work: Workload, routing: list = ()) -> list:
    """Rank `rank`'s collectives of one step's forwards and backwards, each piece's (strategies.layout.Traffic).
    `routing`: what its MoE blocks sent and received in the step (ep's all-to-alls depend on it)."""
    holding = pp.holding(layout, rank, args, model.cfg.n_layer, model.cfg.tie_weights)
    pieces = held_pieces(model, layout, rank, args)
    experts = [(name, shape) for name, shape in pieces if ep.split(name, layout)]
    pieces = [piece for piece in pieces if piece not in experts]  # ep's own: FSDP and DDP leave them alone
    blocks = len(holding.blocks)
    recomputed = blocks if args.activation_checkpointing == "full" else 0
    tied = tp.local_shape("tok_emb.weight", model.tok_emb.weight.shape, layout, rank)
    return [
        *tp.sent(layout, args, work, blocks, holding.first, holding.last, recomputed),
        *cp.sent(layout, work, blocks),
        *pp.sent(layout, rank, args, work, math.prod(shard.local_shape(tied, layout, rank)) * 4),
        *shard.sent(layout, args, work, pieces),
        *replicate.sent(layout, pieces),
        *ep.sent(layout, work, list(routing), sum(math.prod(shape) * 4 for _, shape in experts)),
    ]


def sent_bytes(model, layout: Layout, rank: int, args, work: Workload, routing: list = ()) -> dict:
    """Rank `rank`'s bytes of one step's forwards and backwards, by kind (what common/comm_counter.py counts:
    each call's whole tensor) and by the dimension that sends them, and what it puts on the wire."""
    traffic = sent_traffic(model, layout, rank, args, work, routing)
    by_kind, by_dimension = {}, {}
    for t in traffic:
        by_kind[t.kind] = by_kind.get(t.kind, 0) + t.bytes
        by_dimension.setdefault(t.by, {})[t.kind] = by_dimension.get(t.by, {}).get(t.kind, 0) + t.bytes
    return {
        "by_kind": by_kind,
        "by_dimension": by_dimension,
        "wire_bytes": sum(t.wire_bytes for t in traffic),
    }
