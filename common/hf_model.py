"""Your own model: a Hugging Face transformers causal LM (`AutoModelForCausalLM.from_config`), trained by train_gpt
on the same data, tokenizer, checks and layouts as the project's GPT.

A transformers decoder (Llama, Qwen2, Mistral, Mixtral and their like: `model.embed_tokens`, `model.layers`,
`model.norm`, `lm_head`, rotary positions) is the project's GPT in another coat. `HFCausalLM` holds the very same
modules under the GPT's names (tok_emb, blocks.<i>, ln_f, head), so every piece that cuts the GPT by blocks and
the theory of bytes held and sent, which reads the parameters by those names, see it as they see the GPT; its
forward runs each decoder layer as the transformers model does (the rotary embedding, a causal mask per layer
type: full, or a sliding window), so its logits are the transformers model's (tests/test_hf_model.py).

The model travels as a `GPTConfig` whose `hf` field is the transformers config as JSON (so a run's config.json
records it, a checkpoint is tied to it, and a fake rank can build it); the GPTConfig's other fields are its shape
as the GPT would have it (width, layers, heads, MLP width), which the estimates of memory and time read. Nothing
is downloaded: a preset is built in code from transformers' config classes, a path is read from disk.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from common.config import UsageError, flag, require
from common.gpt import GPT, GPTConfig, ModelFlags, build_gpt, token_positions

# Small members of each family, the shapes of the project's GPT (width 64, 2 layers: a CPU trains them in seconds):
# each is its family's own config class with the family's defaults but the size
PRESETS = {
    "llama_tiny": ("LlamaConfig", {}),  # grouped-query attention, SwiGLU, RMSNorm, rope; untied head
    "qwen2_tiny": ("Qwen2Config", {}),  # biases on q, k, v; an untied head (Qwen2-7B's; its 0.5B ties it)
    "mistral_tiny": ("MistralConfig", {"sliding_window": 16}),  # each token sees the 16 before it
    "mixtral_tiny": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96},
    ),
}
TINY = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}  # fmt: skip


def read_hf_config(name_or_path: str):
    """A preset's transformers config, or the one a config.json on disk holds (a file, or the folder of one):
    anything else is refused in one line. Read only: nothing downloaded."""
    import transformers

    if name_or_path in PRESETS:
        class_name, extra = PRESETS[name_or_path]
        return getattr(transformers, class_name)(**{**TINY, **extra})
    path = os.path.dirname(name_or_path) if name_or_path.endswith(".json") else name_or_path
    require(os.path.isfile(os.path.join(path, "config.json")), f"--hf_config {name_or_path!r}: neither a preset ("
            f"{', '.join(PRESETS)}) nor a config.json on disk (a file, or a folder holding one)")  # fmt: skip
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:  # not JSON, a model_type transformers does not know
        raise UsageError(f"--hf_config {name_or_path!r}: {str(error).splitlines()[0][:200]}") from None


def experts_of(cfg: GPTConfig) -> int:
    """The experts of each layer's mixture of experts in the transformers config `cfg` carries (0: none; the names
    the families give it: Mixtral's num_local_experts, Qwen2-MoE's num_experts, DeepSeek's n_routed_experts)."""
    if not cfg.hf:  # the project's GPT: its experts are its own (cfg.n_experts)
        return 0
    text = transformers_config(cfg).get_text_config()
    return max(
        getattr(text, name, 0) or 0 for name in ("num_local_experts", "num_experts", "n_routed_experts")
    )


def gpt_config_of(hf_config, vocab_size: int, block_size: int) -> GPTConfig:
    """The model as a GPTConfig: its shape in the GPT's fields (what the estimates read), the transformers config
    in `hf` (what is built), with the vocabulary the tokenizer has and positions for `block_size` tokens."""
    positions = max(block_size, hf_config.max_position_embeddings)
    hf_config = type(hf_config).from_dict(
        {**hf_config.to_dict(), "vocab_size": vocab_size, "max_position_embeddings": positions}
    )
    text = hf_config.get_text_config()  # a multimodal config's language model's
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        require(isinstance(getattr(text, name, None), int), f"--hf_config ({text.model_type}): no {name}: a decoder "
                "with hidden_size, num_hidden_layers, num_attention_heads and intermediate_size is what trains here")  # fmt: skip
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=text.num_hidden_layers,
                     n_head=text.num_attention_heads, d_model=text.hidden_size,
                     n_kv_head=getattr(text, "num_key_value_heads", None) or 0, d_ff=text.intermediate_size,
                     tie_weights=bool(text.tie_word_embeddings), mlp="swiglu", norm="rmsnorm", positions="rope",
                     bias=bool(getattr(text, "attention_bias", False)),
                     hf=hf_config.to_json_string(use_diff=False))  # fmt: skip


def transformers_config(cfg: GPTConfig):
    """The transformers config a GPTConfig carries (its `hf`), as the class its model_type names."""
    from transformers import AutoConfig

    fields = json.loads(cfg.hf)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def tp_plan(cfg: GPTConfig) -> dict[str, str]:
    """A transformers model's own tensor-parallel plan, under the GPT's names: its config's base_model_tp_plan
    (layers.* -> blocks.*) and its causal-LM class's for the head (lm_head -> head). Module pattern -> style."""
    return dict(_tp_plan(cfg.hf))


@functools.lru_cache(maxsize=8)  # asked of every parameter by the theory: read once a config
def _tp_plan(hf: str) -> tuple:
    from transformers import AutoModelForCausalLM

    config = transformers_config(GPTConfig(hf=hf))
    blocks = config.base_model_tp_plan or {}
    plan = {pattern.replace("layers.", "blocks.", 1): style for pattern, style in blocks.items()}
    head = (AutoModelForCausalLM._model_mapping[type(config)]._tp_plan or {}).get("lm_head")
    return tuple({**plan, "head": head}.items() if head else plan.items())


class HFCausalLM(nn.Module):
    """forward(idx) -> logits of a transformers causal LM, its modules held under the GPT's names: tok_emb (its
    embed_tokens), blocks (its decoder layers, keyed by index), ln_f (its final norm), head (its lm_head, tied
    as the config says). As the GPT, a pipeline stage may hold None for what it does not run."""

    def __init__(self, cfg: GPTConfig, causal_lm: nn.Module):
        super().__init__()
        self.cfg, self.config = cfg, causal_lm.config
        inner = causal_lm.model
        self.tok_emb = inner.embed_tokens  # in the GPT's order: a checkpoint lists them as the GPT's
        self.blocks = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers)})
        self.ln_f, self.head = inner.norm, causal_lm.lm_head
        self.rotary = inner.rotary_emb  # its frequencies a buffer, not a parameter: nothing to train or shard
        self.positions = token_positions
        # each layer's attention: the config's layer_types (Qwen2, Gemma...), else a sliding window if it has one
        window = (
            getattr(self.config, "sliding_window", None)
            if getattr(self.config, "use_sliding_window", True)
            else None
        )
        self.layer_kinds = list(getattr(self.config, "layer_types", None) or
                                ["sliding_attention" if window else "full_attention"] * len(self.blocks))  # fmt: skip

    def masks(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        """Each kind of layer's mask, as transformers makes it (None: causal, left to the attention kernel)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: make[kind](config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                                 position_ids=positions) for kind in set(self.layer_kinds)}  # fmt: skip

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); a stage without embeddings or head takes or returns the hidden
        states (B, T, d_model) instead."""
        x = idx if self.tok_emb is None else self.tok_emb(idx)
        positions = self.positions(x.shape[1], x.device)[None]
        cos_sin, masks = self.rotary(x, positions), self.masks(x, positions)
        for index, block in self.blocks.items():
            x = block(x, attention_mask=masks[self.layer_kinds[int(index)]], position_embeddings=cos_sin,
                      position_ids=positions)  # fmt: skip
        return x if self.head is None else self.head(self.ln_f(x))

    generate = GPT.generate  # sampling by forward alone, as the GPT samples


def build_model(cfg: GPTConfig, seed: int) -> nn.Module:
    """The model a GPTConfig describes, seeded: the transformers model it carries, else the project's GPT."""
    return build_hf(cfg, seed) if cfg.hf else build_gpt(cfg, seed)


def build_hf(cfg: GPTConfig, seed: int) -> HFCausalLM:
    """The transformers model `cfg.hf` describes, initialised as transformers does (its own _init_weights), seeded;
    float32, attention by PyTorch's scaled_dot_product_attention. The process's random state is left as it was."""
    from transformers import AutoModelForCausalLM

    config = transformers_config(cfg)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HFCausalLM(cfg, AutoModelForCausalLM.from_config(config, dtype=torch.float32))


# The names a transformers checkpoint (save_pretrained's safetensors) gives the same tensors
HF_NAMES = (("model.embed_tokens.", "tok_emb."), ("model.layers.", "blocks."), ("model.norm.", "ln_f."),
            ("lm_head.", "head."))  # fmt: skip


def ours_from_hf(weights: dict) -> dict:
    """A transformers state dict under the GPT's names (a tensor not of the decoder, or already ours, as it is)."""
    renamed = {}
    for name, tensor in weights.items():
        for theirs, ours in HF_NAMES:
            if name.startswith(theirs):
                name = ours + name[len(theirs) :]
                break
        renamed[name] = tensor
    return renamed


@dataclass
class HFModelFlags:
    """--hf_config: the model a transformers config describes, instead of the project's GPT (whose shape flags it
    replaces: the config sets the shape; --vocab_size and --block_size stay the tokenizer's and the data's)."""

    hf_config: str = flag("", "a transformers model instead of the project's GPT: a config.json on disk (a file or "
                          f"its folder) or a preset: {', '.join(PRESETS)} (docs/your_model.md)")  # fmt: skip
    # whose vocabulary the model has: the tokenizer's (train_gpt trains its BPE to --vocab_size), or the config's
    # (a run on fake tensors has no tokenizer: at_scale, tools.plan), unless --vocab_size is given
    vocabulary_from_config: ClassVar[bool] = False

    def model_config(self, base: GPTConfig | None = None, vocab_size: int = 0) -> GPTConfig:
        if not self.hf_config:
            return super().model_config(base, vocab_size)
        hf_config = read_hf_config(self.hf_config)
        own = self.vocabulary_from_config and "vocab_size" not in getattr(self, "given_flags", ())
        vocabulary = vocab_size or (hf_config.get_text_config().vocab_size if own else self.vocab_size)
        return gpt_config_of(hf_config, vocabulary, self.block_size)

    def the_config_is_the_model(self) -> None:
        """Where --model names a published shape (at_scale, tools.plan): a transformers config is its own shape, so
        the run is `custom` (no published batch or run beside it); --model given beside it is refused."""
        if self.hf_config:
            given = "model" in getattr(self, "given_flags", ())
            require(not given, "--model with --hf_config: the config is the model")
            self.model = "custom"

    def refuse_model(self, cfg: GPTConfig) -> None:
        if not self.hf_config:
            return super().refuse_model(cfg)
        shape = {f.name for f in dataclasses.fields(ModelFlags)} - {
            "vocab_size",
            "block_size",
            "expert_matmul",
        }
        given = sorted(shape & set(getattr(self, "given_flags", ())))
        require(
            not given, f"--{given[0] if given else ''} with --hf_config: the config sets the model's shape"
        )
        super().refuse_model(cfg)
