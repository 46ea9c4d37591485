"""Published models and training runs, each with its source: what experiments/at_scale.py runs at the real size
and what tools/plan.py plans for, and the figures their predictions are set beside.

A shape is the project's GPT (common/gpt.py) with the paper's numbers; where the paper's model differs from
ours in a way that changes bytes or FLOPs, the note says how. Parameter counts are common/gpt.parameter_count's
(tests/test_published.py holds each to the paper's count).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.gpt import GPTConfig


@dataclass(frozen=True)
class Model:
    shape: GPTConfig
    global_batch: int  # sequences per optimizer step in the published training run
    source: str


LLAMA3 = dict(vocab_size=128_256, block_size=8192, tie_weights=False, n_kv_head=8, mlp="swiglu", norm="rmsnorm",
              positions="rope", bias=False, rope_theta=500_000.0)  # fmt: skip
MODELS = {
    # Brown et al. 2020 (GPT-3), Table 2.1: 96 layers, d_model 12,288, 96 heads, context 2,048, batch 3.2M
    # tokens (1,536 sequences); GPT-2's vocabulary of 50,257. GPT-3 alternates dense and locally banded sparse
    # attention: ours is dense throughout (the same parameters and matmul FLOPs).
    "gpt3_175b": Model(GPTConfig(50_257, 2048, 96, 96, 12_288), 1536, "Brown et al. 2020, Table 2.1"),
    # Narayanan et al. 2021 (Megatron-LM), Table 1, its last row: 1,008 B parameters, vocabulary 51,200,
    # sequence 2,048; batch 3,072 on 3,072 A100s (t 8, p 64). Its output layer is the word embedding (the
    # paper's parameter formula counts V h once), as ours by default.
    "megatron_1t": Model(GPTConfig(51_200, 2048, 128, 160, 25_600), 3072, "Narayanan et al. 2021, Table 1"),
    # Llama 3 (Grattafiori et al. 2024), Table 3: layers, width, FFN width, heads, 8 key/value heads, vocabulary
    # 128K, RoPE base 500,000; batch 16M tokens (2,048 sequences of 8,192, Table 4); SwiGLU, RMSNorm, no biases,
    # an untied head (its released checkpoints).
    "llama3_8b": Model(
        GPTConfig(n_layer=32, n_head=32, d_model=4096, d_ff=14_336, **LLAMA3), 2048, "Llama 3 paper, Table 3"
    ),  # fmt: skip
    "llama3_70b": Model(
        GPTConfig(n_layer=80, n_head=64, d_model=8192, d_ff=28_672, **LLAMA3), 2048, "Llama 3 paper, Table 3"
    ),  # fmt: skip
    "llama3_405b": Model(
        GPTConfig(n_layer=126, n_head=128, d_model=16_384, d_ff=53_248, **LLAMA3),
        2048,
        "Llama 3 paper, Table 3",
    ),  # fmt: skip
    # Muennighoff et al. 2024 (OLMoE-1B-7B), Table 1: 16 layers, width 2,048, 16 heads, 64 experts of FFN width
    # 1,024, 8 a token (6.9B parameters, 1.3B active), vocabulary 50,304, context 4,096, batch 4M tokens (1,024
    # sequences); SwiGLU, RMSNorm, rope, no biases, untied. Its QK-norm (2 x 2,048 a layer) is not ours, and its
    # router does not renormalise the top 8 (ours does: the same bytes and FLOPs).
    "olmoe_1b_7b": Model(
        GPTConfig(
            vocab_size=50_304,
            block_size=4096,
            n_layer=16,
            n_head=16,
            d_model=2048,
            d_ff=1024,
            tie_weights=False,
            mlp="swiglu",
            norm="rmsnorm",
            positions="rope",
            bias=False,
            n_experts=64,
            top_k=8,
        ),
        1024,
        "Muennighoff et al. 2024 (OLMoE), Table 1",
    ),  # fmt: skip
    # DeepSeek-AI 2024 (DeepSeek-V3 technical report), section 4.2: 61 layers, width 7,168, 128 heads, 1 shared and
    # 256 routed experts of FFN width 2,048 a layer, 8 a token, sigmoid scores renormalised over the 8 chosen
    # (671B parameters, 37B active); vocabulary 129,280 (its config), context 4,096, batch 15,360 sequences (after
    # its ramp); SwiGLU, RMSNorm, untied. Its differences from ours, which change bytes and FLOPs: multi-head
    # latent attention (ours: plain multi-head, 56-wide heads), its first 3 layers dense (ours: all 61 MoE), its
    # multi-token prediction module; ours has 704.9B parameters, 38.7B active.
    "deepseek_v3": Model(
        GPTConfig(
            vocab_size=129_280,
            block_size=4096,
            n_layer=61,
            n_head=128,
            d_model=7168,
            d_ff=2048,
            tie_weights=False,
            mlp="swiglu",
            norm="rmsnorm",
            positions="rope",
            bias=False,
            n_experts=256,
            top_k=8,
            n_shared_experts=1,
            router="sigmoid",
            route_norm=True,
        ),
        15_360,
        "DeepSeek-AI 2024 (DeepSeek-V3), sections 3.2 and 4.2",
    ),  # fmt: skip
}


@dataclass(frozen=True)
class PublishedRun:
    """A training run as its paper reports it: the model, the GPUs, the layout, and what each GPU achieved."""

    name: str
    model: str
    hardware: str
    degrees: dict  # the layout in our dimensions (the paper's DP: dp_shard, as FSDP / ZeRO-3 shards it)
    block_size: int
    per_rank_batch_size: int  # sequences per data-parallel rank per step
    tflops_per_gpu: float
    mfu: float
    source: str
    recompute_counted: bool = False  # the paper's FLOPs count activation recomputation (Megatron-LM's do)
    # the attention kernel the run had (planning/compute_ops.ATTENTION): flash, or materialised before
    # FlashAttention (Dao et al. 2022)
    attention: str = "flash"

    @property
    def world_size(self) -> int:
        from math import prod

        return prod(self.degrees.values())


PUBLISHED_RUNS = [
    # Megatron-LM: 1 trillion parameters on 3,072 A100s at 163 teraFLOP/s per GPU, 52% of peak; t 8, p 64, so 6
    # data-parallel ranks, which all-reduce (dp_replicate): batch 3,072 = 512 sequences per data-parallel rank.
    PublishedRun(
        "megatron_1t_3072",
        "megatron_1t",
        "a100_80gb",
        {"pp": 64, "dp_replicate": 6, "tp": 8},
        2048,
        512,
        163.0,
        0.52,
        "Narayanan et al. 2021, Table 1 (1T row) and abstract",
        recompute_counted=True,
        # its section 4.2: a fused scale-mask-softmax kernel between batched GEMMs, the scores materialised
        attention="materialised",
    ),
    # Llama 3, Table 4: the three 405B configurations (FSDP-style sharded data parallelism, "DP").
    PublishedRun(
        "llama3_405b_8192",
        "llama3_405b",
        "h100_sxm",
        {"pp": 16, "dp_shard": 64, "tp": 8},
        8192,
        32,
        430.0,
        0.43,
        "Llama 3 paper, Table 4, row 1",
    ),  # fmt: skip
    PublishedRun(
        "llama3_405b_16384",
        "llama3_405b",
        "h100_sxm",
        {"pp": 16, "dp_shard": 128, "tp": 8},
        8192,
        16,
        400.0,
        0.41,
        "Llama 3 paper, Table 4, row 2",
    ),  # fmt: skip
    PublishedRun(
        "llama3_405b_16384_cp16",
        "llama3_405b",
        "h100_sxm",
        {"pp": 16, "dp_shard": 8, "cp": 16, "tp": 8},
        131_072,
        16,
        380.0,
        0.38,
        "Llama 3 paper, Table 4, row 3",
    ),  # fmt: skip
]

# Rajbhandari et al. 2020 (ZeRO), Figure 1: a 7.5B-parameter model on 64 GPUs, mixed-precision Adam (K = 12:
# fp32 master weights, momentum, variance), model states per GPU in GB: 2 + 2 + K bytes per parameter, the
# optimizer states (P_os), gradients too (P_os+g), parameters too (P_os+g+p) split over the 64.
ZERO_FIGURE_1 = {"parameters": 7.5e9, "gpus": 64, "gb_per_gpu": {"baseline": 120.0, "os": 31.4, "os_g": 16.6,
                                                                    "os_g_p": 1.9}}  # fmt: skip


def model_named(name: str) -> Model:
    from common.config import require

    require(name in MODELS, f"--model {name!r} is not a shape this project knows; known: {', '.join(MODELS)}")
    return MODELS[name]
