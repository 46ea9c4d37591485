"""tp: tensor parallelism, Megatron-style, with DTensor's `parallelize_module` (as PyTorch's TP tutorial
plans it; its sequence parallelism with --sequence_parallel). Each rank of a tensor-parallel group holds 1/N
of every block's heads and MLP units and of the vocabulary, and every rank of the group reads the SAME data:
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
A mixture-of-experts MLP (common/moe.py) is left whole, as the LayerNorms are: every tp rank routes the same
tokens through the same experts (which expert parallelism may split over the data-parallel ranks: the
experts over data-parallel ranks inside each tp group, Megatron's expert tensor-parallel size 1); its block
sends one all-reduce in forward and one in backward, the attention's. The experts are computed tp times over:
splitting them over tp too (torchtitan's etp = tp, or ep over tp with sequence parallelism) is not built.
LayerNorms and the position embedding are replicated: every rank computes them on the same data, and
their gradients come out equal everywhere. The sharded weights come from rank 0 of the group
(distribute_tensor's src_data_rank); the replicated ones are whatever each rank built, so every rank
must build the same model (seed_per_rank shows what happens otherwise).

Why PyTorch's API: Accelerate's TP path needs a transformers model (its tp_plan). Refused: heads that do
not divide the degree (each rank must hold whole heads).

A model that carries its own plan (a transformers model, --hf_config: its config's base_model_tp_plan, as
transformers and Accelerate apply it) is split by that plan as written, module by module: a "colwise" Linear's
weight (and bias) on its output dimension, its input's gradient all-reduced in backward (one all-reduce per
colwise module: q, k and v three, where the plan above sends one); a "rowwise" Linear's weight on its input
dimension, its output all-reduced in forward; "colwise_gather_output" (the head) its logits all-gathered; a head
tied to the embedding splits the embedding alike (its output all-reduced), which the plan does not say. The theory
reads the same plan and the model's own Linears (their widths), so it holds for any model the plan covers.

--sequence_parallel (Megatron's sequence parallelism): between the sub-layers each rank holds 1/N of the
tokens (the LayerNorms, the residual stream: SequenceParallel on a Shard(1) DTensor); entering attention or
the MLP the sequence is all-gathered, and the row-parallel outputs are reduce-scattered back to their
tokens' owners instead of all-reduced: the same bytes on the wire (an all-reduce is a reduce-scatter plus
an all-gather), the activations between the sub-layers 1/N. The LayerNorm weights' gradients then come out
as partial sums (each rank's own tokens): clipping sums them first (common/optim.py); under FSDP (or
replicate) FSDP all-reduces them over tp, once per step, before its own reduction.

Theory per step of a rank holding L blocks (its pipeline stage's, or all), t tokens per micro-batch (its
share of the batch and, under context parallelism, of the sequence), width d, k micro-batches: all-reduce
the activations (t d x 4 bytes) 4 L times per micro-batch (2 per block in forward, 2 in backward), once
more for the embedding's output if it holds the embedding and once for the head's input gradient if it
holds the head; all-gather the logits (t x the vocabulary padded to a multiple of N, x 4 bytes) if it holds
the head. Under --mixed_precision bf16 each tensor in its own dtype: with autocast alone (no dp_shard) the
matmuls' outputs are bf16 (the row-parallel outputs, the logits, their gradients) while the residual stream
stays float32 (the embedding's output, the norms' outputs and their gradients); under FSDP's bf16 policy
(dp_shard) the parameters are bf16 copies and everything sent is bf16.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from common.config import flag, require
from strategies.layout import Layout, Mistake, Traffic, chunk_rows, stream_dtype
from strategies.piece import Context, HooksTheStep, Piece, Plan, SplitsParameters, Theory

RECOMPUTES_BLOCKS = "recomputes_blocks"  # a trait: some piece runs each block's forward again in backward

MISTAKES = {  # each: what it is, and the runs under which it is one
    "row_parallel_without_all_reduce": Mistake.of(
        "tp", "the row-parallel layers' partial sums used as if they were the output"
    ),
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
    "mlp.fc_gate.weight": 0,
    "mlp.fc_gate.bias": 0,
    "mlp.fc_out.weight": 1,
    "tok_emb.weight": 0,
    "head.weight": 0,
}


@dataclass
class Flags:
    tp: int = flag(
        0, "tensor-parallel degree: ranks that split every matrix and read the same data (0, 1: off)"
    )
    sequence_parallel: bool = flag(False, "with --tp: Megatron's sequence parallelism: LayerNorms and residuals on "
                                   "1/N of the tokens, all-reduces replaced by reduce-scatter + all-gather")  # fmt: skip


def model_plan(work) -> dict[str, str] | None:
    """The plan the model carries (a transformers model's, under the GPT's names: module pattern -> style), or None
    for the project's GPT, which the plan of the module docstring splits."""
    if not work.model.hf:
        return None
    from common.hf_model import tp_plan

    own = tp_plan(work.model)
    # a tied head shares its weight with the embedding: split the embedding's vocabulary as the plan splits the head's
    # (the GPT's plan does the same), so the two stay one tensor
    tied = work.model.tie_weights and "head" in own
    return {**own, "tok_emb": EMBEDDING_STYLE} if tied else own


def refuse(plan: Plan) -> None:
    args, layout, work = plan.args, plan.layout, plan.work
    require(
        not args.sequence_parallel or layout.tp > 1, "--sequence_parallel is tensor parallelism's: add --tp N"
    )
    if layout.tp == 1:
        return
    own = model_plan(work)
    if own is not None:  # what is built of a model's own plan
        unbuilt = [
            f"{style} ({pattern})"
            for pattern, style in own.items()
            if style not in (*MODEL_STYLES, EMBEDDING_STYLE)
        ]
        require(not unbuilt, f"--tp {layout.tp}: the model's tensor-parallel plan asks {', '.join(unbuilt)}: not built "
                f"here (built: {', '.join(MODEL_STYLES)})")  # fmt: skip
        require(not args.sequence_parallel and RECOMPUTES_BLOCKS not in plan.traits, f"--tp {layout.tp} with the "
                "model's own plan: --sequence_parallel and --activation_checkpointing full are not built for it")  # fmt: skip
    heads = f"--n_head {work.model.n_head}" + (
        f" and --n_kv_head {work.model.n_kv_head}" if work.model.n_kv_head else ""
    )
    require(work.model.n_head % layout.tp == 0 and work.model.kv_heads % layout.tp == 0,
            f"{heads} must be divisible by --tp {layout.tp}: each rank must hold whole heads")  # fmt: skip
    require(not args.sequence_parallel or layout.cp == 1,
            "--sequence_parallel with --cp: not built (context parallelism would gather a sequence already split "
            "over the tensor-parallel ranks)")  # fmt: skip
    require(not (args.sequence_parallel and work.model.n_experts),
            "--sequence_parallel with --n_experts: not built (the experts would route 1/N of the tokens on each "
            "tensor-parallel rank: expert parallelism over tp, torchtitan's etp 1)")  # fmt: skip
    require(not (args.sequence_parallel and RECOMPUTES_BLOCKS in plan.traits),
            "--sequence_parallel with --activation_checkpointing full: not built (its recompute would gather "
            "the sequence again); use selective")  # fmt: skip


def split_dim(name: str, own: dict | None = None) -> int | None:
    """The dimension of parameter `name` the plan splits (None: replicated): the GPT's, or the model's `own`."""
    if own is None:
        return next((dim for suffix, dim in SPLIT_DIM.items() if name.endswith(suffix)), None)
    module, kind = name.rsplit(".", 1)
    style = style_of(module, own)
    if style is None:
        return None
    return 0 if style.startswith("colwise") or style == EMBEDDING_STYLE else 1 if kind == "weight" else None


def style_of(module: str, own: dict) -> str | None:
    return next((style for pattern, style in own.items() if fnmatch.fnmatchcase(module, pattern)), None)


def local_shape(name: str, shape, layout: Layout, rank: int, own: dict | None = None) -> list[int]:
    """The shape of the piece of parameter `name` a rank holds after tensor parallelism (torch.chunk's split)."""
    shape, dim = list(shape), split_dim(name, own)
    if dim is not None:
        shape[dim] = chunk_rows(shape[dim], layout.tp, layout.coordinate(rank, "tp"))
    return shape


def apply(model, tp_mesh, args, own: dict | None = None) -> None:
    """The plan of the module docstring on `tp_mesh` (or the model's `own`), for the blocks, embedding and head
    `model` holds (a pipeline stage holds some). row_parallel_without_all_reduce leaves the row-parallel outputs
    as partial sums: the classic missing all-reduce."""
    row_output = Partial() if args.wrong_variant == "row_parallel_without_all_reduce" else Replicate()
    if own is not None:
        return apply_model_plan(model, tp_mesh, own, row_output)
    if args.sequence_parallel:
        return apply_sequence_parallel(model, tp_mesh)
    replicated_input = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    for block in model.blocks.values():
        # a mixture of experts is left whole on every tp rank (the module docstring)
        mlp = {} if not is_dense(block.mlp) else {
            "mlp": replicated_input,
            "mlp.fc_in": ColwiseParallel(),
            **({"mlp.fc_gate": ColwiseParallel()} if block.mlp.fc_gate is not None else {}),
            "mlp.fc_out": RowwiseParallel(output_layouts=row_output),
        }  # fmt: skip
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn": replicated_input,
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=row_output),
                **mlp,
            },
        )
    plan = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.head is not None:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    _parallelize_ends(model, tp_mesh, plan)


# the styles of a model's own plan that are built: transformers' names -> DTensor's styles
MODEL_STYLES = ("colwise", "rowwise", "colwise_gather_output")
# this project's style, for a tied embedding: its vocabulary split, its output all-reduced
EMBEDDING_STYLE = "embedding_rowwise"


def apply_model_plan(model, tp_mesh, own: dict, row_output) -> None:
    """A model's own plan, as written: each block's modules by their patterns, then the head's."""
    styles = {"colwise": ColwiseParallel, "rowwise": lambda: RowwiseParallel(output_layouts=row_output),
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate())}  # fmt: skip
    styles[EMBEDDING_STYLE] = lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for index, block in model.blocks.items():
        inside = {name: styles[style]() for name, _ in block.named_modules() if name
                  and (style := style_of(f"blocks.{index}.{name}", own)) is not None}  # fmt: skip
        parallelize_module(block, tp_mesh, inside)
    ends = {
        name: styles[own[name]]()
        for name in ("tok_emb", "head")
        if name in own and getattr(model, name) is not None
    }
    _parallelize_ends(model, tp_mesh, ends)


def sent_by_model_plan(t: Theory, own: dict) -> list[Traffic]:
    """A model's own plan's bytes, per micro-batch of t tokens: each rowwise Linear the rank holds all-reduces its
    output in forward (t x its output width), each colwise one its input's gradient in backward (t x its input
    width); a gathered head all-gathers the logits (t x the vocabulary padded to a multiple of N); a split (tied)
    embedding all-reduces its output (t x width)."""
    layout, work = t.layout, t.work
    k, tokens = work.micro_batches, work.tokens // layout.cp
    matmul_out = 2 if work.mixed_precision == "bf16" else 4
    stream = stream_dtype(layout, work).itemsize
    # the modules it runs: a tied head's weight is held once, under the embedding's name
    held = {name.rsplit(".", 1)[0] for name, _ in t.held} | {
        end for end, runs in (("tok_emb", t.first), ("head", t.last)) if runs
    }
    reduced = gathered = 0
    for name, module in t.model.named_modules():
        style = style_of(name, own) if name in held else None
        if style == "rowwise":
            reduced += module.out_features * matmul_out
        elif style == EMBEDDING_STYLE:  # its output, the residual stream
            reduced += module.embedding_dim * stream
        elif style is not None:
            reduced += module.in_features * stream
        if style == "colwise_gather_output":
            gathered += math.ceil(module.out_features / layout.tp) * layout.tp * matmul_out
    sizes = {"all_reduce": k * tokens * reduced, "all_gather": k * tokens * gathered}
    return [Traffic(kind, size, layout.tp, "tp") for kind, size in sizes.items() if size]


def is_dense(mlp) -> bool:
    """A dense MLP (fc_in, fc_out), not a mixture of experts."""
    return hasattr(mlp, "fc_in")


def _parallelize_ends(model, tp_mesh, plan: dict) -> None:
    tied = model.tok_emb is not None and model.head is not None and model.head.weight is model.tok_emb.weight
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:  # both split on dim 0 alike: one tensor again
        model.head.weight = model.tok_emb.weight


def align_gradients(model) -> None:
    """Each DTensor gradient on its parameter's placement. DTensor's embedding backward may hand back the
    vocabulary-split weight's gradient replicated (its sharding propagation's choice for a pipeline's small
    micro-batches, measured: the first stage held the whole 512 x 32 gradient): right values, twice the bytes
    held, and a shape the tied embedding's all-reduce does not expect. Taking the rank's own rows is a slice,
    with no communication."""
    for param in model.parameters():
        grad = param.grad
        # a partial sum (sequence parallelism's norm gradients) is left to clipping and FSDP: summing it here
        # would send bytes no theory counts
        if (hasattr(grad, "placements") and grad.placements != param.placements
                and not any(p.is_partial() for p in grad.placements)):  # fmt: skip
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def apply_sequence_parallel(model, tp_mesh) -> None:
    """tp's plan with Megatron's sequence parallelism: between the sub-layers (LayerNorms, residual adds)
    each rank holds 1/N of the tokens; entering attention or the MLP the sequence is all-gathered, and the
    row-parallel outputs are reduce-scattered to the tokens' owners instead of all-reduced."""
    sequence = Shard(1)
    gathered_input = PrepareModuleInput(
        input_layouts=(sequence,), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    blocks = list(model.blocks.values())
    for index, block in enumerate(blocks):
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
            **({"mlp.fc_gate": ColwiseParallel()} if block.mlp.fc_gate is not None else {}),
            "mlp.fc_out": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        }
        parallelize_module(block, tp_mesh, plan)
        # the embeddings' sum enters whole: each rank keeps its own tokens (a slice, no send); a later pipeline
        # stage's first block receives the rank's tokens already, as the stage before sent them (its last block
        # hands over its local tokens): a pipeline sends 1/N of the activation (Megatron's scatter-gather)
        if index == 0:
            entering = Replicate() if model.tok_emb is not None else sequence
            parallelize_module(block, tp_mesh, PrepareModuleInput(input_layouts=(entering,),
                                                                  desired_input_layouts=(sequence,)))  # fmt: skip
        if index == len(blocks) - 1 and model.head is None:
            parallelize_module(block, tp_mesh, PrepareModuleOutput(output_layouts=(sequence,),
                                                                   desired_output_layouts=(sequence,),
                                                                   use_local_output=True))  # fmt: skip
    _parallelize_ends(
        model,
        tp_mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()),
        },
    )


def sent(t: Theory) -> list[Traffic]:
    """One step's bytes of a rank's tensor-parallel group (the module docstring): the blocks it holds, whether
    it holds the embedding (`embeds`) and the head (`heads`); recomputed blocks run their forward again in
    backward (full activation checkpointing), up to the attention output's all-reduce (the MLP's output is
    needed by nothing backward uses: the recompute stops before it)."""
    layout, args, work = t.layout, t.args, t.work
    own = model_plan(work)
    if own is not None:
        return sent_by_model_plan(t, own)
    blocks, embeds, heads, recomputed_blocks = t.blocks, t.first, t.last, t.recomputed_blocks
    k, tokens = work.micro_batches, work.tokens // layout.cp
    bf16 = work.mixed_precision == "bf16"
    matmul_out = (
        2 if bf16 else 4
    )  # a row-parallel output, the logits, and their gradients (the module docstring)
    stream = stream_dtype(layout, work).itemsize  # the residual stream, a norm's output, their gradients
    activation = k * tokens * work.model.d_model
    logits = (
        k * tokens * math.ceil(work.model.vocab_size / layout.tp) * layout.tp * matmul_out if heads else 0
    )
    if args.sequence_parallel:
        # every sub-layer's all-reduce becomes its input's all-gather (forward; its reduce-scatter in backward)
        # and its output's reduce-scatter (forward; its all-gather in backward); the head's input is gathered,
        # and the block-0 slice of the embeddings' sum gathers its gradient back
        # the norms' weight gradients come out as partial sums (each rank's own tokens): FSDP (or replicate)
        # all-reduces them over tp before its own reduction, once per step, in the gathered precision
        # (under a pipeline FSDP sums the micro-batches' unsharded gradients in float32, and all-reduces those)
        norms = (2 * blocks + heads) * work.model.d_model * (1 if work.model.norm == "rmsnorm" else 2)
        fsdp = bool(layout.shard_dims or layout.replicate_dims)
        norm_element = 4 if layout.pp > 1 else stream
        sizes = {
            "all_reduce": activation * embeds * stream
            + fsdp * norms * norm_element,  # and the embedding's output
            "all_gather": (2 * blocks * (stream + matmul_out) + (embeds + heads) * stream) * activation
            + logits,
            "reduce_scatter": (2 * blocks * (matmul_out + stream) + heads * stream) * activation,
        }
    else:  # forward: the row-parallel outputs (again in a recompute); backward: the inputs' gradients
        sub_layers = 1 if work.model.n_experts else 2  # a mixture of experts sends nothing over tp
        forward, backward = (
            (sub_layers * blocks + recomputed_blocks) * matmul_out,
            sub_layers * blocks * stream,
        )
        sizes = {
            "all_reduce": (forward + backward + (embeds + heads) * stream) * activation,
            "all_gather": logits,
        }
    return [Traffic(kind, size, layout.tp, "tp") for kind, size in sizes.items() if size]


class TensorParallel(Piece, SplitsParameters, HooksTheStep):
    name = dim = "tp"
    any_model = True  # a model's own plan (model_plan), the GPT's otherwise
    Flags = Flags
    MISTAKES = MISTAKES

    def traits(self, plan: Plan) -> set[str]:
        return {"sequence_split_over_tp"} if plan.args.sequence_parallel else set()

    def refuse(self, plan: Plan) -> None:
        refuse(plan)

    def apply(self, stages: list, ctx: Context) -> list:
        for stage in stages:
            apply(stage, ctx.mesh["tp"], ctx.args, model_plan(ctx.work))
        return stages

    def local_shape(self, name: str, shape: list[int], t: Theory) -> list[int]:
        return local_shape(name, shape, t.layout, t.rank, model_plan(t.work))

    def sent(self, t: Theory) -> list[Traffic]:
        return sent(t)

    def after_backward(self, job) -> None:
        align_gradients(job.model)


PIECE = TensorParallel()
