"""--compile: torch.compile on each transformer block (Inductor; on CPU it writes C++ kernels and builds them with
the system's compiler), as torchtitan does: per block, not the whole model, so one compiled graph serves every
block of the same shape, the collectives tensor parallelism and FSDP2 put around and inside a block stay where
they are, and a pipeline stage compiles only the blocks it holds. Applied after activation checkpointing (the
checkpoint is compiled with the block) and before FSDP2 (whose hooks stay outside the compiled code). The
module keeps its names: `Module.compile()` compiles in place.

What it buys is measured, not assumed (benchmarks/compile_step.py, docs/performance.md): the first steps pay the
compile (tens of seconds on 2 cores), the later ones run Inductor's fused kernels instead of one PyTorch op at a
time, which is what DTensor's per-op dispatch costs tensor parallelism on CPU. Not a dimension of parallelism:
it changes no byte held or sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import flag, require
from strategies.piece import Context, Piece, Plan


@dataclass
class Flags:
    compile: bool = flag(False, "torch.compile each transformer block (Inductor: the first steps pay the compile, "
                         "tens of seconds; strategies/compile.py)")  # fmt: skip


def refuse(plan: Plan) -> None:
    if not plan.args.compile:
        return
    require("collectives_in_attention" not in plan.traits,
            "--compile with --cp: not built (context parallelism's attention is an autograd function of its own "
            "around all-gathers, which the compiler would break its graph at)")  # fmt: skip


def apply(model: torch.nn.Module) -> None:
    """Compile every block `model` (a stage) holds, in place."""
    for block in model.blocks.values():
        block.compile()


class Compile(Piece):
    """Not a dimension: no degree, no byte held or sent."""

    name = "compile"
    Flags = Flags

    def is_on(self, plan: Plan) -> bool:
        return plan.args.compile

    def traits(self, plan: Plan) -> set[str]:
        return {"compiled"}

    def refuse(self, plan: Plan) -> None:
        refuse(plan)

    def apply(self, stages: list, ctx: Context) -> list:
        for stage in stages:
            apply(stage)
        return stages


PIECE = Compile()
