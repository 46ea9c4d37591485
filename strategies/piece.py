"""The one interface every piece of parallelism implements, and the three context objects it is handed.

A piece is one module (tp.py, shard.py, ...) holding one `Piece` subclass: everything the rest of the project
asks of a dimension, asked the same way of every dimension. Shared code (the flags, the refusals, parallelize,
the theory, the Job, the planner) loops over the registry's pieces (strategies/registry.py) and calls these
methods; it never tests which piece it holds. A method a piece does not need keeps its default here (nothing
to refuse, nothing sent, no hook), so a piece says only what it does:

  before anything starts (`Plan`: the flags, the layout, the workload; pure arithmetic, any world size)
    Flags, MISTAKES        its flags (a dataclass folded into the CLI) and its deliberate mistakes
    is_on(plan)            whether it runs under this plan (its degree > 1, its flag set)
    traits(plan)           what it makes of the run that another piece may refuse to run with (say, a
                           backward in two passes), by the trait's name: the pieces never name each other
    refuse(plan)           one line (UsageError) for what it cannot do
  applied (`Context`: the above and this rank, its mesh, device and Accelerator, and what the earlier pieces
  left: the stages, the parameters a piece claimed, each piece's run-time state)
    apply(stages, ctx)     to every stage (a GPT, or a pipeline's part of one), in the registry's order
    claims(stage)          parameters it splits itself, which the data-parallel pieces leave alone
    connect(ctx)           once every piece is applied
  by theory (`Theory`: the undistributed GPT, the plan and one rank; no process group, any rank of any world)
    holds / extra_held / local_shape / claims_name / rest_shape / window_bytes / recomputed_blocks / sent
  at run time (the Job's hooks; `job.state(self)` is what apply kept)
    split_batch, before_micro_batch, run_micro_batch, loss_for_backward, after_backward (in reverse order:
    backward unwinds the forward), before_clip, clip_options, evaluate, after_evaluate, steady_step, report, step_figures,
    theory_inputs, checkpoint_aliases

docs/train_gpt.md ("How a new piece plugs in") walks through one: tests/test_one_module.py's toy piece.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from strategies.layout import Layout, Traffic, Workload, unique_parameters


@dataclass(frozen=True)
class Plan:
    """What a run asks, before anything starts: its flags (every piece's), the degrees, the workload, and the
    engine that replaces the pieces if any (DeepSpeed's ZeRO stage, None without it)."""

    args: object
    layout: Layout
    work: Workload
    engine_stage: int | None = None
    pieces: tuple = ()  # the registry's, in order

    @cached_property
    def on(self) -> tuple:
        """The pieces that run under this plan (none under an engine: it replaces them)."""
        return () if self.engine_stage else tuple(p for p in self.pieces if p.is_on(self))

    @cached_property
    def traits(self) -> frozenset[str]:
        return frozenset(t for piece in self.on for t in piece.traits(self))


@dataclass
class Context:
    """What a piece is applied with: the plan, this rank, its mesh (None on one process), device and
    Accelerator, and what the pieces before it did."""

    plan: Plan
    rank: int
    mesh: object
    device: torch.device
    accelerator: object
    stages: list = field(default_factory=list)  # what runs: the model, or a pipeline's stages
    model: torch.nn.Module | None = None  # what the rank holds as one module (None: stages[0])
    runtime: dict = field(default_factory=dict)  # each piece's run-time state, by its name

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def args(self):
        return self.plan.args

    @property
    def work(self) -> Workload:
        return self.plan.work

    def claimed(self, stage) -> set:
        """The parameters of `stage` a piece splits itself (the data-parallel pieces leave them alone)."""
        return {p for piece in self.plan.on for p in piece.claims(stage, self)}


class Theory:
    """One rank of a plan, by theory: what it holds (each parameter's piece, composed over every piece's
    `holds`, `extra_held`, `local_shape`, `rest_shape`) and what it sends (every piece's `sent`). `model`: the
    undistributed GPT (float32; its shapes), `counted`: what the rank recorded in the step that a piece's
    closed form takes as input (an MoE's routing)."""

    def __init__(self, model, plan: Plan, rank: int, counted: dict | None = None):
        self.model, self.plan, self.rank, self.counted = model, plan, rank, counted or {}
        self.layout, self.args, self.work = plan.layout, plan.args, plan.work

    @cached_property
    def held(self) -> list[tuple[str, list[int]]]:
        """(name, shape of the rank's piece before data parallelism) of every parameter the rank holds."""
        pieces = self.plan.on
        names = [
            (n, p.shape) for n, p in unique_parameters(self.model) if all(x.holds(n, self) for x in pieces)
        ]
        names += [extra for piece in pieces for extra in piece.extra_held(self)]
        held = []
        for name, shape in names:
            shape = list(shape)
            for piece in pieces:
                shape = piece.local_shape(name, shape, self)
            held.append((name, shape))
        return held

    @cached_property
    def blocks(self) -> int:
        return len({name.split(".")[1] for name, _ in self.held if name.startswith("blocks.")})

    @cached_property
    def first(self) -> bool:
        """Whether the rank holds the embeddings (runs the model's start)."""
        return any(name.startswith("tok_emb.") for name, _ in self.held)

    @cached_property
    def last(self) -> bool:
        """Whether the rank holds the final norm and head (computes the loss)."""
        return any(name.startswith(("ln_f.", "head.")) for name, _ in self.held)

    def claimed(self, name: str) -> bool:
        return any(piece.claims_name(name, self) for piece in self.plan.on)

    @cached_property
    def unclaimed(self) -> list[tuple[str, list[int]]]:
        """What the data-parallel pieces shard or replicate: all but what a piece splits itself."""
        return [(name, shape) for name, shape in self.held if not self.claimed(name)]

    def rest_shape(self, name: str, shape) -> list[int]:
        """The piece of a held parameter the rank keeps at rest (after data parallelism's sharding)."""
        shape = list(shape)
        for piece in self.plan.on:
            shape = piece.rest_shape(name, shape, self)
        return shape

    def rest_bytes(self, name: str, shape) -> int:
        return math.prod(self.rest_shape(name, shape)) * 4

    def window_bytes(self, name: str, shape) -> int:
        """Bytes of a held parameter between a micro-batch's forward and its backward: the first piece's that
        says (a gathered copy), else at rest."""
        for piece in self.plan.on:
            size = piece.window_bytes(name, shape, self)
            if size is not None:
                return size
        return self.rest_bytes(name, shape)

    @cached_property
    def recomputed_blocks(self) -> int:
        """Blocks whose forward runs again in backward (their collectives sent again)."""
        return sum(piece.recomputed_blocks(self) for piece in self.plan.on)

    @cached_property
    def traffic(self) -> list[Traffic]:
        """Every piece's collectives of one step for this rank."""
        return [t for piece in self.plan.on for t in piece.sent(self)]

    def held_bytes(self) -> dict:
        """The rank's bytes: each parameter's piece at rest, its gradient the same, AdamW's two moments the
        same plus a 4-byte step count per tensor; between forward and backward what each is then held as."""
        params = sum(self.rest_bytes(name, shape) for name, shape in self.held)
        # a piece that runs forward and backward as one step (a pipeline) leaves nothing between them to see
        # from outside: a run measures it at rest (experiments/at_scale.py sees inside: gathered_bytes)
        whole_step = any(piece.runs_whole_step for piece in self.plan.on)
        return {
            "params": params,
            "grads": params,
            "optimizer": 2 * params + 4 * len(self.held),
            "params_between_forward_and_backward": params if whole_step else self.gathered_bytes(),
        }

    def gathered_bytes(self) -> int:
        """Parameter bytes held while a micro-batch's forward and backward run (FSDP's gathered copies)."""
        return sum(self.window_bytes(name, shape) for name, shape in self.held)

    def sent_bytes(self) -> dict:
        """One step's bytes by kind (what common/comm_counter.py counts: each call's whole tensor) and by the
        dimension that sends them, and what the rank puts on the wire."""
        return summed(self.traffic)


def summed(traffic: list[Traffic]) -> dict:
    by_kind, by_dimension = {}, {}
    for t in traffic:
        by_kind[t.kind] = by_kind.get(t.kind, 0) + t.bytes
        by_dimension.setdefault(t.by, {})[t.kind] = by_dimension.get(t.by, {}).get(t.kind, 0) + t.bytes
    return {
        "by_kind": by_kind,
        "by_dimension": by_dimension,
        "wire_bytes": sum(t.wire_bytes for t in traffic),
    }


@dataclass
class NoFlags:
    """The flags of a piece that has none."""


class Piece:
    """A dimension of parallelism, or a feature that applies to any layout (the module docstring lists what
    each method is for). Subclasses set `name` (its degree's name where it has one: `dim`) and `Flags`."""

    name: str = ""
    dim: str | None = None  # its degree in strategies/layout.py, if it has one
    Flags: type = NoFlags
    MISTAKES: dict = {}
    # whether its ranks hold different parameters (not pieces of the same ones): each of its coordinates'
    # first rank gathers its own for a checkpoint
    holds_apart: bool = False
    runs_whole_step: bool = False  # whether its run_micro_batch runs forward and backward as one

    # ------------------------------------------------------------------------ before anything starts
    def is_on(self, plan: Plan) -> bool:
        return self.dim is not None and getattr(plan.layout, self.dim) > 1

    def traits(self, plan: Plan) -> set[str]:
        return set()

    def refuse(self, plan: Plan) -> None:
        pass

    # ---------------------------------------------------------------------------------------- applied
    def apply(self, stages: list, ctx: Context) -> list:
        return stages

    def claims(self, stage, ctx: Context) -> list:
        return []

    def connect(self, ctx: Context) -> None:
        pass

    # ----------------------------------------------------------------------------------------- theory
    def holds(self, name: str, t: Theory) -> bool:
        return True

    def extra_held(self, t: Theory) -> list[tuple[str, list[int]]]:
        return []

    def local_shape(self, name: str, shape: list[int], t: Theory) -> list[int]:
        return shape

    def claims_name(self, name: str, t: Theory) -> bool:
        return False

    def rest_shape(self, name: str, shape: list[int], t: Theory) -> list[int]:
        return shape

    def window_bytes(self, name: str, shape: list[int], t: Theory) -> int | None:
        return None

    def recomputed_blocks(self, t: Theory) -> int:
        return 0

    def sent(self, t: Theory) -> list[Traffic]:
        return []

    # ------------------------------------------------------------------------------ at run time (Job)
    def split_batch(self, job, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return x, y

    def before_micro_batch(self, job) -> None:
        pass

    def run_micro_batch(self, job, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The micro-batch's loss if this piece runs it itself (forward and backward), else None."""
        return None

    def loss_for_backward(self, job, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from (a loss scale, say); the loss reported stays the model's."""
        return loss

    def after_backward(self, job) -> None:
        pass

    def before_clip(self, job) -> None:
        pass

    def clip_options(self, job) -> dict:
        """common/optim.clip_by_global_norm's `across` (a group the norm is summed over) and
        `counted_elsewhere` (parameters another rank counts)."""
        return {}

    def evaluate(self, job, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        return None

    def after_evaluate(self, job) -> None:
        pass

    def steady_step(self, job) -> int:
        """The first step free of this piece's one-time work (its collectives are then counted)."""
        return 1

    def report(self, job, session) -> None:
        pass

    def step_figures(self, job) -> dict:
        return {}

    def theory_inputs(self, job) -> dict:
        """What the last forward recorded that this piece's closed form takes as input, {key: [records]}."""
        return {}

    def checkpoint_aliases(self, job) -> dict:
        return {}
