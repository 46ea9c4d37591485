"""tp: tensor parallelism, Megatron-style, with DTensor's `parallelize_module` (as PyTorch's TP tutorial
plans it; its sequence parallelism with --sequence_parallel). Each rank holds 1/N of every block's heads and MLP units
and of the vocabulary, and every rank reads the SAME data:
  q/k/v and fc_in column-parallel  weight split by output rows: each rank computes its own heads /
                                   hidden units from the full (replicated) input, no communication;
  o_proj and fc_out row-parallel   weight split by input columns: each rank's product is a partial sum
                                   of the output, all-reduced (Megatron's "g") to the full one;
  attention / MLP input            marked Replicate once per sub-layer (PrepareModuleInput), so that in
                                   backward the partial input gradients of q, k and v add up first and
                                   are all-reduced ONCE (Megatron's "f"), not three times;
  tok_emb row-parallel, head column-parallel  the vocabulary split across ranks: each rank looks up its
                                   own rows (the output all-reduced) and computes its own logits
                                   (all-gathered). Both weights are split on dim 0, so the tied weight
                                   stays one tensor (re-tied after parallelizing).
LayerNorms and the position embedding are replicated: every rank computes them on the same data, and
their gradients come out equal everywhere. The sharded weights come from rank 0 of the mesh
(distribute_tensor's src_data_rank); the replicated ones are whatever each rank built, so every rank
must build the same model (seed_per_rank shows what happens otherwise).

Why PyTorch's API: Accelerate's TP path needs a transformers model (FIELD_NOTES). Refused: heads that do
not divide the TP degree (each rank must hold whole heads), bf16 (not built for TP here).

--sequence_parallel (Megatron's sequence parallelism): between the sub-layers each rank holds 1/N of the
tokens (the LayerNorms, the residual stream: SequenceParallel on a Shard(1) DTensor); entering attention or
the MLP the sequence is all-gathered, and the row-parallel outputs are reduce-scattered back to their
tokens' owners instead of all-reduced: the same bytes on the wire (an all-reduce is a reduce-scatter plus
an all-gather), the activations between the sub-layers 1/N. The LayerNorm weights' gradients then come out
as partial sums (each rank's own tokens): clipping sums them first (common/optim.py).

Theory per step, batch B x context T x width d, k micro-batches: all-reduce the activations (B T d x 4
bytes) 4 x n_layer + 2 times per micro-batch (the embedding's output, 2 per block in forward and 2 in
backward, the head's input gradient), and all-gather the logits (B T x vocabulary padded to a multiple
of N, x 4 bytes) once per micro-batch.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from common.config import require
from strategies.defaults import (  # noqa: F401  # fmt: skip (the interface)
    STEADY_STEP,
    backward,
    checkpointer,
    clip,
    forward,
    measure_held,
    measure_window,
    quiet,
    report,
    with_optimizer,
)
from strategies.layout import (
    Layout,
    communication,
    held,
    piece_shape,
    require_ranks,
    unique_parameters,
)

NAME = "tp"
SUMMARY = "tensor parallelism (Megatron-style, DTensor): 1/N of every matrix and of the vocabulary per rank"
RANKS = 2
CHECKPOINT_FORMAT = "dcp"  # PyTorch's distributed checkpoint: any layout reads it
AUTOCAST = False
WRONG_VARIANTS = (
    "local_grad_norm",
    "seed_per_rank",
    "row_parallel_without_all_reduce",
    "resume_without_optimizer_state",
    "resume_without_data_position",
)
OWN_WRONG_VARIANTS = {
    "row_parallel_without_all_reduce": "the row-parallel layers' partial sums used as if they were the output",
}

# Which dimension the plan splits, by parameter name (None: replicated), for the theory of bytes held.
SPLIT_DIM = {
    "attn.q_proj.weight": 0,
    "attn.q_proj.bias": 0,
    "attn.k_proj.weight": 0,
    "attn.v_proj.weight": 0,
    "attn.v_proj.bias": 0,
    "attn.o_proj.weight": 1,
    "mlp.fc_in.weight": 0,
    "mlp.fc_in.bias": 0,
    "mlp.fc_out.weight": 1,
    "tok_emb.weight": 0,
    "head.weight": 0,
}


def split_dim(name: str) -> int | None:
    return next((dim for suffix, dim in SPLIT_DIM.items() if name.endswith(suffix)), None)


def layout(world_size: int, dp_size: int = 0, tp_size: int = 0) -> Layout:
    require_ranks(NAME, world_size)
    require(
        dp_size in (0, 1),
        f"--strategy tp puts all {world_size} ranks in one tensor-parallel group, got --dp_size {dp_size}; "
        "for data parallelism across groups use --strategy fsdp_tp",
    )
    return Layout(world_size, 1, tp_size or world_size)


def refuse(cfg, layout: Layout) -> None:
    require(
        cfg.n_head % layout.tp == 0,
        f"--n_head {cfg.n_head} is not divisible by the tensor-parallel degree {layout.tp}: each rank must hold whole heads",
    )
    require(
        cfg.mixed_precision == "no",
        f"--mixed_precision {cfg.mixed_precision} with --strategy {cfg.strategy}: not built; use no",
    )


def apply(model, layout: Layout, accelerator, cfg):
    mesh = layout.mesh(accelerator.device.type)
    row_all_reduce = cfg.wrong_variant != "row_parallel_without_all_reduce"
    model = parallelize(model.to(accelerator.device), mesh["tp"], row_all_reduce, cfg.sequence_parallel)
    return with_optimizer(model, accelerator, cfg)


def parallelize(model, tp_mesh, row_all_reduce: bool = True, sequence_parallel: bool = False):
    """The plan above on `tp_mesh`. row_all_reduce=False leaves the row-parallel outputs as partial sums:
    the classic missing all-reduce (`row_parallel_without_all_reduce`). sequence_parallel: Megatron's
    sequence parallelism between the sub-layers (the module docstring)."""
    if sequence_parallel:
        return parallelize_sequence(model, tp_mesh)
    row_output = Replicate() if row_all_reduce else Partial()
    replicated_input = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    for block in model.blocks:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn": replicated_input,
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=row_output),
                "mlp": replicated_input,
                "mlp.fc_in": ColwiseParallel(),
                "mlp.fc_out": RowwiseParallel(output_layouts=row_output),
            },
        )
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if model.cfg.tie_weights:
        model.head.weight = model.tok_emb.weight
    return model


def held_bytes(model, layout: Layout, rank: int, cfg) -> dict:
    parameters = unique_parameters(model)
    params = sum(
        math.prod(piece_shape(p.shape, layout, rank, split_dim(name), dp_sharded=False)) * p.element_size()
        for name, p in parameters
    )
    return held(params, len(parameters))


def activation_traffic(model, layout: Layout, cfg) -> dict:
    """The tensor-parallel group's bytes per step (see the module docstring)."""
    k, tokens = cfg.gradient_accumulation_steps, cfg.per_rank_batch_size * cfg.block_size
    padded_vocab = math.ceil(model.cfg.vocab_size / layout.tp) * layout.tp
    # full activation checkpointing runs each block's forward again in backward, up to the attention output's
    # all-reduce (the MLP's output is needed by nothing backward uses: the recompute stops before it)
    recomputed = cfg.n_layer if cfg.activation_checkpointing == "full" else 0
    activation, logits = tokens * cfg.d_model * 4, k * tokens * padded_vocab * 4
    if cfg.sequence_parallel:
        # every sub-layer's all-reduce becomes its input's all-gather (forward; its reduce-scatter in backward)
        # and its output's reduce-scatter (forward; its all-gather in backward); the head's input is gathered
        # too, and the block-0 slice of the embeddings' sum gathers its gradient back
        return {
            "all_reduce": k * activation,  # the embedding's output, as tp
            "all_gather": k * (4 * cfg.n_layer + 2) * activation + logits,
            "reduce_scatter": k * (4 * cfg.n_layer + 1) * activation,
        }
    return {"all_reduce": k * (4 * cfg.n_layer + 2 + recomputed) * activation, "all_gather": logits}


def sent_bytes(model, layout: Layout, cfg) -> dict:
    return communication({}, activation_traffic(model, layout, cfg), layout)


def parallelize_sequence(model, tp_mesh):
    """tp's plan with Megatron's sequence parallelism: between the sub-layers (LayerNorms, residual adds)
    each rank holds 1/N of the tokens; entering attention or the MLP the sequence is all-gathered, and the
    row-parallel outputs are reduce-scattered to the tokens' owners instead of all-reduced."""
    sequence = Shard(1)
    gathered_input = PrepareModuleInput(
        input_layouts=(sequence,), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    for index, block in enumerate(model.blocks):
        plan = {
            "ln_1": SequenceParallel(),
            "attn": gathered_input,
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=sequence, use_local_output=False),
            "ln_2": SequenceParallel(),
            "mlp": gathered_input,
            "mlp.fc_in": ColwiseParallel(),
            "mlp.fc_out": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        }
        parallelize_module(block, tp_mesh, plan)
        if index == 0:  # the embeddings' sum enters whole: each rank keeps its own tokens (a slice, no send)
            parallelize_module(block, tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                  desired_input_layouts=(sequence,)))  # fmt: skip
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()),
        },
    )
    if model.cfg.tie_weights:
        model.head.weight = model.tok_emb.weight
    return model
