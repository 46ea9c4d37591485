"""Unit tests of common/gpt.py and common/text.py: the model's shapes and loss, the key bias that is
left out, generation; the corpus, the tokenizer's round trip and cache, blocks and shards."""

from __future__ import annotations

import math

import torch

from common.data import shard_rows
from common.gpt import GPTConfig, build_gpt, count_parameters, lm_loss
from common.text import load_corpus, make_blocks

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=16)


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


def test_the_model_is_causal():
    model = build_gpt(SMALL, seed=0)
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
