"""A small decoder-only transformer (GPT), readable like nanoGPT's model.py.

token + position embeddings -> n_layer x [LayerNorm -> causal self-attention -> residual,
LayerNorm -> MLP (4x, GELU) -> residual] -> LayerNorm -> linear head (tied to the token embedding
by default) -> logits. The loss (`lm_loss`) is the mean cross-entropy over every target token of the
batch, computed outside the model (as torchtitan's and torch.distributed.pipelining's loss_fn).

Two choices made for distributed training:
- q, k, v and the attention output are separate Linear layers (nanoGPT fuses q, k, v), so that
  tensor parallelism can split each by heads (column-parallel q/k/v, row-parallel output);
- the key projection has NO bias: softmax(q·(k + b)) = softmax(q·k + q·b), and q·b is the same for
  every key of a query, so softmax ignores it and its true gradient is exactly zero. Under AdamW
  that bias would turn float noise (~1e-9, different in every strategy) into full-size updates
  (Adam divides by the square root of its tiny second moment): a 1.2e-3 parity difference from
  a parameter that does nothing (measured, FIELD_NOTES).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


PER_RANK_BATCH_SIZE = 4  # blocks per rank per micro-batch, by default (train_gpt, mfu, bare_gpt)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # see the module docstring
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attend = causal_attention  # a hook: context parallelism puts its own here (strategies/cp.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # (B, T, C) -> (B, heads, T, head_dim); -1 rather than n_head: under tensor parallelism a rank
        # holds only its share of the heads, and the same code must run there.
        q, k, v = (
            proj(x).view(batch, time, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        attended = self.attend(q, k, v)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, time, -1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v, each query seeing itself and the keys before it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def token_positions(length: int, device) -> torch.Tensor:
    """The positions of a block's `length` tokens: 0, 1, ..., length - 1."""
    return torch.arange(length, device=device)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

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
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.positions = token_positions
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("o_proj.weight", "fc_out.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

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
            x = self.tok_emb(idx) + self.pos_emb(self.positions(idx.shape[1], idx.device))
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
    (common/checkpoint.py), so any grouping resumes any other's."""
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
    cfg: GPTConfig, state: dict, tokenizer, prompt: torch.Tensor, tokens: int, seed: int, device
) -> str:
    """`tokens` tokens from a GPT of `state`, after `prompt` (token ids), decoded; seeded."""
    if not tokens:
        return ""
    model = build_gpt(cfg, seed).to(device)
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
    d = cfg.d_model
    attention = 3 * d * d + 2 * d + d * d + d  # q, k, v (k without bias), o
    mlp = d * 4 * d + 4 * d + 4 * d * d + d
    block = attention + mlp + 2 * 2 * d  # two LayerNorms
    embeddings = cfg.vocab_size * d + cfg.block_size * d
    head = 0 if cfg.tie_weights else cfg.vocab_size * d
    return embeddings + cfg.n_layer * block + 2 * d + head


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

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    what = f"{local_ranks} process(es) training a {parameter_count(cfg):,}-parameter model"
    require_memory(flags.removeprefix("--"), local_ranks * training_bytes(cfg, batch_size), what=what)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied head counts once), as nanoGPT reports them."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
