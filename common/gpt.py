"""A small decoder-only transformer (GPT), readable like nanoGPT's model.py.

token + position embeddings -> n_layer x [LayerNorm -> causal self-attention -> residual,
LayerNorm -> MLP (4x, GELU) -> residual] -> LayerNorm -> linear head (tied to the token embedding
by default) -> logits: GPT-2's block. GPTConfig's second group of fields gives Llama 3's instead
(grouped-query attention, SwiGLU, RMSNorm, rotary positions, no biases, an untied head). The loss
(`lm_loss`) is the mean cross-entropy over every target token of the batch, computed outside the
model (as torchtitan's and torch.distributed.pipelining's loss_fn).

Two choices made for distributed training:
- q, k, v and the attention output are separate Linear layers (nanoGPT fuses q, k, v), so that
  tensor parallelism can split each by heads (column-parallel q/k/v, row-parallel output);
- the key projection has NO bias: softmax(q·(k + b)) = softmax(q·k + q·b), and q·b is the same for
  every key of a query, so softmax ignores it and its true gradient is exactly zero. Under AdamW
  that bias would turn float noise (~1e-9, different in every strategy) into full-size updates
  (Adam divides by the square root of its tiny second moment): a 1.2e-3 parity difference from
  a parameter that does nothing (measured).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.config import flag, require
from common.moe import ROUTERS, MoE, init_experts, moe_parameter_count


@dataclass
class GPTConfig:
    """The model, and the defaults of everything that trains it (train_gpt's flags, benchmarks/mfu.py,
    benchmarks/bare_gpt.py): 1,063,168 parameters with the BPE of 2,048 tokens."""

    vocab_size: int = 2048
    block_size: int = 64  # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    tie_weights: bool = True  # head shares the token embedding (nanoGPT, GPT-2)
    # What Llama 3 and friends change (the defaults are GPT-2's): each proven equal to one process under every
    # layout like the rest (tests/test_train_gpt_layouts.py)
    n_kv_head: int = (
        0  # key/value heads, shared by groups of query heads (grouped-query attention); 0: n_head
    )
    d_ff: int = 0  # the MLP's hidden width; 0: 4 x d_model
    mlp: str = "gelu"  # gelu: fc_out(gelu(fc_in x)); swiglu: fc_out(silu(fc_gate x) * fc_in x)
    norm: str = "layernorm"  # or rmsnorm (no mean, no bias)
    positions: str = "learned"  # a learned position table; rope: rotary embeddings of q and k (no parameters)
    bias: bool = True  # the linear layers' biases (the key projection never has one); Llama has none
    rope_theta: float = 10_000.0  # rope's base period (Llama 3: 500,000)
    # A mixture of experts in place of each block's MLP (common/moe.py), when n_experts > 0
    n_experts: int = 0  # experts per block (0: the dense MLP)
    top_k: int = 2  # experts each token goes to
    n_shared_experts: int = 0  # always-on experts beside the routed ones (DeepSeek), as wide as one
    router: str = "softmax"  # softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3) scores
    route_norm: bool = False  # renormalise a token's top_k weights to sum to 1 (off: torchtitan's default)
    capacity_factor: float = 0.0  # 0: dropless; c > 0: an expert takes at most c x tokens x top_k / n_experts
    aux_loss_coef: float = 0.0  # the auxiliary load-balancing loss's weight (0: none)
    bias_update_rate: float = (
        0.0  # auxiliary-loss-free balancing: the bias's step per optimizer step (0: none)
    )
    # the experts by grouped GEMM, or "loop": one matmul per expert (the reference it is checked against)
    expert_matmul: str = "grouped"
    # a transformers model instead of this GPT: its config as JSON, the fields above its shape (common/hf_model.py)
    hf: str = ""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        return self.d_ff or 4 * self.d_model


PER_RANK_BATCH_SIZE = 4  # blocks per rank per micro-batch, by default (train_gpt, mfu, bare_gpt)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        kv_width = cfg.kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, kv_width, bias=False)  # see the module docstring
        self.v_proj = nn.Linear(cfg.d_model, kv_width, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.rope_theta = cfg.rope_theta if cfg.positions == "rope" else None
        self.positions = (
            token_positions  # a hook: context parallelism's positions of this rank's tokens (cp.py)
        )
        self.attend = causal_attention  # a hook: context parallelism puts its own here (strategies/cp.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # (B, T, C) -> (B, heads, T, head_dim); -1 rather than n_head: under tensor parallelism a rank
        # holds only its share of the heads, and the same code must run there.
        q, k, v = (
            proj(x).view(batch, time, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.rope_theta is not None:
            positions = self.positions(time, x.device)
            q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
        attended = self.attend(q, k, v)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, time, -1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v, each query seeing itself and the keys before it; with fewer key/value
    heads than query heads (grouped-query attention) each serves its group of query heads."""
    k, v = grouped(q, k), grouped(q, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def grouped(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Keys or values (B, kv heads, T, head_dim) repeated for the query heads each serves (B, heads, T, head_dim)."""
    group = q.shape[1] // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def token_positions(length: int, device) -> torch.Tensor:
    """The positions of a block's `length` tokens: 0, 1, ..., length - 1."""
    return torch.arange(length, device=device)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, as Llama applies it): each pair of channels (2i, 2i + 1) of
    a head turned by the angle position x theta^(-2i / head_dim). x: (B, heads, T, head_dim)."""
    head_dim = x.shape[-1]
    frequencies = theta ** (-torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[:, None] * frequencies[None, :]  # (T, head_dim / 2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).type_as(x)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.bias)
        self.fc_gate = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.fc_out = nn.Linear(cfg.hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc_gate is None:
            return self.fc_out(F.gelu(self.fc_in(x)))
        return self.fc_out(F.silu(self.fc_gate(x)) * self.fc_in(x))


def norm(cfg: GPTConfig) -> nn.Module:
    return nn.RMSNorm(cfg.d_model, eps=1e-5) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.d_model)


def shared_experts(cfg: GPTConfig) -> nn.Module | None:
    """A mixture of experts' shared experts (DeepSeek's n_shared_experts, always on beside the routed ones): one MLP
    n_shared_experts x hidden wide, without biases; None without them."""
    if not cfg.n_shared_experts:
        return None
    return MLP(dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.hidden, bias=False, n_experts=0))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = norm(cfg), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = norm(cfg), MoE(cfg, shared_experts(cfg)) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx) -> logits. A pipeline stage is a GPT that holds None for what it does not run (as
    torchtitan's models do): without the embeddings it takes the previous stage's hidden states, without
    the head it returns its own. `blocks` is keyed by block index, so a stage's parameters keep the whole
    model's names (blocks.2.attn.q_proj.weight on whichever rank holds block 2): its checkpoint is a piece
    of the GPT's. Two hooks, which a parallelism sets and nothing else changes: each attention's `attend`
    (context parallelism's attention over keys on other ranks) and `positions` (the positions of the tokens
    this rank holds)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.positions = token_positions
        if self.tok_emb.weight.is_meta:  # shapes only (the planner's, a fake rank's): no values to draw
            return
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("o_proj.weight", "fc_out.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        init_experts(self, cfg.n_layer)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); a stage without embeddings or head takes or returns the
        hidden states (B, T, d_model) instead."""
        x = idx
        if self.tok_emb is not None:
            x = self.tok_emb(idx)
            if self.pos_emb is not None:
                x = x + self.pos_emb(self.positions(idx.shape[1], idx.device))
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(self.ln_f(x))

    def configure_optimizers(self, lr: float, weight_decay: float) -> torch.optim.AdamW:
        """AdamW as nanoGPT sets it up (adamw over this model's parameters)."""
        return adamw(self.parameters(), lr, weight_decay)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int = 40,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample max_new_tokens tokens after idx (B, T), seeded by `generator`."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])
            logits = logits[:, -1, :] / temperature
            cutoff = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
            logits[logits < cutoff] = -float("inf")
            next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over every target token of the batch (in float32 under bf16 autocast)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def adamw(parameters, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW as nanoGPT sets it up: weight decay on matrices and embeddings (dim >= 2), none on biases
    and norms; a tied weight once. Works on distributed parameters too (DDP, FSDP2, DTensor).

    The fused kernel: one pass over each group's tensors. PyTorch's default on CPU steps one parameter at
    a time, a dozen ops each, and over DTensor parameters every op pays DTensor's dispatch: measured, one
    AdamW step of this GPT on 2 ranks took 25.1 ms on FSDP2's shards, 2.9 fused; 6.2 plain (ddp), 2.1 fused
    (benchmarks/optimizer_step.py). Fused takes one kind of tensor per call and is called per group: tensor
    parallelism mixes DTensor matrices with plain LayerNorms, so each kind gets groups of its own. How the
    parameters are grouped is a matter of speed only: a checkpoint keeps the state by parameter name
    (common/checkpoint/), so any grouping resumes any other's."""
    from torch.distributed.tensor import DTensor

    params = list({id(p): p for p in parameters}.values())
    groups = []
    for decay in (True, False):
        for distributed in (True, False):
            chosen = [p for p in params if (p.dim() >= 2) == decay and isinstance(p, DTensor) == distributed]
            if chosen:
                groups.append({"params": chosen, "weight_decay": weight_decay if decay else 0.0})
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def sample_text(
    model: nn.Module, state: dict, tokenizer, prompt: torch.Tensor, tokens: int, seed: int, device
) -> str:
    """`tokens` tokens from `model` (a GPT, or a model with its generate) holding `state`, after `prompt` (token
    ids), decoded; seeded."""
    if not tokens:
        return ""
    model = model.to(device)
    model.load_state_dict(state)
    generated = model.generate(prompt.unsqueeze(0).to(device), tokens,
                               generator=torch.Generator(device=device).manual_seed(seed))  # fmt: skip
    return tokenizer.decode(generated[0].tolist())


def build_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """The same initial weights on every rank and in the reference: seeded, on the CPU. The process's
    own random state is left as it was (fork_rng)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def parameter_count(cfg: GPTConfig) -> int:
    """Distinct parameters of GPT(cfg), by formula (no model built): what a size check needs before any
    memory is spent. Equal to count_parameters(GPT(cfg)) (a test)."""
    d, kv, hidden, bias = cfg.d_model, cfg.kv_heads * (cfg.d_model // cfg.n_head), cfg.hidden, cfg.bias
    attention = d * d + d * kv + d * kv + d * d + bias * (d + kv + d)  # q, k, v, o (k without bias)
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * hidden + bias * (
        (2 if cfg.mlp == "swiglu" else 1) * hidden + d
    )
    if cfg.n_experts:  # the experts have no biases
        mlp = moe_parameter_count(cfg)
    norms = 2 * (d if cfg.norm == "rmsnorm" else 2 * d)  # weight (and bias, LayerNorm's)
    embeddings = cfg.vocab_size * d + (cfg.block_size * d if cfg.positions == "learned" else 0)
    head = 0 if cfg.tie_weights else cfg.vocab_size * d
    return embeddings + cfg.n_layer * (attention + mlp + norms) + norms // 2 + head


def training_bytes(cfg: GPTConfig, batch_size: int) -> int:
    """A generous estimate of one process's memory to train GPT(cfg) in float32 with AdamW: parameters,
    gradients and two moments (x 4), the one-process reference's copy of all four, and the activations
    autograd keeps (about 20 floats per token per layer and width, the attention matrices, the logits)."""
    tokens = batch_size * cfg.block_size
    activations = tokens * (20 * cfg.d_model * cfg.n_layer + 3 * cfg.vocab_size)
    activations += batch_size * cfg.n_head * cfg.block_size**2 * cfg.n_layer * 2
    return 4 * (8 * parameter_count(cfg) + activations)


def require_trainable(cfg: GPTConfig, batch_size: int, flags: str) -> None:
    """Refuse, in one line naming `flags`, a model that the processes of this machine (LOCAL_WORLD_SIZE, each
    training its own copy or piece) cannot train in the memory it has free: before anything starts, not a
    MemoryError halfway."""
    import os

    from common.data import require_memory
    from common.device import device_memory_bytes, planned_device_type

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device_type = planned_device_type()
    on_device = device_memory_bytes(device_type)
    if on_device is None:  # the CPU: every process of this machine in its RAM
        what = f"{local_ranks} process(es) training a {parameter_count(cfg):,}-parameter model"
        require_memory(flags.removeprefix("--"), local_ranks * training_bytes(cfg, batch_size), what=what)
        return
    # a GPU per process: one process's training against its device's memory (free, total)
    needed, (free, total) = training_bytes(cfg, batch_size), on_device
    require(needed <= free, f"{flags}: training a {parameter_count(cfg):,}-parameter model would need about "
            f"{needed / 2**30:.1f} GiB of {device_type} memory a process, the device has {free / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB free; use a smaller size")  # fmt: skip


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied head counts once), as nanoGPT reports them."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def refuse_gpt(cfg: GPTConfig) -> None:
    """A GPT no model can have (a zero size, heads that do not divide the width...) refused in one line naming
    the flag: every experiment that builds the GPT from flags asks this (ModelFlags, fault_tolerance)."""
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
        require(getattr(cfg, name) > 0, f"--{name} must be > 0, got {getattr(cfg, name)}")
    require(cfg.d_model % cfg.n_head == 0, f"--n_head {cfg.n_head} must divide --d_model {cfg.d_model}")
    require(cfg.n_kv_head >= 0 and cfg.n_head % (cfg.n_kv_head or cfg.n_head) == 0 and cfg.d_ff >= 0,
            f"--n_kv_head {cfg.n_kv_head} must divide --n_head {cfg.n_head} (0: one per query head); "
            f"--d_ff {cfg.d_ff} must be >= 0")  # fmt: skip
    require(cfg.positions != "rope" or cfg.d_model // cfg.n_head % 2 == 0,
            f"--positions rope turns pairs of channels: the head width --d_model / --n_head = "
            f"{cfg.d_model // cfg.n_head} must be even")  # fmt: skip
    require(cfg.n_experts >= 0 and (not cfg.n_experts or 1 <= cfg.top_k <= cfg.n_experts),
            f"--n_experts {cfg.n_experts} --top_k {cfg.top_k}: need n_experts >= 0, 1 <= top_k <= n_experts")  # fmt: skip
    require(cfg.n_shared_experts == 0 or (cfg.n_experts and 0 < cfg.n_shared_experts <= 64),
            f"--n_shared_experts {cfg.n_shared_experts}: shared experts sit beside routed ones (needs "
            "--n_experts); 0 to 64")  # fmt: skip
    require(min(cfg.capacity_factor, cfg.aux_loss_coef, cfg.bias_update_rate) >= 0,
            "--capacity_factor, --aux_loss_coef, --bias_update_rate must be >= 0")  # fmt: skip
    # bounded: from --n_experts up no expert can be over capacity (c x tokens x k / E >= every token), and a
    # loss weight or a bias step above 1 is a typo (Switch: 0.01; DeepSeek-V3: 0.001); 1e308 overflowed
    require(cfg.capacity_factor <= max(cfg.n_experts, 1),
            f"--capacity_factor {cfg.capacity_factor:g}: at most --n_experts ({max(cfg.n_experts, 1)}), from which "
            "no token is ever dropped; 0 is dropless")  # fmt: skip
    require(max(cfg.aux_loss_coef, cfg.bias_update_rate) <= 1,
            f"--aux_loss_coef {cfg.aux_loss_coef:g}, --bias_update_rate {cfg.bias_update_rate:g}: each must be "
            "<= 1")  # fmt: skip


_DEFAULT = GPTConfig()


@dataclass
class ModelFlags:
    """The model's flags, one set for every experiment that builds the GPT (train_gpt, at_scale): GPTConfig's
    fields, their defaults the project's GPT. `model_config(base)` is the GPT they ask for: every flag on the
    project's GPT, or, on a given `base` shape (at_scale's published one), only the flags given on the command
    line (common/config.parse_config records them)."""

    vocab_size: int = flag(_DEFAULT.vocab_size, "vocabulary (train_gpt: of the BPE trained on the corpus)")
    block_size: int = flag(_DEFAULT.block_size, "context length in tokens")
    n_layer: int = flag(_DEFAULT.n_layer, "transformer blocks")
    n_head: int = flag(_DEFAULT.n_head, "attention heads (must divide d_model)")
    d_model: int = flag(_DEFAULT.d_model, "model width")
    tie_weights: bool = flag(_DEFAULT.tie_weights, "share the token embedding with the output head")
    n_kv_head: int = flag(0, "key/value heads, each shared by n_head / this query heads (grouped-query attention; "
                          "0: n_head)")  # fmt: skip
    d_ff: int = flag(0, "the MLP's hidden width (0: 4 x d_model)")
    mlp: str = flag(
        "gelu", "gelu (GPT-2) or swiglu (Llama: silu(gate) x up, then down)", choices=("gelu", "swiglu")
    )
    norm: str = flag("layernorm", "layernorm (GPT-2) or rmsnorm (Llama)", choices=("layernorm", "rmsnorm"))
    positions: str = flag(
        "learned", "learned (a position table, GPT-2) or rope (rotary, Llama)", choices=("learned", "rope")
    )
    bias: bool = flag(True, "biases in the linear layers (Llama: none)")
    n_experts: int = flag(0, "a mixture of experts in each block's MLP: this many experts (0: the dense MLP); "
                          "--ep splits them over ranks")  # fmt: skip
    top_k: int = flag(2, "with --n_experts: experts each token goes to")
    n_shared_experts: int = flag(0, "with --n_experts: always-on experts beside the routed ones (DeepSeek-V3: 1), "
                                 "each as wide as a routed one; every token goes through them")  # fmt: skip
    router: str = flag("softmax", "with --n_experts: the router's scores, softmax (Switch, Mixtral) or sigmoid "
                       "(DeepSeek-V3)", choices=ROUTERS)  # fmt: skip
    route_norm: bool = flag(False, "with --n_experts: renormalise each token's top_k weights to sum to 1 (Mixtral, "
                            "DeepSeek-V3); off (torchtitan's default) the outputs are weighted by the raw scores, so "
                            "at --top_k 1 the router still learns from the language-model loss (Switch)")  # fmt: skip
    capacity_factor: float = flag(0.0, "with --n_experts: 0 = dropless; c > 0: an expert takes at most c x tokens x "
                                  "top_k / n_experts of a forward's tokens, the rest dropped (reported)")  # fmt: skip
    aux_loss_coef: float = flag(0.0, "with --n_experts: the auxiliary load-balancing loss's weight (Switch: 0.01; 0: "
                                "none)")  # fmt: skip
    bias_update_rate: float = flag(0.0, "with --n_experts: auxiliary-loss-free balancing (DeepSeek-V3): each expert's "
                                   "routing bias moves by this per step towards the mean load (0: none)")  # fmt: skip
    expert_matmul: str = flag("grouped", "with --n_experts: grouped (torch._grouped_mm, one kernel for every expert; "
                              "where a width is not a multiple of 8 the loop runs) or loop (one matmul per expert, the "
                              "reference; the same numbers)", choices=("grouped", "loop"))  # fmt: skip

    def model_config(self, base: GPTConfig | None = None, vocab_size: int = 0) -> GPTConfig:
        """The GPT these flags ask for (`vocab_size`: the one the tokenizer really has, once it is trained)."""
        names = [f.name for f in dataclasses.fields(ModelFlags)]
        given = names if base is None else getattr(self, "given_flags", ())
        cfg = dataclasses.replace(base or _DEFAULT, **{n: getattr(self, n) for n in names if n in given})
        return dataclasses.replace(cfg, vocab_size=vocab_size) if vocab_size else cfg

    def refuse_model(self, cfg: GPTConfig) -> None:
        """The model `cfg` (these flags' resolved) refused in one line if no GPT can have it."""
        refuse_gpt(cfg)

    def record_model(self, cfg: GPTConfig) -> None:
        """The model that runs written back into the flags (config.json records it)."""
        for f in dataclasses.fields(ModelFlags):
            setattr(self, f.name, getattr(cfg, f.name))
