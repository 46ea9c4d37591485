"""The one interface every piece of parallelism implements, the capabilities some declare, and the three context
objects they are handed.

A piece is one module (tp.py, shard.py, ...) holding one `Piece` subclass: everything the rest of the project asks
of a dimension, asked the same way of every dimension. Shared code (the flags, the refusals, parallelize, the
theory, the Job, the planner) loops over the registry's pieces (strategies/registry.py) and never tests which piece
it holds. The core, which every piece considers (`Plan`: the flags, the layout, the workload; pure arithmetic, any
world size):
    Flags, MISTAKES        its flags (a dataclass folded into the CLI) and its deliberate mistakes
    is_on(plan)            whether it runs under this plan (its degree > 1, its flag set)
    traits(plan)           what it makes of the run that another piece may refuse (say, a backward in two passes),
                           by the trait's name: the pieces never name each other
    refuse(plan)           one line (UsageError) for what it cannot do
    apply(stages, ctx)     applied (`Context`: the plan, this rank, its mesh, device and Accelerator, and what the
                           earlier pieces left) to every stage, in the registry's order
    sent(t)                its collectives of one step for one rank, by theory (`Theory`: the undistributed GPT,
                           the plan and one rank; no process group, any rank of any world)
What only some pieces do is a capability, a class the piece also subclasses; shared code asks only the pieces that
declare it (`having(pieces, Capability)`):
    SplitsParameters  how it splits a parameter by theory (holds, extra_held, local_shape, claims_name,
                      rest_shape, window_bytes) and which it splits itself at run time (claims): pp, tp, ep, shard
    Recomputes        blocks whose forward runs again in backward: activation checkpointing
    HooksTheStep      its work inside the Job's step (split_batch, before_micro_batch, loss_for_backward,
                      after_backward, before_clip, after_evaluate, steady_step): cp, ep, pp, replicate, shard, tp
    Measures          what it measures (report, step_figures, theory_inputs, and assumed_inputs: what those would
                      hold on a run that has not run): cp, ep, ft, pp
    RunsTheStep       a step runner (connect, run_micro_batch, evaluate, clip_options, checkpoint_aliases): pp
    GatesSteps        whether a step counts and this rank's share of it: ft

docs/train_gpt.md ("How a new piece plugs in") walks through one: tests/test_one_module.py's toy piece.
"""

from __future__ import annotations

import math
import weakref
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

    @cached_property
    def launches(self) -> int:
        """The launches that share each global batch: a fault-tolerant run's replica groups (GatesSteps), else 1."""
        return math.prod(piece.launches(self) for piece in self.on if isinstance(piece, GatesSteps))


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
        return {p for piece in having(self.plan.on, SplitsParameters) for p in piece.claims(stage, self)}


_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def parameter_shapes(model) -> list[tuple[str, torch.Size]]:
    """(name, shape) of each parameter of a theory's undistributed model, a tied one once, read once per model: the
    planner makes a theory for every rank of every layout it weighs (5,033 walks of a 48-layer model's modules
    took 14 of tools.plan's 22 s, profiled)."""
    if model not in _SHAPES:
        _SHAPES[model] = [(name, p.shape) for name, p in unique_parameters(model)]
    return _SHAPES[model]


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
        pieces = having(self.plan.on, SplitsParameters)
        names = [
            (n, shape) for n, shape in parameter_shapes(self.model) if all(x.holds(n, self) for x in pieces)
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
        return any(piece.claims_name(name, self) for piece in having(self.plan.on, SplitsParameters))

    @cached_property
    def unclaimed(self) -> list[tuple[str, list[int]]]:
        """What the data-parallel pieces shard or replicate: all but what a piece splits itself."""
        return [(name, shape) for name, shape in self.held if not self.claimed(name)]

    def rest_shape(self, name: str, shape) -> list[int]:
        """The piece of a held parameter the rank keeps at rest (after data parallelism's sharding)."""
        shape = list(shape)
        for piece in having(self.plan.on, SplitsParameters):
            shape = piece.rest_shape(name, shape, self)
        return shape

    def rest_bytes(self, name: str, shape) -> int:
        return math.prod(self.rest_shape(name, shape)) * 4

    def window_bytes(self, name: str, shape) -> int:
        """Bytes of a held parameter between a micro-batch's forward and its backward: the first piece's that
        says (a gathered copy), else at rest."""
        for piece in having(self.plan.on, SplitsParameters):
            size = piece.window_bytes(name, shape, self)
            if size is not None:
                return size
        return self.rest_bytes(name, shape)

    @cached_property
    def recomputed_blocks(self) -> int:
        """Blocks whose forward runs again in backward (their collectives sent again)."""
        return sum(piece.recomputed_blocks(self) for piece in having(self.plan.on, Recomputes))

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
        whole_step = bool(having(self.plan.on, RunsTheStep))
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
    """A dimension of parallelism, or a feature that applies to any layout: the core every piece implements.
    Subclasses set `name` (its degree's name where it has one: `dim`), `Flags` and `MISTAKES`; what only some
    pieces do is a capability they declare by also subclassing it (below)."""

    name: str = ""
    dim: str | None = None  # its degree in strategies/layout.py, if it has one
    Flags: type = NoFlags
    MISTAKES: dict = {}
    # whether it works on any model made of blocks under the GPT's names (a transformers model, common/hf_model.py),
    # not only on the project's GPT, whose modules it knows by name
    any_model: bool = False

    def is_on(self, plan: Plan) -> bool:
        """Whether it runs under this plan (default: its degree > 1)."""
        return self.dim is not None and getattr(plan.layout, self.dim) > 1

    def traits(self, plan: Plan) -> set[str]:
        """What it makes of the run that another piece may refuse to run with, by the trait's name."""
        return set()

    def refuse(self, plan: Plan) -> None:
        """One line (UsageError) for what it cannot do, before anything starts."""

    def apply(self, stages: list, ctx: Context) -> list:
        """Applied to every stage (a GPT, or a pipeline's part of one), in the registry's order."""
        return stages

    def sent(self, t: Theory) -> list[Traffic]:
        """Its collectives of one step for the rank `t` describes (its closed form)."""
        return []


def having(pieces, capability: type) -> list:
    """The pieces that declare `capability`."""
    return [piece for piece in pieces if isinstance(piece, capability)]


# ------------------------------------------------------------------------------------------------ capabilities
class SplitsParameters:
    """How it splits a parameter, by theory (each method handed one rank's `Theory`), and which parameters it splits
    itself at run time (which the data-parallel pieces then leave alone)."""

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

    def claims(self, stage, ctx: Context) -> list:
        return []


class Recomputes:
    """It runs some blocks' forward again in backward (their collectives sent again)."""

    def recomputed_blocks(self, t: Theory) -> int:
        return 0


class HooksTheStep:
    """Its work inside the Job's step (strategies/job.py), each hook handed the Job (`job.state(self)`: what
    `apply` kept): the batch's split, before each micro-batch, the loss backward starts from, after backward (in
    reverse order: backward unwinds the forward), before the clipping, after an evaluation, and the first step free
    of its one-time work (its collectives are then counted)."""

    def split_batch(self, job, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return x, y

    def before_micro_batch(self, job) -> None:
        pass

    def loss_for_backward(self, job, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from (a loss scale, say); the loss reported stays the model's."""
        return loss

    def after_backward(self, job) -> None:
        pass

    def before_clip(self, job) -> None:
        pass

    def after_evaluate(self, job) -> None:
        pass

    def steady_step(self, job) -> int:
        return 1


class Measures:
    """What it measures beyond the checks: at the end (`report`), each step's logged figures, and what the last
    forward recorded that its closed form takes as input ({key: [records]})."""

    def report(self, job, session) -> None:
        pass

    def step_figures(self, job) -> dict:
        return {}

    def theory_inputs(self, job) -> dict:
        return {}

    def assumed_inputs(self, t: Theory) -> dict:
        """What `theory_inputs` would hold on a rank of a run that has not run (`t`), as its closed form assumes."""
        return {}


class RunsTheStep:
    """It runs each micro-batch's forward and backward itself, as one (a pipeline's schedule): connected once every
    piece is applied, it runs a micro-batch and an evaluation, says how the norm is summed (common/optim.
    clip_by_global_norm's `across` and `counted_elsewhere`) and which names a checkpoint keeps once; its ranks hold
    different parameters (its coordinates' first ranks each gather their own for a checkpoint)."""

    def connect(self, ctx: Context) -> None:
        pass

    def run_micro_batch(self, job, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, job, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def clip_options(self, job) -> dict:
        return {}

    def checkpoint_aliases(self, job) -> dict:
        return {}


class GatesSteps:
    """It says whether a step counts (fault tolerance: torchft's should_commit) and which share of it this rank
    trains; its run-time state (`job.state(self)`) is asked by the Job (strategies/ft.py). A run under it may be
    another algorithm than one process's: `unlike_one_process` says why ('' where it is not)."""

    def unlike_one_process(self, plan: Plan) -> str:
        return ""

    def launches(self, plan: Plan) -> int:
        """The launches (this one included) that share each global batch."""
        return 1
