"""pp: pipeline parallelism. The GPT is cut into stages by blocks (the embeddings with the first stage, the
final LayerNorm and the head with the last); each rank holds one stage (gpipe, 1f1b) or two (interleaved_1f1b
and interleaved_zero_bubble: stages r and r + p, "looped"; zbv and dualpipev: stages r and 2p - 1 - r, a
"V"), and torch.distributed.pipelining's schedule (--pp_schedule) runs --pp_microbatches micro-batches
through them: each stage sends its activations forward and their gradients back, point to point.

A stage is the GPT itself (or a transformers model under its names) holding None for what it does not run, as
torchtitan's models do: its blocks keep their names (blocks.2 on whichever rank holds it), so its checkpoint is a
piece of the model's and the model's own forward runs it. The other dimensions apply to each stage as to a whole.

A pipeline cannot run forward apart from backward: `step` is the schedule's whole step (each micro-batch's loss
the mean over its tokens), `after_backward` what follows: the gradients the schedule summed divided by m once per
parameter (its own scale_grads would divide one two stages share twice), then the tied embedding's summed.

The tied embedding (--tie_weights, the default): the first stage's token embedding is the last stage's head.
As in Megatron-LM the last stage keeps a copy (its own parameter, head.weight), and the two ends sum their
gradients in one all-reduce per step (on a V one rank holds both: summed in place): both then take the same
AdamW step and stay equal. A checkpoint holds the tied weight once: the copy's optimizer state is kept
under the embedding's name (`aliases`), so any layout resumes it.

Theory per rank: it holds its stages' parameters (and the tied copy). Per step, across each boundary between
one of its stages and another rank's: m activations (micro-batch rows x its tokens x width, float32: the
residual stream; bf16 under FSDP's bf16 policy) one way and m gradients of them the other; the loss (4
bytes) broadcast from the last stage for the log; the tied gradient (its piece of vocab x width) all-reduced
between the ends. The schedules themselves (where stages sit, each rank's order, the bubble by each schedule's
paper) are one model shared with the timeline and the fake ranks: strategies/pp_schedules.py; the bubble is
measured per schedule by `report`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.fsdp import FSDPModule

from common.config import flag, require
from common.device import device_time
from common.gpt import GPT, lm_loss
from common.moe import forget_counts, local
from strategies import pp_schedules as schedules  # where stages sit, each rank's order, the bubble by paper
from strategies.layout import Layout, Mistake, Traffic, stream_dtype, unique_tensors
from strategies.piece import (
    Context,
    HooksTheStep,
    Measures,
    Piece,
    Plan,
    RunsTheStep,
    SplitsParameters,
    Theory,
)

MISTAKES = {  # each: what it is, and the runs under which it is one
    "pp_unscaled_microbatch_gradients": Mistake.of(
        "pp", "the micro-batch gradients summed, never divided by m"
    ),
    "pp_whole_model_on_every_rank": Mistake.of(
        "pp", "every rank keeps the whole GPT, running only its stage"
    ),
    "pp_tied_embedding_not_synced": Mistake.of(
        "pp", "the head's copy of the tied embedding never gets the first stage's gradient"
    ),
}


@dataclass
class Flags:
    pp: int = flag(0, "pipeline-parallel degree: ranks that each hold some of the blocks (0, 1: off)")
    pp_schedule: str = flag("1f1b", "with --pp: the schedule (gpipe, 1f1b: one stage per rank; interleaved_*, zbv, "
                            "dualpipev: two)", choices=tuple(schedules.SCHEDULES))  # fmt: skip
    pp_microbatches: int = flag(
        4, "with --pp: micro-batches per step, each --per_rank_batch_size / this rows"
    )
    pp_fewer_blocks_at_ends: int = flag(0, "with --pp: the first and the last stage hold this many blocks fewer "
                                        "than the others, which the embedding and the head (and the loss's logits) "
                                        "weigh down (Llama 3 cut 1 each)")  # fmt: skip


def refuse(plan: Plan) -> None:
    args, layout, work = plan.args, plan.layout, plan.work
    if layout.pp == 1:
        return
    _, per_rank, _ = schedules.SCHEDULES[args.pp_schedule]
    p, m, n_stages = layout.pp, args.pp_microbatches, layout.pp * per_rank
    require(m > 0, f"--pp_microbatches must be > 0, got {m}")
    require(work.micro_batches == 1, f"--gradient_accumulation_steps {work.micro_batches} with --pp: the "
            "pipeline's micro-batches are its accumulation; use --pp_microbatches")  # fmt: skip
    require(work.rows % m == 0,
            f"--per_rank_batch_size {work.rows} must split evenly into --pp_microbatches {m}")  # fmt: skip
    require(work.model.n_layer >= n_stages, f"--pp_schedule {args.pp_schedule} on {p} stage ranks cuts the GPT into "
            f"{n_stages} stages: --n_layer {work.model.n_layer} must be >= {n_stages}")  # fmt: skip
    fewer = args.pp_fewer_blocks_at_ends
    sizes = schedules.blocks_a_stage(work.model.n_layer, n_stages, max(0, fewer))
    require(fewer >= 0 and min(sizes) > 0, f"--pp_fewer_blocks_at_ends {fewer} with --n_layer {work.model.n_layer} on "
            f"{n_stages} stages: it must be >= 0 and leave every stage a block (blocks a stage: {sizes})")  # fmt: skip
    rounds = max(1, m // p)
    least = {"1f1b": p, "dualpipev": 2 * p}.get(args.pp_schedule, 1)
    require(m >= least and (per_rank == 1 or "interleaved" not in args.pp_schedule or m % rounds == 0),
            f"--pp_microbatches {m} with --pp_schedule {args.pp_schedule} on {p} stage ranks: it needs >= {least}"
            + (f" and a multiple of {rounds} (m // p rounds)" if "interleaved" in args.pp_schedule else ""))  # fmt: skip


def cut(gpt: GPT, blocks: list[str], first: bool, last: bool) -> GPT:
    """A model of the GPT's class holding only `blocks` (the embeddings if `first`, the final norm and head if `last`)."""
    part = type(gpt).__new__(type(gpt))
    nn.Module.__init__(part)
    part.__dict__.update({name: value for name, value in vars(gpt).items() if not name.startswith("_")})
    for name, child in gpt.named_children():
        setattr(part, name, child)
    part.tok_emb = gpt.tok_emb if first else None
    if getattr(gpt, "pos_emb", None) is not None:
        part.pos_emb = gpt.pos_emb if first else None
    part.blocks = nn.ModuleDict({key: gpt.blocks[key] for key in blocks})
    part.ln_f, part.head = (gpt.ln_f, gpt.head) if last else (None, None)
    return part


def forget_inference_tokens(stages: list) -> None:
    """Before the first schedule step's first micro-batch: torch's pipelining first runs every stage's forward
    once, with gradients on, to learn the shapes it sends (PipelineStage's metadata inference; the first stage on
    the real first micro-batch, the others on torch.empty tensors). A mixture of experts counted those tokens
    for its balancing bias: one micro-batch too many, and on the later stages whatever the empty memory held
    (measured: 640 assignments counted in the first step of ep 2 x pp 2 against 512; the bias then moved by the
    garbage's counts, and 1 run in ~10 left the one-process reference at step 2). Forgotten here."""
    for stage in stages:
        forget_counts(stage)


class Pipeline:
    """What one rank of a pipeline holds and does. `model`: the rank's piece of the GPT (every stage it holds,
    under the GPT's names), for its optimizer, checkpoints and bytes; `stages`: one GPT per stage it holds
    (the same modules), what the schedule runs and the other dimensions are applied to."""

    def __init__(self, gpt: GPT, layout: Layout, rank: int, args, sent_dtype: torch.dtype = torch.float32,
                 traits=frozenset()):  # fmt: skip
        self.p, self.schedule_name, self.microbatches = layout.pp, args.pp_schedule, args.pp_microbatches
        self.layout, self.rank, self.traits = layout, rank, traits
        self.sent_dtype = (
            sent_dtype  # the residual stream's: bf16 under FSDP's bf16 policy (layout.stream_dtype)
        )
        self.pp_rank = layout.coordinate(rank, "pp")
        self.stage_ids = schedules.stages_of(self.pp_rank, self.p, self.schedule_name)
        self.n_stages = self.p * len(self.stage_ids)
        self.holds_first, self.holds_last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        self.unscaled = args.wrong_variant == "pp_unscaled_microbatch_gradients"
        # the tie split in two parameters (module docstring); the copy's optimizer state under the embedding's name
        self.tied = gpt.cfg.tie_weights
        if self.tied:
            gpt.head.weight = nn.Parameter(gpt.tok_emb.weight.detach().clone())
        self.aliases = {"head.weight": "tok_emb.weight"} if self.tied and self.holds_last else {}
        bounds = schedules.block_bounds(gpt.cfg.n_layer, self.n_stages, args.pp_fewer_blocks_at_ends)
        blocks_of = {s: [str(i) for i in range(bounds[s], bounds[s + 1])] for s in self.stage_ids}
        if args.wrong_variant == "pp_whole_model_on_every_rank":  # the mistake: nothing is cut away
            self.model = gpt
        else:
            mine = [b for s in sorted(self.stage_ids) for b in blocks_of[s]]
            self.model = cut(gpt, mine, self.holds_first, self.holds_last)
        self.stages = [cut(gpt, blocks_of[s], s == 0, s == self.n_stages - 1) for s in self.stage_ids]
        self.groups: dict = {}
        self.timeline: list[tuple[str, float, float]] = []  # this step's (kind, start, end) of every action
        self.step_timelines: list[list] = []
        self.schedule = None

    def holder(self, stage: int) -> int:
        return schedules.holder(stage, self.p, self.schedule_name)

    def sent_tokens(self, sequence: int) -> int:
        return schedules.stage_tokens(self.layout, self.rank, self.traits, sequence)

    def connect(self, layout: Layout, rank: int, pp_mesh, device, variant: str) -> None:
        """After the other dimensions are applied to the stages: the pipeline's group, the tied ends' groups,
        the PipelineStages and the schedule."""
        from torch.distributed import pipelining

        self.groups["pp"], self.device = pp_mesh.get_group(), device
        first, last = self.holder(0), self.holder(self.n_stages - 1)
        if self.tied and first != last and variant != "pp_tied_embedding_not_synced":
            # one group per pair of ends (every other coordinate equal); every rank makes every group (new_group)
            for end in range(layout.world_size // layout.pp):
                ends = [
                    end + first * (layout.world_size // layout.pp),
                    end + last * (layout.world_size // layout.pp),
                ]
                group = dist.new_group(ends)
                if rank in ends:
                    self.groups["tied"] = group
        name, per_rank, _ = schedules.SCHEDULES[self.schedule_name]
        stages = [
            pipelining.PipelineStage(stage, s, self.n_stages, device, group=self.groups["pp"])
            for stage, s in zip(self.stages, self.stage_ids, strict=True)
        ]
        for stage in stages:  # time each action of each stage, for the bubble (report)
            for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                                 ("backward_weight_one_chunk", "W")):  # fmt: skip
                setattr(stage, method, self._timed(getattr(stage, method), kind))
        # scale_grads=False: the schedule sums micro-batch gradients; after_backward divides each parameter once
        self.schedule = getattr(pipelining, name)(
            stages if per_rank > 1 else stages[0], self.microbatches, loss_fn=lm_loss, scale_grads=False
        )

    def _timed(self, action, kind: str):
        def timed(*args, **kwargs):
            if kind == "F" and not self.step_timelines and not self.timeline:
                forget_inference_tokens(self.stages)
            started = device_time(self.device)  # the device's time: a GPU's kernels, not their launches
            result = action(*args, **kwargs)
            self.timeline.append((kind, started, device_time(self.device)))
            return result

        return timed

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One schedule step over the batch: the mean of its micro-batch losses, on every stage-rank."""
        self.timeline = []
        losses: list = []
        # every action's time from this rank's own step start: one host's clock never compared with another's
        # (the ranks start a step together, lined up by the last step's loss broadcast over the pipeline)
        step_start = device_time(self.device)
        self.schedule.step(
            *([x] if self.holds_first else []),
            target=y if self.holds_last else None,
            losses=losses if self.holds_last else None,
            return_outputs=False,
        )
        self.step_timelines.append([(kind, s - step_start, e - step_start) for kind, s, e in self.timeline])
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=x.device)
        return self._from_last_stage(loss)

    def step_in_order(self, x: torch.Tensor, y: torch.Tensor, instruments) -> torch.Tensor:
        """The step as the one schedule model orders this rank's actions (pp_schedules.order), each run here: on fake
        tensors (experiments/at_scale.py), where torch's schedule cannot run (its warm-up reads values). One stage a
        rank (gpipe, 1f1b). The sends and receives are not made (no peer runs): each is `instruments.passed("pp")`,
        and each action a phase of its own (`instruments.watch`). FSDP is told which backward is the step's last."""
        stage, m, first, last = self.stages[0], self.microbatches, self.holds_first, self.holds_last
        xs, ys, in_flight, losses, done = x.chunk(m), y.chunk(m), [], [], 0
        for action in schedules.order(self.schedule_name, self.pp_rank, self.p, m):
            if not (
                first if action.kind == "F" else last
            ):  # the previous stage's output, or the next's gradient
                instruments.passed("pp")
            if action.kind == "F":
                with instruments.watch("forward"):
                    i = action.microbatch
                    shape = (xs[i].shape[0], self.sent_tokens(xs[i].shape[1]), stage.cfg.d_model)
                    out = stage(
                        xs[i] if first else torch.empty(*shape, dtype=self.sent_dtype, requires_grad=True)
                    )
                    in_flight.append(lm_loss(out, ys[i]) / m if last else out)
                losses += [in_flight[-1].detach()] if last else []
                if not last:
                    instruments.passed("pp")
                continue
            if isinstance(stage, FSDPModule):  # as the schedule tells FSDP (and replicate)
                stage.set_is_last_backward(done == m - 1)
                stage.set_reshard_after_backward(done == m - 1 or self.p == 1)
                stage.set_requires_gradient_sync(done == m - 1)
            with instruments.watch("backward"), torch.autocast(x.device.type, enabled=False):
                out = in_flight.pop(0)
                out.backward() if last else out.backward(torch.empty_like(out))
            done += 1
            if not first:
                instruments.passed("pp")
        return torch.stack(losses).sum() if losses else torch.zeros((), device=x.device)

    def _from_last_stage(self, loss: torch.Tensor) -> torch.Tensor:
        dist.broadcast(loss, group=self.groups["pp"], group_src=self.holder(self.n_stages - 1))  # for the log
        return loss

    def after_backward(self) -> None:
        """The summed micro-batch gradients divided by m; the tied embedding's summed between the ends."""
        grads = [p.grad for p in unique_tensors(self.model.parameters()) if p.grad is not None]
        if not self.unscaled:
            torch._foreach_div_([local(g) for g in grads], self.microbatches)
        if not self.tied:
            return
        if self.holds_first and self.holds_last:  # a V: both ends here
            embedding, head = self.model.tok_emb.weight.grad, self.model.head.weight.grad
            local(embedding).add_(local(head))
            local(head).copy_(local(embedding))
        elif "tied" in self.groups:
            end = self.model.tok_emb if self.holds_first else self.model.head
            dist.all_reduce(local(end.weight.grad), group=self.groups["tied"])

    def tied_copy(self) -> torch.nn.Parameter | None:
        """The head's copy of the tied embedding, which the gradient norm counts once (at the first stage)."""
        return self.model.head.weight if self.tied and self.holds_last else None

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The stages in order, one batch, no micro-batches (nothing to overlap), every stage-rank getting the
        loss."""
        group, loss, activation = self.groups["pp"], torch.zeros((), device=x.device), None
        for s in sorted(self.stage_ids):
            stage = self.stages[self.stage_ids.index(s)]
            if s and self.holder(s - 1) != self.pp_rank:
                shape = (x.shape[0], self.sent_tokens(x.shape[1]), self.model.cfg.d_model)
                activation = torch.empty(*shape, device=x.device, dtype=self.sent_dtype)
                dist.recv(activation, group=group, group_src=self.holder(s - 1))
            output = stage(x if s == 0 else activation)
            if s == self.n_stages - 1:
                loss = lm_loss(output, y)
            elif self.holder(s + 1) != self.pp_rank:
                dist.send(output.contiguous(), group=group, group_dst=self.holder(s + 1))
            activation = output
        return self._from_last_stage(loss)

    def report(self, session) -> None:
        """The bubble of every step after the one-time work, measured on the first pipeline's stage-ranks (1 -
        mean busy time / the step's span; each rank's times from its own step start, so ranks on other hosts
        compare), beside its theory; and the median step's timeline."""
        from common.profiling import pipeline_bubble

        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, (self.pp_rank, self.step_timelines))
        if not session.is_main:
            return
        first_pipeline = {}
        for pp_rank, timelines in every_rank:  # rank order: the first rank of each stage-rank is pipeline 0's
            first_pipeline.setdefault(pp_rank, timelines)
        labels = [f"stage-rank {r} (stages {', '.join(map(str, schedules.stages_of(r, self.p, self.schedule_name)))})"
                  for r in range(self.p)]  # fmt: skip
        theory = schedules.bubble_theory(self.schedule_name, self.p, self.microbatches)
        title = f"{self.schedule_name}: {self.p} stage-ranks x {self.n_stages // self.p} stage(s), m = {self.microbatches}"
        path = f"{session.output_dir}/pipeline_timeline.png"
        row = pipeline_bubble(
            [first_pipeline[r] for r in range(self.p)], labels, schedules.STEADY_FROM, title, path
        )
        if row is None:
            return
        row = {"schedule": self.schedule_name, "stage_ranks": self.p, "stages": self.n_stages,
               "microbatches": self.microbatches, **row, "theory_bubble": theory}  # fmt: skip
        session.metrics["pipeline"] = {**row, "timeline_png": path}
        session.log_table("pipeline_bubble", [row], path)
        session.print(
            f"pipeline {self.schedule_name}: bubble {row['measured_bubble']:.3f} measured (median of "
            f"{row['steps_measured']} steps), {'n/a' if theory is None else f'{theory:.3f}'} by theory; "
            f"{row['step_ms']:.1f} ms per step; {path}"
        )


# ------------------------------------------------------------------------------------------------ theory
def sent(t: Theory) -> list[Traffic]:
    """The rank's point-to-point bytes of one step: activations and their gradients across each of its stages'
    boundaries with another rank (m each way); the loss's broadcast; the tied gradient's all-reduce (this
    rank's piece of it at rest) if the ends are on two ranks."""
    layout, rank, args, work = t.layout, t.rank, t.args, t.work
    m, p, schedule = args.pp_microbatches, layout.pp, args.pp_schedule
    pp_rank = layout.coordinate(rank, "pp")
    stage_ids = schedules.stages_of(pp_rank, p, schedule)
    n_stages = p * len(stage_ids)
    element = stream_dtype(layout, work).itemsize
    activation = (
        (work.rows // m)
        * schedules.stage_tokens(layout, rank, t.plan.traits, work.tokens // work.rows // layout.cp)
        * work.model.d_model
        * element
    )
    boundaries = sum(
        (s > 0 and schedules.holder(s - 1, p, schedule) != pp_rank)
        + (s < n_stages - 1 and schedules.holder(s + 1, p, schedule) != pp_rank)
        for s in stage_ids
    )
    traffic = [
        Traffic(kind, boundaries * m * activation, 2, "pp", calls=boundaries * m) for kind in ("send", "recv")
    ]
    traffic.append(Traffic("broadcast", 4, p, "pp", calls=1, term="pp_step"))  # the loss, for the log
    first, last = schedules.holder(0, p, schedule), schedules.holder(n_stages - 1, p, schedule)
    if work.model.tie_weights and first != last and pp_rank in (first, last):
        tied = next(shape for name, shape in t.held if name in ("tok_emb.weight", "head.weight"))
        traffic.append(
            Traffic("all_reduce", t.rest_bytes("tok_emb.weight", tied), 2, "pp", calls=1, term="pp_step")
        )
    return [t for t in traffic if t.bytes]


class PipelineParallel(Piece, SplitsParameters, HooksTheStep, Measures, RunsTheStep):
    """Applied first: it cuts the GPT into the stages every other piece is then applied to, and connects them
    (the schedule) once they are; it runs each step itself (forward and backward in one schedule step)."""

    name = dim = "pp"
    any_model = True
    Flags = Flags
    MISTAKES = MISTAKES

    def traits(self, plan: Plan) -> set[str]:
        return {"pipeline"} | (
            {"backward_in_two_passes"} if plan.args.pp_schedule in schedules.SPLIT_BACKWARD else set()
        )

    def refuse(self, plan: Plan) -> None:
        refuse(plan)

    def apply(self, stages: list, ctx: Context) -> list:
        (gpt,) = stages
        pipeline = ctx.runtime[self.name] = Pipeline(gpt, ctx.layout, ctx.rank, ctx.args,
                                                     stream_dtype(ctx.layout, ctx.work), ctx.plan.traits)  # fmt: skip
        ctx.model = pipeline.model
        return list(pipeline.stages)

    def connect(self, ctx: Context) -> None:
        ctx.runtime[self.name].connect(
            ctx.layout, ctx.rank, ctx.mesh["pp"], ctx.device, ctx.args.wrong_variant
        )

    # theory: what a rank holds is its stages' (and the tied copy)
    def holds(self, name: str, t: Theory) -> bool:
        return self._holding(t).holds(name)

    def extra_held(self, t: Theory) -> list[tuple[str, list[int]]]:
        return [("head.weight", list(t.model.tok_emb.weight.shape))] if self._holding(t).tied_copy else []

    def sent(self, t: Theory) -> list[Traffic]:
        return sent(t)

    @staticmethod
    def _holding(t: Theory) -> schedules.Holding:
        # asked once per parameter name: computed once per theory (the planner's 70B on 512 GPUs spent 98 of
        # 115 s recomputing it, profiled)
        if "pp_holding" not in t.__dict__:
            t.__dict__["pp_holding"] = schedules.holding(
                t.layout, t.rank, t.args, t.model.cfg.n_layer, t.model.cfg.tie_weights
            )
        return t.__dict__["pp_holding"]

    # at run time
    def run_micro_batch(self, job, x, y):
        if is_fake(x):  # at scale (experiments/at_scale.py): the schedule model's order, run here
            return job.state(self).step_in_order(x, y, job.instruments)
        return job.state(self).step(x, y)

    def after_backward(self, job) -> None:
        job.state(self).after_backward()

    def clip_options(self, job) -> dict:
        pipeline = job.state(self)
        tied = pipeline.tied_copy()
        return {"across": pipeline.groups["pp"], "counted_elsewhere": [tied] if tied is not None else []}

    def evaluate(self, job, x, y):
        return job.state(self).evaluate(x, y)

    def steady_step(self, job) -> int:
        # a pipeline's first schedule step initialises it (a vote and the shapes sent once, measured: 179 bytes)
        return 2

    def report(self, job, session) -> None:
        job.state(self).report(session)

    def checkpoint_aliases(self, job) -> dict:
        return job.state(self).aliases


PIECE = PipelineParallel()
