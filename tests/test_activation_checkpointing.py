"""Activation checkpointing (common/activations.py, train_gpt --activation_checkpointing): in one process the
bytes kept for backward and the FLOPs recomputed equal the theory to the byte and the FLOP, and the gradients
are bitwise none's (benchmarks/activation_checkpointing.py --quick); under real strategies on forked ranks
every check still passes: one process's losses and parameters, the bytes sent (tp's full recompute runs its
attention all-reduce again, and its theory says so)."""

from __future__ import annotations

import json

import pytest

from benchmarks.activation_checkpointing import main as trade_main
from experiments.train_gpt import main
from helpers import GPT_DISTRIBUTED_CHECKS, GPT_TINY, assert_gpt_passed, fork_launch, tiny_gpt_kept_bytes


def test_each_mode_keeps_and_recomputes_what_the_theory_says_and_changes_no_gradient(tmp_path, capsys):
    output = tmp_path / "trade.json"
    assert trade_main(["--quick", "--output", str(output)]) == 0
    modes = {row["mode"]: row for row in json.loads(output.read_text())["modes"]}
    for row in modes.values():
        assert row["kept_bytes"] == row["kept_bytes_theory"] and row["flops"] == row["flops_theory"], row
        assert row["gradients_equal_none"]
    none, full, selective = modes["none"], modes["full"], modes["selective"]
    assert full["kept_bytes"] < selective["kept_bytes"] < none["kept_bytes"]
    assert full["flops"] > none["flops"] == selective["flops"]  # selective saves every matmul's output
    assert "| full |" in capsys.readouterr().out


@pytest.mark.launch
@pytest.mark.parametrize(("strategy", "mode"), [("fsdp", "full"), ("tp", "full"), ("pp", "selective")])
def test_checkpointed_runs_still_match_one_process_and_send_the_theory(tmp_path, strategy, mode):
    args = [
        *GPT_TINY,
        "--strategy",
        strategy,
        "--activation_checkpointing",
        mode,
        "--max_steps",
        "8",
        "--parity_steps",
        "5",
    ]
    summary = assert_gpt_passed(fork_launch(main, args, tmp_path / "run"), 2)
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    kept = [held.get("saved_activation_bytes") for held in summary["metrics"]["bytes_per_rank"]]
    if (
        strategy == "fsdp"
    ):  # each rank keeps what one process keeps for its batch (gathered weights are no activation)
        assert kept == [tiny_gpt_kept_bytes(mode)] * 2 and kept[0] < tiny_gpt_kept_bytes("none")
    elif strategy == "tp":  # the checkpoints keep whole (all-reduced) block inputs: as much as one process
        assert kept == [tiny_gpt_kept_bytes(mode)] * 2
        calls = summary["metrics"]["communication"]["counted"]["calls"]
        assert calls["all_reduce"] == 4 * 2 + 2 + 2  # + one recomputed attention all-reduce per block
    else:  # pp's forward phase is the whole pipeline step: not counted
        assert kept == [None, None]
