"""Real text, with nothing downloaded: a corpus, a BPE tokenizer trained here, fixed-length blocks.

- The corpus: CPython's own `pydoc_data/topics.py` (~465k characters of English reference prose,
  shipped with every Python; its text changes with the Python version, so its sha256 is recorded),
  or your files with --text_files a.txt,b.txt. Either way it is read through Hugging Face `datasets`
  (`load_dataset("text", ...)`), line by line.
- The tokenizer: a byte-level BPE that Hugging Face `tokenizers` trains on the corpus (vocab 2048 on
  pydoc topics: ~0.7 s, 3.6 characters per token, exact round trip, the same tokenizer every time),
  cached by corpus hash and vocab size under runs/.cache/; the token ids are cached beside it, by the
  files' bytes and the vocab size. Whoever finds no cache builds it under a file lock while the
  others wait (ranks, or runs side by side): it works before any process group exists.
- The corpus's identity: the sha256 of the files' bytes and of the tokenizer. A checkpoint records
  both, and a resume on other text (or another tokenizer) is refused naming both hashes.
- The blocks: the token stream cut into non-overlapping windows of block_size + 1 tokens; x is a
  window's first block_size tokens, y the same shifted by one. The last --val_fraction of the stream
  is held out for validation.
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import hashlib
import os
import sys
import time

import torch

from common.config import UsageError, require

CACHE_DIR = os.path.join("runs", ".cache", "text")
MIN_CHARACTERS = 1000


def check_text_file(path: str) -> None:
    """One line for a --text_files entry that is no use: missing, a folder, unreadable, empty, not UTF-8
    text (a binary file), read in 1 MiB pieces so that a large file costs no memory."""
    if not os.path.exists(path):
        raise UsageError(f"--text_files: {path!r} is not a file")
    if not os.path.isfile(path):
        raise UsageError(f"--text_files: {path!r} is not a file (a folder?)")
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                if b"\0" in chunk:
                    raise UsageError(
                        f"--text_files: {path!r} is not text (a NUL byte at offset {offset + chunk.index(0):,})"
                    )
                decoder.decode(chunk)
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except OSError as error:
        raise UsageError(f"--text_files: {path!r} cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise UsageError(
            f"--text_files: {path!r} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
            f"{offset + error.start:,})"
        ) from None
    if offset == 0:
        raise UsageError(f"--text_files: {path!r} is empty")


def corpus_files(text_files: str) -> tuple[list[str], str]:
    """(files, a name for the corpus): --text_files, or pydoc topics written once into the cache."""
    if text_files:
        files = [f.strip() for f in text_files.split(",") if f.strip()]
        if not files:
            raise UsageError(f"--text_files {text_files!r}: no file named")
        for path in files:
            check_text_file(path)
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
    import datasets

    # no "Generating train split" bar: a refusal that follows must stay one line (restored after)
    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        lines = datasets.load_dataset("text", data_files=files, split="train", keep_in_memory=True)["text"]
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    text = "\n".join(lines)
    if len(text) < MIN_CHARACTERS:
        raise UsageError(
            f"--text_files: the corpus has {len(text)} characters; give it at least {MIN_CHARACTERS:,}"
        )
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


@contextlib.contextmanager
def cache_lock(timeout_s: float):
    """An exclusive lock on the cache folder, waited for at most timeout_s: one process builds a cache
    entry while the others wait, then read it (ranks need no process group for this)."""
    os.makedirs(CACHE_DIR, exist_ok=True)
    descriptor = os.open(os.path.join(CACHE_DIR, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UsageError(
                        f"waited {timeout_s:.0f} s for another process building the token cache in {CACHE_DIR}; "
                        "is a run stuck? (--dist_timeout_s bounds this wait)"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(descriptor)  # drops the lock


def files_sha256(files: list[str]) -> str:
    """sha256 of the files' bytes, in order (each followed by a NUL): the corpus's content identity."""
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def tokenized(files: list[str], vocab_size: int, timeout_s: float = 600) -> dict:
    """The corpus as token ids, with its tokenizer: read through `datasets`, tokenized once, then cached by
    (the files' bytes, vocab size): a later run, and every rank after the first, loads ids instead of
    importing datasets and re-encoding (~2 s per process here)."""
    data_sha256 = files_sha256(files)
    path = os.path.join(CACHE_DIR, f"tokens-{data_sha256[:16]}-{vocab_size}.pt")
    cached = read_token_cache(path, data_sha256, say_why=True)
    if cached is None:
        with cache_lock(timeout_s):
            cached = read_token_cache(path, data_sha256)  # built by another process while this one waited?
            if cached is None:
                build_token_cache(files, vocab_size, path)
                cached = read_token_cache(path, data_sha256)
    return cached


def build_token_cache(files: list[str], vocab_size: int, path: str) -> None:
    text = load_text(files)
    tokenizer = train_tokenizer(text, vocab_size)
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    cached = {
        "ids": ids,
        "ids_sha256": tensor_sha256(ids),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "characters": len(text),
        "tokenizer_json": tokenizer.to_str(),
    }
    temporary = f"{path}.tmp{os.getpid()}"
    torch.save(cached, temporary)
    os.replace(temporary, path)  # whole or absent, whoever reads it


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def read_token_cache(path: str, data_sha256: str, say_why: bool = False) -> dict | None:
    """The cached corpus, or None when there is none, or it is unreadable or its token ids are not the ones
    it was written with (a damaged cache is rebuilt over, never trained on)."""
    from tokenizers import Tokenizer

    if not os.path.exists(path):
        return None
    try:
        cached = torch.load(path, weights_only=True)
        if "ids_sha256" not in cached:
            return None  # written before the ids carried their digest: rebuilt, nothing to say
        if tensor_sha256(cached["ids"]) != cached["ids_sha256"]:
            raise ValueError("token ids changed since they were cached")
    except Exception as error:  # a truncated file, flipped bits
        if say_why:
            print(
                f"token cache {path} is unusable ({type(error).__name__}: {error}); rebuilding it",
                file=sys.stderr,
            )
        return None
    tokenizer_json = cached.pop("tokenizer_json")
    identity = {
        "data_sha256": data_sha256,
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
    }
    return {**cached, "tokenizer": Tokenizer.from_str(tokenizer_json), "identity": identity}


MIN_VOCAB = 260  # the byte-level BPE's 256 bytes, plus merges


def require_vocabulary(vocab_size: int) -> None:
    """A vocabulary the BPE can be trained to, refused in one line otherwise (every experiment on the corpus)."""
    require(
        vocab_size >= MIN_VOCAB, f"--vocab_size must be >= {MIN_VOCAB} (256 bytes + merges), got {vocab_size}"
    )


def load_corpus(
    text_files: str, vocab_size: int, block_size: int, val_fraction: float, timeout_s: float = 600
) -> dict:
    """Everything a language-model run needs: tokenizer, train and validation blocks, provenance, and the
    identity (content hashes of the files and the tokenizer) that its checkpoints are tied to."""
    files, name = corpus_files(text_files)
    corpus = tokenized(files, vocab_size, timeout_s)
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
        "identity": corpus["identity"],
    }
