"""Unit tests of common/data.py: synthetic truth, local files, sharding, batch order."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from common.config import UsageError
from common.data import (
    iterate_batches,
    iterate_global_batches,
    load_table,
    make_regression_dataset,
    shard_tensors,
)


def test_synthetic_is_seeded_and_follows_its_truth():
    dataset, truth = make_regression_dataset(200, 4, noise_std=0.0, seed=3)
    again, truth_again = make_regression_dataset(200, 4, noise_std=0.0, seed=3)
    assert truth == truth_again and dataset["y"] == again["y"]
    x, y = shard_tensors(dataset, 0, 1)
    assert x.shape == (200, 4) and y.shape == (200, 1)
    expected = x @ torch.tensor(truth["weight"]) + truth["bias"]
    torch.testing.assert_close(y.squeeze(1), expected, atol=1e-5, rtol=0)
    _, other_truth = make_regression_dataset(200, 4, noise_std=0.0, seed=4)
    assert other_truth != truth


def test_shards_are_equal_disjoint_and_cover_the_data():
    dataset, _ = make_regression_dataset(103, 2, noise_std=0.1, seed=0)  # 103 = 3 x 34 + 1: one row dropped
    shards = [shard_tensors(dataset, rank, 3)[0] for rank in range(3)]
    assert [len(s) for s in shards] == [34, 34, 34]
    full = shard_tensors(dataset, 0, 1)[0]
    torch.testing.assert_close(torch.cat(shards), full[:102], rtol=0, atol=0)


def test_batches_reshuffle_each_epoch_and_drop_the_partial_batch():
    x = torch.arange(10, dtype=torch.float32).reshape(10, 1)
    batches = iterate_batches(x, x.clone(), batch_size=4, seed=0)
    epoch_one = [next(batches)[0] for _ in range(2)]  # 10 rows -> 2 full batches of 4
    epoch_two = [next(batches)[0] for _ in range(2)]
    assert all(len(b) == 4 for b in epoch_one + epoch_two)
    assert len(set(torch.cat(epoch_one).flatten().tolist())) == 8  # no row twice within an epoch
    assert not torch.equal(torch.cat(epoch_one), torch.cat(epoch_two))
    again = iterate_batches(x, x.clone(), batch_size=4, seed=0)
    assert torch.equal(next(again)[0], epoch_one[0])  # seeded: the same order every time


def test_global_batch_is_the_ranks_batches_in_rank_order():
    dataset, _ = make_regression_dataset(64, 3, noise_std=0.1, seed=1)
    global_batches = iterate_global_batches(dataset, world_size=2, per_rank_batch_size=4, seed=5)
    rank_batches = [iterate_batches(*shard_tensors(dataset, r, 2), 4, 5) for r in range(2)]
    for _ in range(5):
        gx, gy = next(global_batches)
        parts = [next(b) for b in rank_batches]
        assert torch.equal(gx, torch.cat([p[0] for p in parts])) and torch.equal(
            gy, torch.cat([p[1] for p in parts])
        )


def test_too_few_rows_per_rank_is_a_usage_error():
    x = torch.zeros(3, 2)
    with pytest.raises(UsageError, match="fewer than the batch size 4"):
        iterate_batches(x, x, batch_size=4, seed=0)


@pytest.mark.parametrize("extension", [".csv", ".json", ".jsonl", ".parquet"])
def test_load_table_reads_every_local_format(tmp_path, extension):
    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0], "b": [0.5, 0.0, -1.0], "y": [2.0, 4.0, 6.0]})
    path = tmp_path / f"table{extension}"
    if extension == ".csv":
        frame.to_csv(path, index=False)
    elif extension == ".parquet":
        frame.to_parquet(path)
    else:
        path.write_text("\n".join(json.dumps(row) for row in frame.to_dict("records")))
    x, y = shard_tensors(load_table(str(path)), 0, 1)
    torch.testing.assert_close(x, torch.tensor(frame[["a", "b"]].values, dtype=torch.float32))
    torch.testing.assert_close(y.squeeze(1), torch.tensor(frame["y"].values, dtype=torch.float32))
    x_only_a, _ = shard_tensors(load_table(str(path), feature_columns="a"), 0, 1)
    assert x_only_a.shape == (3, 1)


@pytest.mark.parametrize(
    ("content", "name", "kwargs", "message"),
    [
        (None, "absent.csv", {}, "no such file"),
        ("a,b\n1,2\n", "t.txt", {}, "unsupported extension '.txt'"),
        ("a,b\n1,2\n", "t.csv", {}, "no target column 'y'; its columns: a, b"),
        ("a,y\n1,2\n", "t.csv", {"feature_columns": "a,zz"}, "feature columns ['zz'] not found"),
        ("a,y\nhello,2\n", "t.csv", {}, "must all be numeric"),
        ("{not json", "t.json", {}, "could not be read as json"),
        ("a,y\n", "t.csv", {}, "could not be read as csv"),  # datasets: 'corresponds to no data'
        ("a,y\n1,\n", "t.csv", {}, "empty or non-finite"),
    ],
)
def test_bad_tables_are_usage_errors(tmp_path, content, name, kwargs, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        load_table(str(path), **kwargs)


@pytest.mark.parametrize("batch_size", [32, 256])
def test_small_and_large_batches_follow_the_same_seeded_order(batch_size):
    """Small batches slice a gathered epoch, large ones gather per batch: the rows must be the same."""
    x = torch.arange(2048, dtype=torch.float32).reshape(1024, 2)
    y = torch.arange(1024, dtype=torch.float32).reshape(1024, 1)
    batches = iterate_batches(x, y, batch_size, seed=7)
    for epoch in range(2):
        order = torch.randperm(1024, generator=torch.Generator().manual_seed(7 * 100_003 + epoch))
        for start in range(0, 1024 - batch_size + 1, batch_size):
            xb, yb = next(batches)
            assert torch.equal(xb, x[order][start : start + batch_size]) and torch.equal(
                yb, y[order][start : start + batch_size]
            )
    resumed = iterate_batches(
        x, y, batch_size, seed=7, start_batch=1024 // batch_size + 1
    )  # epoch 1, batch 1
    order = torch.randperm(1024, generator=torch.Generator().manual_seed(7 * 100_003 + 1))
    assert torch.equal(next(resumed)[0], x[order][batch_size : 2 * batch_size])
