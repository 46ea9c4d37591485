"""Activation checkpointing: each block keeps less for its backward and runs part of its forward again.

A forward keeps tensors for the backward: a Linear its input, LayerNorm its input and statistics, GELU its
input, attention q, k, v and its output. Checkpointing a block keeps only what is needed to run it again:
  full       the block's input; backward runs the block's forward again (every matmul twice);
  selective  the block's input and the outputs of the expensive ops (matmuls, attention, tensor
             parallelism's collectives); backward recomputes only the cheap ones (LayerNorm, GELU,
             reshapes): torch's selective activation checkpointing.
Both are torch.utils.checkpoint, non-reentrant (the form FSDP2, DTensor and pipelining's backward work
with), wrapped around each block's own forward: the block keeps its names and the hooks other pieces put
on it (FSDP2's gathers run outside the checkpointed region, as with a wrapper module).

What it keeps is counted by common/activations.SavedActivations; benchmarks/activation_checkpointing.py
sets the counted bytes and FLOPs beside their theory. A dimension of its own in name only: it has no degree,
it changes no byte held or sent but tensor parallelism's recomputed all-reduce (tp.py's theory), and it
applies to every layout.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from common.activations import OutputsCounted, active_counter
from common.config import flag, require
from strategies.piece import Context, Piece, Plan, Recomputes, Theory

MODES = ("none", "full", "selective")
aten = torch.ops.aten
# the ops selective checkpointing saves the outputs of: matmuls and attention (CPU and GPU kernels)
SAVED_BY_SELECTIVE = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    # and what tensor parallelism's and expert parallelism's collectives return: recomputing them would send the
    # bytes again (ep's all-to-alls of the tokens' counts and rows, the rows' with their backward)
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
}


@dataclass
class Flags:
    activation_checkpointing: str = flag("none", "each block keeps only its input (full) or that and its matmul and "
                                         "attention outputs (selective) for backward, and recomputes the rest "
                                         "(strategies/activation_checkpointing.py)", choices=MODES)  # fmt: skip


def apply(model: torch.nn.Module, mode: str) -> None:
    """Wrap every block's forward (of this rank's model or stage) in a checkpoint of `mode`."""
    if mode == "none":
        return
    for block in model.blocks.values():
        block.forward = functools.partial(run_checkpointed, block.forward, mode=mode)


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def run_checkpointed(function, x: torch.Tensor, *args, mode: str, **kwargs) -> torch.Tensor:
    """function(x, ...) (a block's forward; a transformers layer's takes its mask and rotary embedding too) under
    activation checkpointing `mode`."""
    if not torch.is_grad_enabled():
        return function(x, *args, **kwargs)
    counter = active_counter()
    if counter is not None:
        counter.add(x)  # the checkpoint keeps its input, to run the block again
    if (
        mode == "full"
    ):  # (no context_fn at all: torch.compile traces a checkpoint given one only if it is torch's)
        return checkpoint(function, x, *args, use_reentrant=False, **kwargs)
    if counter is None:  # torch's own selective contexts, which torch.compile knows
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    else:
        context_fn = functools.partial(_selective_contexts, counter)
    return checkpoint(function, x, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _selective_contexts(counter):
    """torch's selective contexts; while counting, the forward's also sees what the policy saves as it is made."""
    forward, recompute = create_selective_checkpoint_contexts(_selective_policy)
    if counter is None:
        return forward, recompute
    stack = contextlib.ExitStack()
    stack.enter_context(OutputsCounted(SAVED_BY_SELECTIVE, counter))
    stack.enter_context(forward)
    return stack, recompute


class ActivationCheckpointing(Piece, Recomputes):
    """No degree, no byte held or sent of its own: it makes tensor parallelism's recomputed blocks send again."""

    name = "activation_checkpointing"
    any_model = True
    Flags = Flags

    def is_on(self, plan: Plan) -> bool:
        return plan.args.activation_checkpointing != "none"

    def traits(self, plan: Plan) -> set[str]:
        mode = plan.args.activation_checkpointing
        return {"recomputes", "recomputes_blocks" if mode == "full" else "recomputes_ops"}

    def refuse(self, plan: Plan) -> None:
        mode = plan.args.activation_checkpointing
        require(not (mode == "selective" and "backward_in_two_passes" in plan.traits),
                "--activation_checkpointing selective with a zero-bubble --pp_schedule: it runs each backward in two "
                "passes (input, then weight gradients) and torch's selective checkpoint allows one; use full, or "
                "1f1b / gpipe / interleaved_1f1b")  # fmt: skip
        require(
            not (mode != "none" and "collectives_in_attention" in plan.traits),
            "--activation_checkpointing with --cp: not built (the recompute would all-gather K and V again)",
        )

    def apply(self, stages: list, ctx: Context) -> list:
        for stage in stages:
            apply(stage, ctx.args.activation_checkpointing)
        return stages

    def recomputed_blocks(self, t: Theory) -> int:
        return t.blocks if t.args.activation_checkpointing == "full" else 0


PIECE = ActivationCheckpointing()
