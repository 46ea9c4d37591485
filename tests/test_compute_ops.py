"""The closed form's op list (planning/compute_ops.py) against the one a fake rank records for the same layout: the
same matmuls and attention calls, op by op (shape and FLOPs), and the same memory-bound bytes; priced by one op
model, the same step. And the fused kernels' list: each norm, activation and rotary embedding one op, no casts."""

from __future__ import annotations

import json
import shlex
from collections import Counter

import pytest

from common.config import parse_config
from experiments.at_scale import Config
from planning.communication import own_calls
from planning.compute_ops import stage_ops
from planning.cost_model import predict_step
from planning.fake_ranks import meta_gpt
from planning.hardware import load_hardware
from strategies import registry
from strategies.piece import Plan
from strategies.theory import stage_theories
from tests.test_ops import fake_rank

SHAPE = "--n_layer 2 --d_model 64 --n_head 4 --vocab_size 512 --block_size 128"
LLAMA = "--norm rmsnorm --mlp swiglu --bias false --positions rope --n_kv_head 2 --tie_weights false"


def closed_and_recorded(flags: str) -> tuple:
    model = [] if "--model" in flags else ["--model", "custom"]
    cfg = parse_config(Config, ["--report_to", "none", *model, *shlex.split(f"{SHAPE} {flags}")])
    layout, work = cfg.layout(), cfg.workload()
    recorded = fake_rank(cfg, layout, work, 0)
    theories = stage_theories(meta_gpt(work.model), layout, cfg, work)
    first = theories[0]
    m = cfg.pp_microbatches if layout.pp > 1 else 1
    closed = stage_ops(work.model, layout, cfg, work, work.rows // m, first.blocks, first.first, first.last,
                       "eager", m, held=first.held)  # fmt: skip
    return cfg, layout, work, theories, recorded, closed, m


def compute(ops, kind: str) -> Counter:
    """The list's ops of `kind` by (name, shape, FLOPs, bytes, backward), counted."""
    counts = Counter()
    for c, n in ops:
        if c.kind == kind:
            counts[c.name, c.shape, c.flops, c.bytes, c.backward] += n
    return counts


@pytest.mark.parametrize(
    "flags, memory_within",
    [
        (
            "--world_size 1",
            0.01,
        ),  # GPT-2's shape: LayerNorm, GELU, biases, learned positions, a tied head; autocast
        (f"{LLAMA} --world_size 1", 0.01),  # Llama's: RMSNorm, SwiGLU, rope, grouped-query attention
        ("--tp 2", 0.01),  # tp's shards, the vocabulary split (a tied one); the logits gathered for the loss
        ("--dp_shard 2 --per_rank_batch_size 3", 0.01),  # FSDP: bf16 weights, its copies; 3 rows (_at_rows)
        ("--dp_shard 2 --reshard_after_forward never", 0.01),  # ZeRO-2: no gather again before the backward
        (
            f"{LLAMA} --pp 2 --dp_shard 2 --per_rank_batch_size 4 --pp_microbatches 4",
            0.01,
        ),  # FSDP once a step
        (
            f"{LLAMA} --tp 2 --dp_shard 2 --activation_checkpointing full",
            0.01,
        ),  # the recompute, stopped early
        (f"{LLAMA} --cp 2 --dp_shard 2", 0.01),  # cp's chunked attention; K and V gathered
        # autocast under a pipeline: each weight cast once a step; autograd's float32 sums; replicate's copies
        (f"{LLAMA} --pp 2 --dp_replicate 2 --per_rank_batch_size 4 --pp_microbatches 4", 0.01),
        # autocast's recompute outside its region: the weights cast again in the backward
        ("--world_size 1 --activation_checkpointing full", 0.01),
        # Llama 3's layout in small (its first stage): the whole vocabulary's gradient summed by FSDP, then sliced
        (f"{LLAMA} --pp 2 --tp 2 --dp_shard 2 --pp_microbatches 2 --per_rank_batch_size 2", 0.01),
        ("--tp 2 --dp_shard 2", 0.01),  # a tied vocabulary split under FSDP
        # sequence parallelism: its gathers traced as concatenations after autocast's casts, which DTensor's
        # redistributes run after them (bf16): within 5 %
        (f"{LLAMA} --tp 2 --sequence_parallel", 0.05),
        # a mixture of experts: its MLP the closed form's (fake tensors hold no routing to trace it by)
        (
            "--model olmoe_1b_7b --block_size 32 --world_size 16 --dp_shard 4 --ep 4 --per_rank_batch_size 1",
            0.01,
        ),
        # DeepSeek-V3's in small: shared experts, a sigmoid router, autocast under a pipeline beside ep
        (
            f"{LLAMA} --n_experts 8 --top_k 2 --n_shared_experts 1 --router sigmoid --route_norm true --world_size 8 "
            "--pp 2 --dp_replicate 2 --ep 2 --per_rank_batch_size 2 --pp_microbatches 2",
            0.01,
        ),
        # selective checkpointing: the recompute of what its policy does not save (no matmul, no attention); a
        # MoE's grouped GEMMs recomputed under ep, its all-to-alls not
        (f"{LLAMA} --tp 2 --dp_shard 2 --activation_checkpointing selective", 0.01),
        (f"{LLAMA} --n_experts 8 --top_k 2 --dp_shard 2 --ep 2 --activation_checkpointing selective", 0.01),
        # the recompute of a MoE block under FSDP (ep refuses full checkpointing)
        (f"{LLAMA} --n_experts 8 --top_k 2 --dp_shard 2 --activation_checkpointing full", 0.01),
    ],
)
def test_the_closed_forms_op_list_is_the_one_a_fake_rank_records(flags, memory_within):
    """Matmuls and attention op by op (FLOPs and shapes; a step's m micro-batches against one micro-batch's m
    times), memory-bound bytes a phase within 1 % (5 % where the closed form approximates: sequence parallelism's
    gathers, a MoE's MLP), and the compute priced on an H100 within 2 % (5 % there)."""
    cfg, layout, work, theories, recorded, closed, m = closed_and_recorded(flags)
    ddp = "whole_model_replicas" in Plan(cfg, layout, work, None, registry.PIECES).traits
    for phase in ("forward", "backward"):
        ran = own_calls(recorded["ops"], phase, ddp)  # as predict_step prices them
        for kind in ("gemm", "attention"):
            expected = compute(closed[phase], kind)
            assert compute(ran, kind) == Counter({key: n * m for key, n in expected.items()}), (phase, kind)
            assert expected, (phase, kind)
        ran_bytes = sum(c.bytes * n for c, n in ran if c.kind == "memory") / m
        closed_bytes = sum(c.bytes * n for c, n in closed[phase] if c.kind == "memory")
        assert closed_bytes == pytest.approx(ran_bytes, rel=memory_within), phase
    h100 = load_hardware("h100_sxm")
    calls = recorded["counted"]["calls"]
    from_recorded = predict_step(theories, layout, cfg, work, h100, calls, [recorded])
    from_closed = predict_step(theories, layout, cfg, work, h100, calls)
    assert from_recorded["priced"] == "recorded ops" and from_closed["priced"] == "closed form"
    within = max(0.02, memory_within)
    assert from_closed["terms_s"]["compute"] == pytest.approx(from_recorded["terms_s"]["compute"], rel=within)


def test_fused_kernels_make_each_norm_activation_and_rotary_embedding_one_op():
    """Llama's block, fused: two norms, one SwiGLU, q's and k's rotary embedding, each one op forward and one
    backward; no casts; the same matmuls and attention; fewer bytes than eager."""
    cfg = parse_config(Config, ["--report_to", "none", "--model", "custom", *shlex.split(f"{SHAPE} {LLAMA}"),
                                "--world_size", "1"])  # fmt: skip
    layout, work = cfg.layout(), cfg.workload()
    eager, fused = (
        stage_ops(work.model, layout, cfg, work, 1, 1, False, False, k) for k in ("eager", "fused")
    )
    names = Counter()
    for c, n in fused["forward"] + fused["backward"]:
        names[c.name] += n
    assert names["fused_norm"] == names["fused_norm_backward"] == 2
    assert names["fused_swiglu"] == names["fused_swiglu_backward"] == 1
    assert names["fused_rope"] == names["fused_rope_backward"] == 2
    for gone in ("_to_copy", "rsqrt", "silu", "silu_backward", "pow", "sin", "cos"):
        assert names[gone] == 0, gone
    for phase in ("forward", "backward"):
        for kind in ("gemm", "attention"):
            assert compute(fused[phase], kind) == compute(eager[phase], kind)
        moved = {k: sum(c.bytes * n for c, n in ops[phase] if c.kind == "memory") for k, ops in (("eager", eager),
                                                                                                ("fused", fused))}  # fmt: skip
        assert 0 < moved["fused"] < 0.75 * moved["eager"], moved
    # the last stage's final norm the same: one kernel, its eager RMSNorm's ops taken out (pow, rsqrt, mean)
    ends = stage_ops(work.model, layout, cfg, work, 1, 0, False, True, "fused")
    names = Counter()
    for c, n in ends["forward"] + ends["backward"]:
        names[c.name] += n
    assert names["fused_norm"] == names["fused_norm_backward"] == 1
    for gone in ("_to_copy", "rsqrt", "pow", "mean"):
        assert names[gone] == 0, gone


def test_the_planner_prices_the_kernels_it_is_told_and_says_which(capsys):
    """tools.plan --kernels: Llama 3 8B on 8 GPUs, eager (our modules' float32 norms, casts, unfused SwiGLU and
    rope) slower than fused; each says which kernels priced it; a kernel set not known is refused in one line."""
    from common.config import UsageError
    from tools.plan import main

    steps = {}
    for kernels in ("eager", "fused"):
        main(["--model", "llama3_8b", "--gpus", "8", "--dp_shard", "8", "--kernels", kernels, "--json"])
        (row,) = json.loads(capsys.readouterr().out)
        steps[kernels] = row["step_s"]
        main(["--model", "llama3_8b", "--gpus", "8", "--dp_shard", "8", "--kernels", kernels])
        assert f"PREDICTED ({kernels} kernels, flash attention) step" in capsys.readouterr().out
    assert steps["fused"] < steps["eager"]
    with pytest.raises((SystemExit, UsageError)):
        main(["--model", "llama3_8b", "--gpus", "8", "--kernels", "triton"])
    assert "--kernels" in capsys.readouterr().err


def test_materialised_attention_is_two_batched_gemms_around_a_softmax_over_the_whole_square():
    """Before FlashAttention (Megatron-LM 2021): forward Q K^T and P V over every (query, key) pair, the masked half
    too (twice a causal flash kernel's FLOPs), the scores read and written by one softmax; backward four GEMMs of
    the same size and the softmax's backward (P, dP read, dS written); nothing else in the list changes."""
    cfg = parse_config(
        Config, ["--report_to", "none", "--model", "custom", *shlex.split(SHAPE), "--world_size", "1"]
    )
    layout, work = cfg.layout(), cfg.workload()
    flash, materialised = (stage_ops(work.model, layout, cfg, work, 1, 1, False, False, "fused", attention=a)
                           for a in ("flash", "materialised"))  # fmt: skip
    heads, tokens, width = 4, 128, 16
    square = 2.0 * heads * tokens * tokens * width
    for phase, gemms, softmax in (
        ("forward", 2, "scaled_masked_softmax"),
        ("backward", 4, "softmax_backward"),
    ):
        (attention,) = [c for c, n in flash[phase] if c.kind == "attention"]
        causal_flops = attention.flops
        batched = [(c, n) for c, n in materialised[phase] if c.name == "bmm"]
        assert sum(n for _, n in batched) == gemms and all(c.flops == square for c, _ in batched)
        assert {c.name for c, _ in materialised[phase]} >= {softmax}
        scores = 2 * heads * tokens * tokens  # bf16
        (moved,) = [c.bytes for c, _ in materialised[phase] if c.name == softmax]
        assert moved == (2 if phase == "forward" else 3) * scores
        assert not [c for c, _ in materialised[phase] if c.kind == "attention"]
        # twice the causal kernel's forward; 1.6 times its backward (which recomputes the scores: 2.5 forwards)
        assert gemms * square == pytest.approx(causal_flops * (2 if phase == "forward" else 1.6))
        rest = [(c, n) for c, n in flash[phase] if c.kind != "attention"]
        assert Counter(dict(rest)) == Counter(
            {c: n for c, n in materialised[phase] if c.name not in ("bmm", softmax)}
        )

    # and the predictor prices the kernel it is told: the same step, slower with the scores materialised
    theories = stage_theories(meta_gpt(work.model), layout, cfg, work)
    h100 = load_hardware("h100_sxm")
    steps = {a: predict_step(theories, layout, cfg, work, h100, kernels="fused", attention=a)["terms_s"]["compute"]
             for a in ("flash", "materialised")}  # fmt: skip
    assert steps["materialised"] > steps["flash"] > 0


@pytest.mark.parametrize("kernels", ["eager", "fused"])
def test_an_op_list_at_r_rows_follows_from_two_traces_at_other_rows(kernels):
    """Every op is affine in the rows, so once a shape is traced at 1 and 3 rows its list at 7 is the list traced at
    7: the same ops, shapes, FLOPs and bytes (Llama's shape under tp 2 with sequence parallelism, and under cp 2)."""
    from planning import compute_ops

    cfg = parse_config(Config, ["--report_to", "none", "--model", "custom", *shlex.split(f"{SHAPE} {LLAMA}"),
                                "--world_size", "1"])  # fmt: skip
    shape = compute_ops._shape_key(cfg.workload().model)

    def plain(ops):
        return Counter({(c.name, c.shape, c.flops, c.bytes, c.backward): n for c, n in ops})

    for tp, cp, sp in ((2, 1, True), (1, 2, False)):
        for trace, extra in ((compute_ops._block_ops, ()), (compute_ops._ends_ops, (True, True, False))):
            calls = []

            def counted(*key, trace=trace, calls=calls):
                calls.append(key[1])
                return trace(*key)

            for rows in (1, 3, 7, 7):  # traced at 1 and 3; grown at 7, and kept
                key = (shape, rows, tp, cp, sp, 1, True, False, kernels)
                grown = compute_ops._at_rows(counted, key, extra)
            assert calls == [1, 3], calls
            traced = trace(*key, *extra)
            for phase in ("forward", "backward"):
                assert plain(grown[phase]) == plain(traced[phase]), (trace.__name__, tp, cp, phase)
