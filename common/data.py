"""Data for the experiments, built with Hugging Face `datasets`, read as in-memory tensor slices.

Two sources, one shape (a Dataset with a list column `x` and a float column `y`):
- `make_regression_dataset`: y = X·w* + b* + noise, seeded, with the ground truth returned;
- `load_table`: any local csv / json / jsonl / parquet file through `datasets.load_dataset`.

Why no DataLoader: a DataLoader over a Dataset fetches rows one by one (we measured 33k samples/s
at batch 32, against 164k for slices of in-memory tensors). Each rank instead takes its contiguous
shard once as tensors and slices batches from it. Sharding happens HERE only: do not also pass a
DataLoader to `accelerator.prepare`, or every rank gets a shard of its shard.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if (
    TYPE_CHECKING
):  # imported where used: `datasets` costs ~1 s per process, and train_gpt needs only the stream
    from datasets import Dataset

from common.config import UsageError

FILE_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def require_memory(flag_name: str, bytes_needed: float, what: str = "the data") -> None:
    """Refuse, naming the flag, a size whose tensors cannot fit in the memory this machine has free
    (instead of a MemoryError traceback, or the kernel killing the run halfway)."""
    import psutil

    available = psutil.virtual_memory().available
    if bytes_needed > available:
        raise UsageError(
            f"--{flag_name}: {what} would need about {bytes_needed / 2**30:.1f} GiB of memory, "
            f"this machine has {available / 2**30:.1f} GiB free; use a smaller size"
        )


def make_regression_dataset(
    n_samples: int, n_features: int, noise_std: float, seed: int
) -> tuple[Dataset, dict]:
    """Synthetic linear regression; returns the dataset and the truth {"weight": [...], "bias": b}."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    true_weight = torch.randn(n_features, generator=generator)
    true_bias = torch.randn(1, generator=generator)
    features = torch.randn(n_samples, n_features, generator=generator)
    targets = features @ true_weight + true_bias + noise_std * torch.randn(n_samples, generator=generator)
    dataset = Dataset.from_dict({"x": features.numpy(), "y": targets.numpy()})
    return dataset, {"weight": true_weight.tolist(), "bias": true_bias.item()}


def load_table(path: str, target_column: str = "y", feature_columns: str = "") -> Dataset:
    """A local table -> Dataset(x, y). `feature_columns` is comma-separated; empty means every other column."""
    from datasets import Dataset, load_dataset

    extension = os.path.splitext(path)[1].lower()
    if extension not in FILE_FORMATS:
        raise UsageError(
            f"--data_file {path!r}: unsupported extension {extension!r}; allowed: {', '.join(FILE_FORMATS)}"
        )
    if not os.path.isfile(path):
        raise UsageError(f"--data_file {path!r}: no such file")
    try:
        table = load_dataset(FILE_FORMATS[extension], data_files=os.path.abspath(path), split="train")
    except Exception as error:  # datasets raises many types for a malformed file; the user needs one line
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"--data_file {path!r}: could not be read as {FILE_FORMATS[extension]}: {reason}"
        ) from None
    columns = table.column_names
    if target_column not in columns:
        raise UsageError(
            f"--data_file {path!r} has no target column {target_column!r}; its columns: {', '.join(columns)}"
        )
    wanted = [c.strip() for c in feature_columns.split(",") if c.strip()] or [
        c for c in columns if c != target_column
    ]
    if target_column in wanted:
        raise UsageError(
            f"--feature_columns lists the target column {target_column!r}: a model that sees its target learns nothing"
        )
    missing = [c for c in wanted if c not in columns]
    if missing or not wanted:
        raise UsageError(
            f"--data_file {path!r}: feature columns {missing or wanted} not found; its columns: {', '.join(columns)}"
        )
    if len(table) == 0:
        raise UsageError(f"--data_file {path!r} has no rows")
    numeric = ("int", "uint", "float", "bool")
    not_numeric = [
        c for c in [*wanted, target_column] if not getattr(table.features[c], "dtype", "").startswith(numeric)
    ]
    if not_numeric:
        kinds = ", ".join(
            f"{c}: {getattr(table.features[c], 'dtype', table.features[c])}" for c in not_numeric
        )
        raise UsageError(f"--data_file {path!r}: columns must all be numeric, but {kinds}")
    tensors = table.with_format("torch", columns=[*wanted, target_column])[:]
    features = torch.stack([tensors[c].to(torch.float32) for c in wanted], dim=1)
    targets = tensors[target_column].to(torch.float32)
    if not torch.isfinite(features).all() or not torch.isfinite(targets).all():
        raise UsageError(f"--data_file {path!r}: contains empty or non-finite values")
    return Dataset.from_dict({"x": features.numpy(), "y": targets.numpy()})


def shard_rows(tensors: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s contiguous share of the rows, every share the same size (the remainder dropped):
    equal shards make the mean of per-rank means the global mean (DDP's gradient average equals the global
    mean only then), and every rank run the same number of collectives."""
    per_rank = len(tensors[0]) // world_size
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in tensors)


def on_device(tensors: tuple[torch.Tensor, ...], device) -> tuple[torch.Tensor, ...]:
    """A batch from the host onto the run's device (a no-op where it already is: the CPU keeps the very tensors,
    views of the global batch; Accelerate's send_to_device names the CPU cpu:0 and copies them there)."""
    return tuple(t.to(device, non_blocking=True) for t in tensors)


IGNORED_TARGET = -100  # cross_entropy's ignore_index: a target that scores nothing


def padded_share(
    rows: tuple[torch.Tensor, torch.Tensor], rank: int, parts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s contiguous share of (inputs, targets) when EVERY row must count (an evaluation): ceil(rows /
    parts) rows each, the last shares padded with copies of the first row whose targets are IGNORED_TARGET. Every
    rank runs the same batches (FSDP all-gathers in each forward), and the padding scores nothing, so the mean
    over the scored tokens is the same on any number of ranks (201 rows on 2: 101 + 100 and one padding row)."""
    inputs, targets = rows
    per_part = -(-len(inputs) // parts)
    start, end = min(rank * per_part, len(inputs)), min((rank + 1) * per_part, len(inputs))
    padding = per_part - (end - start)
    padded_targets = torch.full_like(targets[:1], IGNORED_TARGET).expand(padding, -1)
    return (torch.cat([inputs[start:end], inputs[:1].expand(padding, -1)]),
            torch.cat([targets[start:end], padded_targets]))  # fmt: skip


def dataset_tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """A Dataset(x, y) as (x, y) float32 tensors, y a column."""
    columns = dataset.with_format("torch")[:]
    return columns["x"].to(torch.float32).reshape(len(dataset), -1), columns["y"].to(torch.float32).reshape(
        -1, 1
    )


def shard_tensors(dataset: Dataset, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s contiguous shard of a Dataset(x, y) as tensors (shard_rows)."""
    return shard_rows(dataset_tensors(dataset), rank, world_size)


def iterate_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int, start_batch: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of one shard: reshuffled each epoch (seeded by seed and epoch), last partial batch
    dropped. `start_batch` skips that many batches (a resumed run continues where the checkpoint was),
    computing the epoch and offset rather than producing the skipped batches."""
    if len(x) < batch_size:  # checked now, not at the first next(), so the error comes before training starts
        raise UsageError(
            f"a rank's shard has {len(x)} rows, fewer than the batch size {batch_size}: "
            "use fewer ranks, more data or a smaller batch"
        )

    batches_per_epoch = len(x) // batch_size

    def endless_batches():
        epoch, first = divmod(start_batch, batches_per_epoch)
        while True:
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
            order = order.to(x.device)  # the rows' device: index_select takes no host index for device rows
            if batch_size < 256:  # small batches: one gather per epoch, then slices (views) cost ~1 µs each
                x_epoch, y_epoch = x[order], y[order]
                for index in range(first, batches_per_epoch):
                    start = index * batch_size
                    yield x_epoch[start : start + batch_size], y_epoch[start : start + batch_size]
            else:  # large batches: gather each batch alone, still in cache when used (2x faster at 1024, measured)
                for index in range(first, batches_per_epoch):
                    rows = order[index * batch_size : (index + 1) * batch_size]
                    yield x.index_select(0, rows), y.index_select(0, rows)
            epoch, first = epoch + 1, 0

    return endless_batches()


def iterate_global_batches(dataset: Dataset, world_size: int, per_rank_batch_size: int, seed: int):
    """What all ranks see at each step, concatenated in rank order: the single-process reference's batches."""
    shards = [shard_tensors(dataset, rank, world_size) for rank in range(world_size)]
    return concatenate_rank_batches(shards, per_rank_batch_size, seed)


def concatenate_rank_batches(
    shards: list[tuple[torch.Tensor, torch.Tensor]], per_rank_batch_size: int, seed: int
):
    """Every rank's batches from its own shard, concatenated in rank order: one global batch per micro-step."""
    per_rank = [iterate_batches(x, y, per_rank_batch_size, seed) for x, y in shards]
    for rank_batches in zip(*per_rank, strict=True):
        yield torch.cat([b[0] for b in rank_batches]), torch.cat([b[1] for b in rank_batches])


def iterate_sample_stream(
    x: torch.Tensor, y: torch.Tensor, global_batch_size: int, seed: int, start_sample: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless GLOBAL batches from one stream of samples: epoch e is a seeded permutation of all rows,
    epochs follow each other, and batch i holds samples start_sample + i*B ... + B - 1 of that stream
    (a batch may straddle two epochs). Each data-parallel rank then takes its rows of every batch
    (shard_rows). A position is a number of samples, so a run resumed at another world size (another
    global batch B) continues exactly where the checkpoint left the data, mid-epoch or not; the
    one-process reference takes the whole batches."""
    if len(x) < global_batch_size:
        raise UsageError(
            f"the data has {len(x)} rows, fewer than the global batch {global_batch_size}: "
            "use fewer ranks, more data or a smaller batch"
        )

    def permutation(epoch: int) -> torch.Tensor:
        return torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))

    def endless_batches():
        position = start_sample
        epoch, order = position // len(x), permutation(position // len(x))
        while True:
            rows = []
            while len(rows) < global_batch_size:
                if position // len(x) != epoch:
                    epoch, order = position // len(x), permutation(position // len(x))
                take = min(global_batch_size - len(rows), len(x) - position % len(x))
                rows.extend(order[position % len(x) : position % len(x) + take].tolist())
                position += take
            index = torch.tensor(rows)
            yield x.index_select(0, index), y.index_select(0, index)

    return endless_batches()
