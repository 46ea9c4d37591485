"""Real text, with nothing downloaded: a corpus, a BPE tokenizer trained here, fixed-length blocks.

- The corpus: CPython's own `pydoc_data/topics.py` (~465k characters of English reference prose,
  shipped with every Python; its text changes with the Python version, so its sha256 is recorded),
  or your files with --text_files a.txt,b.txt. Either way it is read through Hugging Face `datasets`
  (`load_dataset("text", ...)`), line by line.
- The tokenizer: a byte-level BPE that Hugging Face `tokenizers` trains on the corpus (vocab 2048 on
  pydoc topics: ~0.7 s, 3.6 characters per token, exact round trip), cached by corpus hash and
  vocab size under runs/.cache/, trained by the main process while the others wait; the token ids are
  cached beside it, by the files' bytes and the vocab size.
- The blocks: the token stream cut into non-overlapping windows of block_size + 1 tokens; x is a
  window's first block_size tokens, y the same shifted by one. The last --val_fraction of the stream
  is held out for validation.
"""

from __future__ import annotations

import hashlib
import os

import torch

from common.config import UsageError

CACHE_DIR = os.path.join("runs", ".cache", "text")


def corpus_files(text_files: str) -> tuple[list[str], str]:
    """(files, a name for the corpus): --text_files, or pydoc topics written once into the cache."""
    if text_files:
        files = [f.strip() for f in text_files.split(",") if f.strip()]
        for path in files or [text_files]:
            if not os.path.isfile(path):
                raise UsageError(f"--text_files: {path!r} is not a file")
        return [os.path.abspath(f) for f in files], "text_files"
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    digest = hashlib.sha256(text.encode()).hexdigest()
    path = os.path.abspath(os.path.join(CACHE_DIR, f"pydoc_topics-{digest[:16]}.txt"))
    if not os.path.exists(path):
        os.makedirs(CACHE_DIR, exist_ok=True)
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)  # several ranks may race here: each rename is whole
    return [path], "pydoc_data/topics.py"


def load_text(files: list[str]) -> str:
    """The corpus through `datasets` ("text" builder: one row per line), joined back with newlines."""
    from datasets import load_dataset

    lines = load_dataset("text", data_files=files, split="train", keep_in_memory=True)["text"]
    text = "\n".join(lines)
    if len(text) < 1000:
        raise UsageError(f"--text_files: the corpus has {len(text)} characters; give it at least 1,000")
    return text


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE trained on `text`, cached by (corpus hash, vocab size)."""
    from tokenizers import Tokenizer
    from tokenizers.implementations import ByteLevelBPETokenizer

    path = os.path.join(CACHE_DIR, f"bpe-{hashlib.sha256(text.encode()).hexdigest()[:16]}-{vocab_size}.json")
    if os.path.exists(path):
        return Tokenizer.from_file(path)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    os.makedirs(CACHE_DIR, exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    tokenizer.save(temporary)
    os.replace(temporary, path)
    return Tokenizer.from_file(path)


def make_blocks(ids: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of block_size + 1 tokens -> (x, y), each (n_blocks, block_size)."""
    n_blocks = (len(ids) - 1) // block_size
    windows = ids[: n_blocks * block_size + 1]
    x = windows[:-1].view(n_blocks, block_size)
    y = windows[1:].view(n_blocks, block_size)
    return x.contiguous(), y.contiguous()


def tokenized(files: list[str], vocab_size: int) -> dict:
    """The corpus as token ids, with its tokenizer: read through `datasets`, tokenized once, then cached by
    (the files' bytes, vocab size): a later run, and every rank after the first, loads ids instead of
    importing datasets and re-encoding (~2 s per process here)."""
    from tokenizers import Tokenizer

    files_digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as handle:
            files_digest.update(handle.read() + b"\0")
    path = os.path.join(CACHE_DIR, f"tokens-{files_digest.hexdigest()[:16]}-{vocab_size}.pt")
    if os.path.exists(path):
        cached = torch.load(path, weights_only=True)
        return {**cached, "tokenizer": Tokenizer.from_str(cached.pop("tokenizer_json"))}
    text = load_text(files)
    tokenizer = train_tokenizer(text, vocab_size)
    cached = {
        "ids": torch.tensor(tokenizer.encode(text).ids, dtype=torch.long),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "characters": len(text),
        "tokenizer_json": tokenizer.to_str(),
    }
    temporary = f"{path}.tmp{os.getpid()}"
    torch.save(cached, temporary)
    os.replace(temporary, path)  # whole or absent, whoever reads it
    return {**cached, "tokenizer": tokenizer}


def load_corpus(text_files: str, vocab_size: int, block_size: int, val_fraction: float) -> dict:
    """Everything a language-model run needs: tokenizer, train and validation blocks, and provenance."""
    files, name = corpus_files(text_files)
    corpus = tokenized(files, vocab_size)
    ids, tokenizer = corpus["ids"], corpus["tokenizer"]
    n_val = int(len(ids) * val_fraction)
    train, val = (
        make_blocks(ids[: len(ids) - n_val], block_size),
        make_blocks(ids[len(ids) - n_val :], block_size),
    )
    if len(train[0]) == 0 or len(val[0]) == 0:
        raise UsageError(
            f"the corpus ({len(ids)} tokens) is too short for --block_size {block_size} with "
            f"--val_fraction {val_fraction}: use a smaller block or more text"
        )
    return {
        "tokenizer": tokenizer,
        "train": train,
        "val": val,
        "name": name,
        "files": files,
        "sha256": corpus["sha256"],
        "characters": corpus["characters"],
        "tokens": len(ids),
        "characters_per_token": corpus["characters"] / len(ids),
        "vocab_size": tokenizer.get_vocab_size(),
    }


def shard_rows(tensors: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s contiguous share of the rows, every share the same size (the remainder dropped):
    equal shards make the mean of per-rank means the global mean, and every rank run the same number
    of collectives."""
    per_rank = len(tensors[0]) // world_size
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in tensors)
