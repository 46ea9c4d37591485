"""Unit tests of common/gpt.py and common/text.py: the model's shapes and loss, the key bias that is
left out, generation; the corpus, the tokenizer's round trip and cache, blocks and shards."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from common.data import shard_rows
from common.gpt import GPTConfig, build_gpt, count_parameters, lm_loss, parameter_count, rotate
from common.text import load_corpus, make_blocks

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=16)
# Llama's changes: grouped-query attention, SwiGLU, RMSNorm, rotary positions, no biases, an untied head
LLAMA_SHAPED = dataclasses.replace(SMALL, n_head=4, n_kv_head=2, d_ff=24, mlp="swiglu", norm="rmsnorm",
                                   positions="rope", bias=False, tie_weights=False)  # fmt: skip


def test_forward_shapes_and_initial_loss_near_uniform():
    model = build_gpt(SMALL, seed=0)
    generator = torch.Generator().manual_seed(0)
    idx, targets = (
        torch.randint(0, 64, (3, 16), generator=generator),
        torch.randint(0, 64, (3, 16), generator=generator),
    )
    logits = model(idx)
    loss = lm_loss(logits, targets)
    assert logits.shape == (3, 16, 64)
    assert abs(loss.item() - math.log(64)) < 0.1  # small init: close to a uniform guess


@pytest.mark.parametrize("cfg", [SMALL, LLAMA_SHAPED], ids=["gpt2", "llama"])
def test_the_model_is_causal(cfg):
    model = build_gpt(cfg, seed=0)
    idx = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 64
    before, after = model(idx), model(changed)
    assert torch.equal(before[0, :10], after[0, :10]) and not torch.equal(before[0, 10:], after[0, 10:])


def test_tied_head_counts_once_and_key_projection_has_no_bias():
    tied, untied = build_gpt(SMALL, 0), build_gpt(GPTConfig(**{**SMALL.__dict__, "tie_weights": False}), 0)
    assert tied.head.weight is tied.tok_emb.weight
    assert count_parameters(untied) - count_parameters(tied) == 64 * 16
    assert tied.blocks["0"].attn.k_proj.bias is None and tied.blocks["0"].attn.q_proj.bias is not None


@pytest.mark.parametrize(
    "cfg", [SMALL, LLAMA_SHAPED, dataclasses.replace(LLAMA_SHAPED, mlp="gelu", bias=True)]
)
def test_the_parameter_formula_counts_the_model_it_describes(cfg):
    assert parameter_count(cfg) == count_parameters(build_gpt(cfg, 0))


def test_the_parameter_formula_gives_llama_3_8b_its_published_size():
    llama_3_8b = GPTConfig(vocab_size=128_256, block_size=8192, n_layer=32, n_head=32, d_model=4096,
                           tie_weights=False, n_kv_head=8, d_ff=14_336, mlp="swiglu", norm="rmsnorm",
                           positions="rope", bias=False)  # fmt: skip
    # Meta-Llama-3-8B's model.safetensors.index.json: total_size 16,060,522,496 bytes of bf16
    assert parameter_count(llama_3_8b) == 16_060_522_496 // 2


def test_rotary_embeddings_make_attention_scores_depend_on_distance_only():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=generator), torch.randn(1, 1, 1, 8, generator=generator)

    def score(query_at: int, key_at: int) -> float:
        return (
            rotate(q, torch.tensor([query_at]), 10_000.0) * rotate(k, torch.tensor([key_at]), 10_000.0)
        ).sum()

    assert score(7, 3) == pytest.approx(score(40, 36), rel=1e-5)  # 4 apart, wherever they stand
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)  # 2 apart: another score
    assert rotate(q, torch.tensor([9]), 10_000.0).norm() == pytest.approx(q.norm(), rel=1e-6)  # a rotation


def test_a_key_value_head_per_query_head_is_ordinary_attention():
    grouped = build_gpt(dataclasses.replace(LLAMA_SHAPED, n_kv_head=4), 0)
    plain = build_gpt(dataclasses.replace(LLAMA_SHAPED, n_kv_head=0), 0)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(grouped(idx), plain(idx))


def test_generation_is_seeded():
    model = build_gpt(SMALL, seed=0)
    prompt = torch.zeros(1, 4, dtype=torch.long)
    first = model.generate(prompt, 8, generator=torch.Generator().manual_seed(3))
    again = model.generate(prompt, 8, generator=torch.Generator().manual_seed(3))
    assert first.shape == (1, 12) and torch.equal(first, again)


def test_pydoc_corpus_round_trips_through_the_tokenizer_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the cache goes under ./runs/.cache/text
    corpus = load_corpus("", vocab_size=512, block_size=32, val_fraction=0.1)
    assert corpus["characters"] > 100_000 and 2 < corpus["characters_per_token"] < 6
    text = "def f(x):\n    return x ** 2  # squares"
    assert corpus["tokenizer"].decode(corpus["tokenizer"].encode(text).ids) == text
    cached = sorted(p.name for p in (tmp_path / "runs" / ".cache" / "text").iterdir())
    assert any(name.startswith("bpe-") and name.endswith("-512.json") for name in cached)
    assert sum(name.startswith("tokens-") and name.endswith("-512.pt") for name in cached) == 1
    again = load_corpus("", vocab_size=512, block_size=32, val_fraction=0.1)  # from the token cache
    assert torch.equal(again["train"][0], corpus["train"][0]) and again["sha256"] == corpus["sha256"]
    assert again["tokenizer"].encode(text).ids == corpus["tokenizer"].encode(text).ids


def test_the_token_cache_follows_the_files_bytes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "notes.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    first = load_corpus(str(path), vocab_size=300, block_size=8, val_fraction=0.1)
    path.write_text("a completely different text, about other things entirely\n" * 60)
    second = load_corpus(str(path), vocab_size=300, block_size=8, val_fraction=0.1)  # not the stale cache
    assert second["sha256"] != first["sha256"] and second["characters"] != first["characters"]
    assert second["tokenizer"].decode(second["train"][0][0].tolist()) in path.read_text()


def test_a_damaged_token_cache_is_rebuilt_not_trained_on(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "notes.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    first = load_corpus(str(path), vocab_size=300, block_size=8, val_fraction=0.1)
    (cache,) = (tmp_path / "runs" / ".cache" / "text").glob("tokens-*.pt")
    saved = torch.load(cache, weights_only=True)
    saved["ids"][5] += 1  # a flipped token id
    torch.save(saved, cache)
    again = load_corpus(str(path), vocab_size=300, block_size=8, val_fraction=0.1)
    assert (
        "is unusable (ValueError: token ids changed since they were cached); rebuilding it"
        in capsys.readouterr().err
    )
    assert torch.equal(again["train"][0], first["train"][0])
    cache.write_bytes(cache.read_bytes()[:100])  # cut short
    assert torch.equal(load_corpus(str(path), 300, 8, 0.1)["train"][0], first["train"][0])


def test_blocks_shift_by_one_and_shards_are_equal():
    ids = torch.arange(23)
    x, y = make_blocks(ids, 5)
    assert x.shape == y.shape == (4, 5) and torch.equal(y, x + 1)
    shards = [shard_rows((x, y), r, 3) for r in range(3)]
    assert [len(s[0]) for s in shards] == [1, 1, 1] and torch.equal(shards[2][0], x[2:3])
