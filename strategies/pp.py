"""pp: pipeline parallelism. The GPT is cut into stages by blocks (the embeddings with the first stage, the
final LayerNorm and the head with the last); each rank holds one stage (gpipe, 1f1b) or two (interleaved_1f1b
and interleaved_zero_bubble: stages r and r + p, "looped"; zbv and dualpipev: stages r and 2p - 1 - r, a
"V"), and torch.distributed.pipelining's schedule (--pp_schedule) runs --pp_microbatches micro-batches
through them: each stage sends its activations forward and their gradients back, point to point. With
--dp_size d, d copies of the pipeline each read their own share of the data and average each stage's
gradients in one all-reduce per step.

A pipeline cannot run forward apart from backward: `forward` here is the schedule's whole step (each
micro-batch's loss is the mean over its tokens), `backward` what follows it: the micro-batch gradients,
which the schedule summed, divided by m once per parameter (the schedule's own scale_grads would divide a
parameter that two of a rank's stages share, the tied embedding on a V, twice), then the all-reduces.

The tied embedding (--tie_weights, the default): the first stage's token embedding is the last stage's
head. As in Megatron-LM, the last stage keeps a copy, here under the same name (a checkpoint holds it once,
and resumes under any strategy), and the two ends sum their gradients in one all-reduce per step: both
then take the same AdamW step and stay equal. On a V one rank holds both ends: nothing to send.

Theory: each rank holds its stages' parameters (and the tied copy), their gradients and AdamW's state. Per
step, rank 0, across each boundary between its stages and another rank's: m activations (micro-batch rows x
context x width, float32: the residual stream) one way and m gradients of them the other; the loss (4
bytes) broadcast from the last stage for the log; the tied gradient (vocab x width) all-reduced between the
ends; with --dp_size > 1, its stages' gradients all-reduced over their replicas. Bubble, the share of a step
a rank waits: (p - 1) / (m + p - 1) for gpipe and 1f1b, (p - 1) / (v m + p - 1) interleaved over v stages
per rank (Narayanan et al. 2021), 0 for zbv with m >= 2p when forward, input-backward and weight-backward
take equal time (Qi et al. 2024); measured per schedule by `report`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.checkpoint import ShardedCheckpointer
from common.comm_counter import bus_factor
from common.config import require
from common.gpt import GPT
from common.optim import clip_to
from common.profiling import plot_timeline
from strategies.defaults import (  # noqa: F401  # fmt: skip (the interface)
    STEADY_STEP,
    measure_held,
    measure_window,
    quiet,
    with_optimizer,
)
from strategies.layout import Layout, held, unique_parameters

NAME = "pp"
SUMMARY = "pipeline: stages of blocks on ranks, micro-batches through them (every schedule)"
RANKS = 2
CHECKPOINT_FORMAT = "dcp"  # PyTorch's distributed checkpoint: any layout reads it
AUTOCAST = False  # each stage runs its forward under torch.autocast itself (nothing of it is prepared)
OWN_WRONG_VARIANTS = {
    "pp_unscaled_microbatch_gradients": "the micro-batch gradients summed, never divided by m",
    "pp_whole_model_on_every_rank": "every rank keeps the whole GPT, running only its stage",
    "pp_tied_embedding_not_synced": "the head's copy of the tied embedding never gets the first stage's gradient",
}
WRONG_VARIANTS = (
    "same_data_on_every_rank",
    "local_grad_norm",
    "seed_per_rank",
    *OWN_WRONG_VARIANTS,
    "resume_without_optimizer_state",
    "resume_without_data_position",
)
# name: (torch.distributed.pipelining's schedule, stages per rank, where they sit); imported when a pipeline
# is built: the module costs 0.6 s of start-up (it imports torch._dynamo), which no other strategy needs
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
# the zero-bubble schedules: each micro-batch's backward split in input gradients, then weight gradients
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv", "dualpipev")


def layout(world_size: int, dp_size: int = 0, tp_size: int = 0) -> Layout:
    dp = dp_size or 1
    require(
        tp_size in (0, 1) and world_size % dp == 0 and world_size // dp >= 2,
        f"--strategy pp needs >= 2 stage ranks per pipeline and no --tp_size: {world_size} ranks, --dp_size "
        f"{dp_size}, --tp_size {tp_size} (e.g. 2 ranks, or 4 ranks with --dp_size 2)",
    )
    return Layout(world_size, dp, 1, world_size // dp)


def stages_of(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stage indices stage-rank `pp_rank` of `pp` holds."""
    _, per_rank, placement = SCHEDULES[schedule]
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + pp * i for i in range(per_rank)]


def holder(stage: int, pp: int, schedule: str) -> int:
    """The stage-rank that holds `stage`."""
    return next(r for r in range(pp) if stage in stages_of(r, pp, schedule))


def block_bounds(n_layer: int, n_stages: int) -> list[int]:
    """Stage s holds blocks [bounds[s], bounds[s + 1]): as even as whole blocks allow."""
    return [round(i * n_layer / n_stages) for i in range(n_stages + 1)]


def refuse(cfg, layout: Layout) -> None:
    _, per_rank, _ = SCHEDULES[cfg.pp_schedule]
    p, m, n_stages = layout.pp, cfg.pp_microbatches, layout.pp * per_rank
    require(cfg.gradient_accumulation_steps == 1, f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} "
            "with --strategy pp: the pipeline's micro-batches are its accumulation; use --pp_microbatches")  # fmt: skip
    require(cfg.per_rank_batch_size % m == 0,
            f"--per_rank_batch_size {cfg.per_rank_batch_size} must split evenly into --pp_microbatches {m}")  # fmt: skip
    require(cfg.n_layer >= n_stages, f"--pp_schedule {cfg.pp_schedule} on {p} stage ranks cuts the GPT into "
            f"{n_stages} stages: --n_layer {cfg.n_layer} must be >= {n_stages}")  # fmt: skip
    require(not (cfg.activation_checkpointing == "selective" and cfg.pp_schedule in SPLIT_BACKWARD),
            f"--activation_checkpointing selective with --pp_schedule {cfg.pp_schedule}: a zero-bubble schedule runs "
            "each backward in two passes (input, then weight gradients) and torch's selective checkpoint allows one; "
            "use full, or 1f1b / gpipe / interleaved_1f1b")  # fmt: skip
    rounds = max(1, m // p)
    least = {"1f1b": p, "dualpipev": 2 * p}.get(cfg.pp_schedule, 1)
    require(m >= least and (per_rank == 1 or "interleaved" not in cfg.pp_schedule or m % rounds == 0),
            f"--pp_microbatches {m} with --pp_schedule {cfg.pp_schedule} on {p} stage ranks: it needs >= {least}"
            + (f" and a multiple of {rounds} (m // p rounds)" if "interleaved" in cfg.pp_schedule else ""))  # fmt: skip


class Stage(nn.Module):
    """One stage: a run of blocks, with the embeddings if it is the first and the final LayerNorm and head
    if it is the last. Its modules are the rank's GPTPiece's (the same tensors)."""

    def __init__(self, piece: GPTPiece, blocks: range, first: bool, last: bool, autocast: bool):
        super().__init__()
        self.first, self.last, self.autocast = first, last, autocast
        if first:
            self.tok_emb, self.pos_emb = piece.tok_emb, piece.pos_emb
        self.blocks = nn.ModuleList(piece.blocks[str(i)] for i in blocks)
        if last:
            self.ln_f, self.head = piece.ln_f, piece.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.first:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss: the mean cross-entropy over its tokens (GPT.forward's)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class GPTPiece(nn.Module):
    """What one rank of a pipeline holds: its stages' parts of the GPT under the GPT's own names (a checkpoint
    of it is a piece of the GPT's), the stages, and the schedule that runs them. Training steps go through
    `train_step`; `forward(x, y)` evaluates (no gradients): the stages in order, one batch, no micro-batches
    (nothing to overlap), every rank of the pipeline getting the loss."""

    configure_optimizers = GPT.configure_optimizers  # the GPT's AdamW groups, over what this rank holds

    def __init__(self, gpt: GPT, layout: Layout, rank: int, cfg, groups: dict):
        super().__init__()
        self.p, self.schedule_name, self.groups, self.d_model = (
            layout.pp,
            cfg.pp_schedule,
            groups,
            gpt.cfg.d_model,
        )
        self.pp_rank = layout.pp_rank(rank)
        self.gpt_names = [name for name, _ in unique_parameters(gpt)]  # the GPT's order, for its full state
        self.stage_ids = stages_of(self.pp_rank, self.p, self.schedule_name)
        self.n_stages = self.p * len(self.stage_ids)
        self.holds_first, self.holds_last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        bounds = block_bounds(gpt.cfg.n_layer, self.n_stages)
        whole = cfg.wrong_variant == "pp_whole_model_on_every_rank"  # the mistake: nothing is cut away
        mine = (
            range(gpt.cfg.n_layer)
            if whole
            else [i for s in sorted(self.stage_ids) for i in range(bounds[s], bounds[s + 1])]
        )
        # registered in the GPT's order (tok_emb, pos_emb, blocks, ln_f, head): the same names and optimizer
        # groups; a last stage's tied head keeps the name tok_emb.weight
        if whole or self.holds_first or (self.holds_last and gpt.cfg.tie_weights):
            self.tok_emb = gpt.tok_emb
        if whole or self.holds_first:
            self.pos_emb = gpt.pos_emb
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in mine})
        if whole or self.holds_last:
            self.ln_f, self.head = gpt.ln_f, gpt.head
        autocast = cfg.mixed_precision == "bf16"
        # a plain list: the stages' modules are this piece's, registered once (here)
        self.stages = [
            Stage(self, range(bounds[s], bounds[s + 1]), s == 0, s == self.n_stages - 1, autocast)
            for s in self.stage_ids
        ]
        self.microbatches = cfg.pp_microbatches
        self.unscaled = cfg.wrong_variant == "pp_unscaled_microbatch_gradients"
        self.timeline: list[tuple[str, float, float]] = []  # this step's (kind, start, end) of every action
        self.step_timelines: list[list] = []
        self.schedule = None

    def holder(self, stage: int) -> int:
        return holder(stage, self.p, self.schedule_name)

    def build_schedule(self, device) -> None:
        from torch.distributed import pipelining

        name, per_rank, _ = SCHEDULES[self.schedule_name]
        cls, PipelineStage = getattr(pipelining, name), pipelining.PipelineStage  # noqa: N806 (torch's class)
        stages = [
            PipelineStage(stage, s, self.n_stages, device, group=self.groups["pp"])
            for stage, s in zip(self.stages, self.stage_ids, strict=True)
        ]
        for stage in stages:  # time each action of each stage, for the bubble (report)
            for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                                 ("backward_weight_one_chunk", "W")):  # fmt: skip
                setattr(stage, method, self._timed(getattr(stage, method), kind))
        # scale_grads=False: the schedule sums micro-batch gradients; `backward` divides each parameter once
        self.schedule = cls(
            stages if per_rank > 1 else stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False
        )

    def _timed(self, action, kind: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = action(*args, **kwargs)
            self.timeline.append((kind, started, time.perf_counter()))
            return result

        return timed

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One schedule step over the batch: the mean of its micro-batch losses, on every stage-rank."""
        self.timeline = []
        losses: list = []
        self.schedule.step(
            *([x] if self.holds_first else []),
            target=y if self.holds_last else None,
            losses=losses if self.holds_last else None,
            return_outputs=False,
        )
        self.step_timelines.append(self.timeline)
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=x.device)
        return self._from_last_stage(loss)

    def _from_last_stage(self, loss: torch.Tensor) -> torch.Tensor:
        dist.broadcast(loss, group=self.groups["pp"], group_src=self.holder(self.n_stages - 1))  # for the log
        return loss

    @torch.no_grad()
    def forward(self, x: torch.Tensor, y: torch.Tensor):
        group, loss, activation = self.groups["pp"], torch.zeros((), device=x.device), None
        for s in self.stage_ids if len(self.stage_ids) == 1 else sorted(self.stage_ids):
            if s and self.holder(s - 1) != self.pp_rank:
                activation = torch.empty(*x.shape, self.d_model, device=x.device)
                dist.recv(activation, group=group, group_src=self.holder(s - 1))
            output = self.stages[self.stage_ids.index(s)](x if s == 0 else activation)
            if s == self.n_stages - 1:
                loss = loss_fn(output, y)
            elif self.holder(s + 1) != self.pp_rank:
                dist.send(output.contiguous(), group=group, group_dst=self.holder(s + 1))
            activation = output
        return None, self._from_last_stage(loss)

    def tied_copy(self) -> bool:
        """Whether this rank holds the last stage's copy of the tied embedding without the first stage."""
        return "tied" in self.groups and self.holds_last and not self.holds_first


def apply(model: GPT, layout: Layout, accelerator, cfg):
    """Cut this rank's piece out of the GPT (every rank built the same one), make its stages and schedule,
    and AdamW over what it holds."""
    rank, device = accelerator.process_index, accelerator.device
    mesh = layout.mesh(device.type)
    groups = {"pp": mesh["pp"].get_group()}
    if layout.dp > 1:
        groups["dp"] = mesh["dp"].get_group()
    # The two ends of each pipeline sum the tied embedding's gradient, unless one rank holds both (a V): one
    # group per pipeline, and every rank makes every group (new_group's rule)
    first, last = tied_ends(layout, cfg)
    if model.cfg.tie_weights and first != last and cfg.wrong_variant != "pp_tied_embedding_not_synced":
        for replica in range(layout.dp):
            ends = [
                first * layout.dp + replica,
                last * layout.dp + replica,
            ]  # rank = stage-rank x dp + dp-rank
            group = dist.new_group(ends)
            if rank in ends:
                groups["tied"] = group
    piece = GPTPiece(model.to(device), layout, rank, cfg, groups)
    piece.build_schedule(device)
    return with_optimizer(piece, accelerator, cfg)


def tied_ends(layout: Layout, cfg) -> tuple[int, int]:
    """The stage-ranks of the first and the last stage."""
    n_stages = layout.pp * SCHEDULES[cfg.pp_schedule][1]
    return holder(0, layout.pp, cfg.pp_schedule), holder(n_stages - 1, layout.pp, cfg.pp_schedule)


def forward(model: GPTPiece, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The schedule's whole step, forward and backward of every micro-batch (see the module docstring)."""
    return model.train_step(x, y)


def backward(model: GPTPiece, loss: torch.Tensor, accelerator) -> None:
    """After the schedule: the summed micro-batch gradients divided by m, averaged over the data-parallel
    replicas (one flat all-reduce), the tied embedding's summed between the ends."""
    grads = [p.grad for _, p in unique_parameters(model) if p.grad is not None]
    if not model.unscaled:
        torch._foreach_div_(grads, model.microbatches)
    if "dp" in model.groups:
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=model.groups["dp"])
        flat /= dist.get_world_size(model.groups["dp"])
        torch._foreach_copy_(
            grads,
            [
                piece.view_as(g)
                for piece, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)
            ],
        )
    if "tied" in model.groups:
        dist.all_reduce(model.tok_emb.weight.grad, group=model.groups["tied"])


def clip(model: GPTPiece, cfg) -> float:
    """Clip by the norm of the WHOLE model's gradient: each stage-rank's sum of squares (the tied copy counted
    at the first stage only), summed over the pipeline. `local_grad_norm`: each rank by its stages' own."""
    grads = [p.grad for _, p in unique_parameters(model) if p.grad is not None]
    copy = model.tok_emb.weight.grad if model.tied_copy() else None
    squared = sum(
        (g.float().pow(2).sum() for g in grads if g is not copy), torch.zeros((), device=grads[0].device)
    )
    if cfg.wrong_variant != "local_grad_norm":
        dist.all_reduce(squared, group=model.groups["pp"])
    return clip_to(grads, squared.sqrt(), cfg.grad_clip)


class PipelineCheckpointer(ShardedCheckpointer):
    """DCP as every strategy (each rank writes its stages' tensors under the GPT's names; the tied copy and
    data-parallel replicas are the same tensor under the same name, written once). The full state is every
    rank's piece, gathered on the main process and put together in the GPT's order."""

    def __init__(self, model, optimizer, restore_optimizer: bool, order: list[str]):
        super().__init__(model, optimizer, restore_optimizer)
        self.order = order  # the GPT's parameter names, in its order (its optimizer groups keep it)

    def full_state(self) -> tuple[dict, dict]:
        import copy

        from torch.distributed.checkpoint.state_dict import get_state_dict

        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, copy.deepcopy(get_state_dict(self.model, self.optimizer)))
        if dist.get_rank() != 0:
            return {}, {}
        model_state = {k: v for model_piece, _ in pieces for k, v in model_piece.items()}
        state = {k: v for _, optimizer_piece in pieces for k, v in optimizer_piece["state"].items()}
        position = {name: i for i, name in enumerate(self.order)}
        groups = []
        for index, group in enumerate(pieces[0][1]["param_groups"]):
            names = {
                n for _, optimizer_piece in pieces for n in optimizer_piece["param_groups"][index]["params"]
            }
            groups.append({**group, "params": sorted(names, key=position.__getitem__)})
        return dict(sorted(model_state.items(), key=lambda kv: kv[0])), {
            "state": state,
            "param_groups": groups,
        }


def checkpointer(model, optimizer, accelerator, cfg) -> PipelineCheckpointer:
    restore_optimizer = cfg.wrong_variant != "resume_without_optimizer_state"
    return PipelineCheckpointer(model, optimizer, restore_optimizer, model.gpt_names)


def owned(model: GPT, layout: Layout, rank: int, cfg) -> list[tuple[str, nn.Parameter]]:
    """The GPT's (name, parameter) a rank holds, by theory: its stages' blocks, the embeddings with the first
    stage, the final LayerNorm and head with the last (a tied head: the embedding, under its name)."""
    stage_ids = stages_of(layout.pp_rank(rank), layout.pp, cfg.pp_schedule)
    n_stages = layout.pp * len(stage_ids)
    bounds = block_bounds(model.cfg.n_layer, n_stages)
    blocks = {f"blocks.{i}." for s in stage_ids for i in range(bounds[s], bounds[s + 1])}
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids

    def held_by_rank(name: str) -> bool:
        if name.startswith("blocks."):
            return any(name.startswith(prefix) for prefix in blocks)
        if name.startswith(("tok_emb.", "pos_emb.")):
            return first or (last and name == "tok_emb.weight" and model.cfg.tie_weights)
        return last  # ln_f, an untied head

    return [(name, p) for name, p in unique_parameters(model) if held_by_rank(name)]


def held_bytes(model: GPT, layout: Layout, rank: int, cfg) -> dict:
    """Its stages' parameters in float32 (autocast casts per operation), gradients and AdamW state."""
    parameters = owned(model, layout, rank, cfg)
    return held(sum(p.numel() * p.element_size() for _, p in parameters), len(parameters))


def sent_bytes(model: GPT, layout: Layout, cfg) -> dict:
    """Rank 0's bytes of one step: activations and their gradients across each of its stages' boundaries with
    another rank (m each way), the loss's broadcast, the tied gradient's all-reduce, the replicas' all-reduce."""
    m, p = cfg.pp_microbatches, layout.pp
    stage_ids = stages_of(0, p, cfg.pp_schedule)
    n_stages = p * len(stage_ids)
    activation = (cfg.per_rank_batch_size // m) * cfg.block_size * model.cfg.d_model * 4  # float32
    boundaries = sum(
        (s > 0 and holder(s - 1, p, cfg.pp_schedule) != 0)
        + (s < n_stages - 1 and holder(s + 1, p, cfg.pp_schedule) != 0)
        for s in stage_ids
    )
    pipeline = {"send": boundaries * m * activation, "recv": boundaries * m * activation, "broadcast": 4}
    first, last = tied_ends(layout, cfg)
    if model.cfg.tie_weights and first != last:
        pipeline["all_reduce"] = model.tok_emb.weight.numel() * 4
    data_parallel = {}
    if layout.dp > 1:
        data_parallel["all_reduce"] = sum(p.numel() * 4 for _, p in owned(model, layout, 0, cfg))
    by_kind = {k: pipeline.get(k, 0) + data_parallel.get(k, 0) for k in {**pipeline, **data_parallel}}
    wire = pipeline["send"] + pipeline.get("all_reduce", 0) + pipeline["broadcast"]  # two ranks per call
    wire += sum(bus_factor(kind, layout.dp) * size for kind, size in data_parallel.items())
    return {"by_kind": by_kind, "data_parallel": data_parallel, "tensor_parallel": {}, "pipeline": pipeline,
            "wire_bytes": wire}  # fmt: skip


def bubble_theory(schedule: str, p: int, m: int) -> float | None:
    """The share of a step a stage-rank idles, by its paper (equal forward, backward, weight-gradient times);
    None where the paper gives no closed form for this placement."""
    v = SCHEDULES[schedule][1]
    if schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        return (p - 1) / (v * m + p - 1)
    if schedule == "zbv" and m >= 2 * p:
        return 0.0
    return None


def report(session, model: GPTPiece, cfg) -> None:
    """The bubble of every step after the one-time work, measured on the first pipeline's stage-ranks: 1 - mean
    busy time / the step's span (perf_counter is one clock for the processes of a host; across hosts
    the spans would need a clock sync), beside its theory; and the median step's timeline."""
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, model.step_timelines)
    if not session.is_main:
        return
    dp = dist.get_world_size() // model.p
    pipeline = [every_rank[r * dp] for r in range(model.p)]  # replica 0's stage-ranks
    steps = []
    for k in range(STEADY_STEP - 1, len(pipeline[0])):
        actions = [timeline[k] for timeline in pipeline]
        start = min(a[1] for rank_actions in actions for a in rank_actions)
        span = max(a[2] for rank_actions in actions for a in rank_actions) - start
        busy = [sum(a[2] - a[1] for a in rank_actions) for rank_actions in actions]
        steps.append(
            (
                1 - statistics.mean(busy) / span,
                span,
                [[(kind, s - start, e - start) for kind, s, e in a] for a in actions],
            )
        )
    if not steps:
        return
    median = sorted(steps, key=lambda step: step[0])[len(steps) // 2]
    theory = bubble_theory(cfg.pp_schedule, model.p, cfg.pp_microbatches)
    lanes = [
        (f"stage-rank {r} (stages {', '.join(map(str, stages_of(r, model.p, cfg.pp_schedule)))})",
         {name: [(1e3 * s, 1e3 * e) for kind, s, e in actions if kind == name[0].upper()] for name in TIMELINE_KINDS})
        for r, actions in enumerate(median[2])
    ]  # fmt: skip
    path = f"{session.output_dir}/pipeline_timeline.png"
    title = (f"{cfg.pp_schedule}: {model.p} stage-ranks x {model.n_stages // model.p} stage(s), m = {cfg.pp_microbatches}: "
             f"the median step, bubble {median[0]:.2f}")  # fmt: skip
    plot_timeline(lanes, TIMELINE_KINDS, title, path)
    row = {
        "schedule": cfg.pp_schedule,
        "stage_ranks": model.p,
        "stages": model.n_stages,
        "microbatches": cfg.pp_microbatches,
        "measured_bubble": statistics.median(step[0] for step in steps),
        "theory_bubble": theory,
        "step_ms": 1e3 * statistics.median(step[1] for step in steps),
        "steps_measured": len(steps),
    }
    session.metrics["pipeline"] = {**row, "timeline_png": path}
    session.log_table("pipeline_bubble", [row], path)
    session.print(
        f"pipeline {cfg.pp_schedule}: bubble {row['measured_bubble']:.3f} measured (median of {len(steps)} steps), "
        f"{'n/a' if theory is None else f'{theory:.3f}'} by theory; {row['step_ms']:.1f} ms per step; {path}"
    )


TIMELINE_KINDS = {"forward": "tab:blue", "backward": "tab:orange", "weight gradients": "tab:green"}
