"""Which kernels a step's op list assumes (planning/compute_ops.stage_ops' `kernels` and `attention`): the list our
eager modules dispatch, rewritten as fused kernels or as attention before FlashAttention would run it.

  fused          a norm, the MLP's activation, a rotary embedding each one kernel that reads its inputs and writes
                 its outputs once (their eager ops found by running each module alone and taken out of the list),
                 no casts (weights held in bf16): Megatron-LM's and Meta's kernels;
  materialised   each attention call as the scores' GEMM, a softmax over the whole square and a second GEMM.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import torch
import torch.nn.functional as F

from planning.ops import OpCall
from planning.tracing import built, module_ops

KERNELS = ("eager", "fused")
ATTENTION = ("flash", "materialised")


def fused(calls: dict, cfg, rows: int, tokens: int, sp_tokens: int, tp: int, weights, autocast: bool) -> dict:
    """The block's eager list with its norms, its MLP's activation and its rotary embedding each one kernel (its
    inputs read and its outputs written once, forward and backward), and no casts (the module docstring)."""
    compute = torch.bfloat16 if (autocast or weights == torch.bfloat16) else torch.float32
    e = 2 if compute == torch.bfloat16 else 4
    d, hidden, head_dim = cfg.d_model, cfg.hidden // tp, cfg.d_model // cfg.n_head
    eager, one_kernel = Counter(), Counter()  # (phase, OpCall) -> count
    _one_kernel_norm(eager, one_kernel, cfg, (rows, sp_tokens, d), weights, autocast, times=2)
    if not cfg.n_experts:
        _take_out(eager, _alone("activation", cfg.mlp, (rows, tokens, hidden), compute, autocast))
        reads = 2 if cfg.mlp == "swiglu" else 1
        _add(one_kernel, f"fused_{cfg.mlp}", compute, e * (reads + 1) * rows * tokens * hidden,
             e * (2 * reads + 1) * rows * tokens * hidden)  # fmt: skip
    if cfg.positions == "rope":
        for heads in (cfg.n_head // tp, cfg.kv_heads // tp):
            _take_out(
                eager, _alone("rope", cfg.rope_theta, (rows, heads, tokens, head_dim), compute, autocast)
            )
            size = rows * heads * tokens * head_dim
            _add(one_kernel, "fused_rope", compute, e * 2 * size, e * 2 * size)
    return _swapped(calls, eager, one_kernel)


def fused_final_norm(calls: dict, cfg, rows: int, tokens: int, weights, autocast: bool) -> dict:
    """The last stage's final norm one kernel and no casts (the loss's float32 upcast fused into it): its eager ops
    taken out as a block's norms' are (fused)."""
    eager, one_kernel = Counter(), Counter()
    _one_kernel_norm(eager, one_kernel, cfg, (rows, tokens, cfg.d_model), weights, autocast, times=1)
    return _swapped(calls, eager, one_kernel)


def _one_kernel_norm(
    eager: Counter, one_kernel: Counter, cfg, shape: tuple, weights, autocast: bool, times: int
):
    """`times` norms over an input of `shape` (rows, tokens, width) in the weights' dtype: their eager ops (traced
    alone) to take out, one kernel each to put in (the input read and the output written; backward the input and
    the output's gradient read, the input's written; its weights read, and their gradient written)."""
    e = 2 if weights == torch.bfloat16 else 4
    elements, norm_weights = math.prod(shape), e * shape[-1] * (1 if cfg.norm == "rmsnorm" else 2)
    _take_out(eager, _alone("norm", cfg.norm, shape, weights, autocast), times)
    _add(one_kernel, "fused_norm", weights, e * 2 * elements + norm_weights, e * 3 * elements + 2 * norm_weights,
         times)  # fmt: skip


def _take_out(eager: Counter, ops: dict, times: int = 1) -> None:
    for phase, counts in ops.items():
        for call, n in counts.items():
            if call.kind != "view":
                eager[phase, call] += n * times


def _add(
    one_kernel: Counter, name: str, dtype, forward_bytes: float, backward_bytes: float, times: int = 1
) -> None:
    label = str(dtype).removeprefix("torch.")
    one_kernel["forward", OpCall(name, "memory", label, (), 0.0, int(forward_bytes))] += times
    one_kernel["backward", OpCall(name + "_backward", "memory", label, (), 0.0, int(backward_bytes))] += times


def _swapped(calls: dict, eager: Counter, one_kernel: Counter) -> dict:
    """`calls` without its casts and the eager ops taken out, with the one-kernel ops put in."""
    out = {}
    for phase, ops in calls.items():
        counts = Counter({c: n for c, n in ops if c.name != "_to_copy"})
        counts.subtract({c: n for (p, c), n in eager.items() if p == phase and c.name != "_to_copy"})
        counts.update({c: n for (p, c), n in one_kernel.items() if p == phase})
        out[phase] = [(c, n) for c, n in counts.items() if n > 0]
    return out


@functools.lru_cache(maxsize=512)
def _alone(kind: str, variant, shape: tuple, dtype, autocast: bool) -> dict:
    """The eager ops of one module run alone on an input of `shape` (tracing.module_ops), the same for every block
    and layout of that shape: a norm (`variant` its kind; shape rows, tokens, width), the MLP's activation (gelu or
    swiglu; rows, tokens, hidden), a rotary embedding (`variant` its theta; rows, heads, tokens, head width)."""
    from common.gpt import GPTConfig, norm, rotate

    def leaf():
        return torch.empty(*shape, dtype=dtype, requires_grad=True)

    def run(recorder):
        if kind == "norm":
            module = built(lambda: norm(GPTConfig(d_model=shape[-1], norm=variant)), dtype)
            x = leaf()
            recorder.calls.clear()
            return module(x)
        if kind == "activation":
            gate, up = leaf(), leaf()
            recorder.calls.clear()
            return F.silu(gate) * up if variant == "swiglu" else F.gelu(up)
        x, positions = leaf(), torch.arange(shape[2])
        recorder.calls.clear()
        return rotate(x, positions, variant)

    return module_ops(run, autocast)


def materialised(counts: Counter) -> Counter:
    """Each attention call as the kernels before FlashAttention (Dao et al. 2022) ran it (Megatron-LM 2021,
    Narayanan et al. section 4.2: a fused scale-mask-softmax kernel between two strided batched GEMMs): the
    scores Q K^T a GEMM over the whole square (the masked half computed too), the softmax reading the scores and
    writing the probabilities, P V a GEMM; the backward's four GEMMs (dV = P^T dO, dP = dO V^T, dQ = dS K,
    dK = dS^T Q) from the saved probabilities (nothing recomputed) and the softmax's backward (P and dP read, dS
    written). Attention dropout left out."""
    out = Counter()
    for call, n in counts.items():
        if call.kind != "attention":
            out[call] += n
            continue
        heads, q, k, w = call.shape
        e, flops = (2 if call.dtype in ("bfloat16", "float16") else 4), 2.0 * heads * q * k * w

        gemm = functools.partial(_batched_gemm, call.dtype, e, heads, flops)
        scores = e * heads * q * k
        if call.backward:
            ops = [gemm(heads * k, q, w), gemm(heads * q, w, k), gemm(heads * q, k, w), gemm(heads * k, q, w),
                   OpCall("softmax_backward", "memory", call.dtype, (), 0.0, 3 * scores)]  # fmt: skip
        else:
            ops = [gemm(heads * q, w, k), gemm(heads * q, k, w),
                   OpCall("scaled_masked_softmax", "memory", call.dtype, (), 0.0, 2 * scores)]  # fmt: skip
        for op in ops:
            out[op] += n
    return out


def _batched_gemm(dtype: str, e: int, heads: int, flops: float, m: int, inner: int, cols: int) -> OpCall:
    """A batched GEMM of `heads` matrices, m rows in all (its operands and output, e bytes an element)."""
    return OpCall(
        "bmm", "gemm", dtype, (m, inner, cols), flops, e * (m * inner + heads * inner * cols + m * cols)
    )
