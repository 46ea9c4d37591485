"""Sharded data parallelism (ZeRO-2 / ZeRO-3, PyTorch's FSDP2) and tensor parallelism (DTensor) for
the GPT, shared by the experiments that train it. Accelerate 1.16 can do neither on CPU (its FSDP
plugin silently runs DDP instead; its TP path needs a transformers model), so `fully_shard` and
`parallelize_module` are called directly, on a DeviceMesh of the accelerator's device type (gloo on
CPU, NCCL on GPU), inside the process group Accelerate made: one code path for both.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DeviceMesh, Partial, Replicate, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)


def shard_gpt(
    model,
    accelerator,
    zero3: bool,
    bf16: bool = False,
    wrap_root: bool = True,
    mesh: DeviceMesh | None = None,
):
    """fully_shard each block, then the root (which holds the embeddings, final norm and head), on a
    1-D mesh over every rank. zero3: each block's gathered parameters are freed after its forward and
    gathered again for backward; otherwise (ZeRO-2) they are kept from forward to backward. bf16:
    parameters gathered as bf16 copies, gradients reduced in float32. `wrap_root=False` is the classic
    mistake of sharding the blocks only (train_gpt's `unwrapped_root`). `mesh`: the data-parallel
    dimension of a 2-D mesh, for FSDP x TP (default: every rank)."""
    model.to(accelerator.device)
    mesh = mesh or init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=zero3, mp_policy=policy)
    if wrap_root:
        # None: FSDP2's default for the root, which keeps its parameters for the backward that starts at once
        fully_shard(model, mesh=mesh, reshard_after_forward=None if zero3 else False, mp_policy=policy)
    return model


def sync_gradients_this_micro_batch(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2's no_sync: reduce-scatter gradients only on the last micro-batch of a step (DDP's no_sync
    comes with Accelerate's accumulate()). A no-op for a model without FSDP modules."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)


def tensor_parallelize_gpt(model, tp_mesh: DeviceMesh, row_all_reduce: bool = True):
    """Megatron-style tensor parallelism on `tp_mesh`, as PyTorch's TP tutorial plans it (without its
    sequence parallelism). Each rank holds 1/N of the heads and of the MLP's hidden units:
      q/k/v and fc_in column-parallel  weight split by output rows: each rank computes its own heads /
                                       hidden units from the full (replicated) input, no communication;
      o_proj and fc_out row-parallel   weight split by input columns: each rank's product is a partial
                                       sum of the output, all-reduced (Megatron's "g") to the full one;
      attention / MLP input            marked Replicate once per sub-layer (PrepareModuleInput), so that
                                       in backward the partial input gradients of q, k and v add up
                                       first and are all-reduced ONCE (Megatron's "f"), not three times;
      tok_emb row-parallel, head column-parallel  the vocabulary split across ranks: each rank looks up
                                       its own rows (the output all-reduced) and computes its own logits
                                       (all-gathered). Both weights are split on dim 0, so the tied
                                       weight stays one tensor (re-tied after parallelizing).
    Per block that is 2 all-reduces of the activations in forward and 2 in backward. LayerNorms and the
    position embedding are replicated: every rank computes them on the same data, and their gradients
    come out equal everywhere. The sharded weights come from rank 0 of the mesh (distribute_tensor's
    `src_data_rank`); the replicated ones are whatever each rank built, so every rank must build the
    same model. `row_all_reduce=False` leaves the row-parallel outputs as partial sums: the classic
    missing all-reduce (train_gpt's `row_parallel_without_all_reduce`)."""
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


# Which dimension tensor_parallelize_gpt splits, by parameter name (None: replicated), for the theory
# of bytes held.
TP_SPLIT_DIM = {
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


def tp_split_dim(name: str) -> int | None:
    return next((dim for suffix, dim in TP_SPLIT_DIM.items() if name.endswith(suffix)), None)
