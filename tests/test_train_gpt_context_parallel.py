"""Context parallelism (strategies/cp.py): attention over all-gathered key/value chunks, merged by their
log-sum-exp, equals full-sequence attention in one process, forward and backward (no ranks: the chunk plan,
the merge and the hand-written backward are plain tensor code); train_gpt --strategy cp on forked ranks
passes every check, keeps fewer activation bytes per rank than one process does for the same rows, and each
mistake fails its check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from experiments.train_gpt import main
from helpers import GPT_DISTRIBUTED_CHECKS, GPT_TINY, assert_gpt_passed, fork_launch, tiny_gpt_kept_bytes
from strategies.cp import ChunkedAttention, chunks_of, plan_for


def chunked_attention(q, k, v, cp: int, balanced: bool, without_lse: bool = False):
    """What every cp rank computes, all in one process: each rank's query chunks (its local tokens) over the
    keys and values gathered in rank order, put back in sequence order."""
    size = q.shape[2] // (2 * cp)
    holders = [chunks_of(r, cp, balanced) for r in range(cp)]

    def local(t, chunks):
        return torch.cat([t[:, :, c * size : (c + 1) * size] for c in chunks], dim=2)

    k_all = torch.cat([local(k, chunks) for chunks in holders], dim=2)
    v_all = torch.cat([local(v, chunks) for chunks in holders], dim=2)
    pieces = {}
    for chunks in holders:
        out = ChunkedAttention.apply(
            local(q, chunks), k_all, v_all, plan_for(chunks, holders, size), without_lse
        )
        for j, c in enumerate(chunks):
            pieces[c] = out[:, :, j * size : (j + 1) * size]
    return torch.cat([pieces[c] for c in range(2 * cp)], dim=2)


@pytest.mark.parametrize(("cp", "balanced"), [(2, True), (2, False), (4, True)])
def test_chunked_attention_merged_by_log_sum_exp_is_full_attention_forward_and_backward(cp, balanced):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 32, 8, generator=generator, requires_grad=True) for _ in "qkv")
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    chunked = chunked_attention(q, k, v, cp, balanced)
    assert (chunked - full).abs().max() < 1e-6  # float32
    weights = torch.randn(full.shape, generator=generator)
    full_grads = torch.autograd.grad((full * weights).sum(), (q, k, v))
    chunked_grads = torch.autograd.grad((chunked * weights).sum(), (q, k, v))
    assert max((a - b).abs().max() for a, b in zip(full_grads, chunked_grads, strict=True)) < 1e-5
    # the mistake: partial outputs averaged, not rescaled by their log-sum-exp
    assert (chunked_attention(q, k, v, cp, balanced, without_lse=True) - full).abs().max() > 1e-2


def test_each_rank_holds_a_head_and_a_tail_chunk_so_the_work_is_even():
    assert [chunks_of(r, 4, True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # key chunks each rank's queries attend to (chunk c sees c + 1): 9 on every rank, balanced; 3 to 15 not
    work = [[sum(c + 1 for c in chunks_of(r, 4, balanced)) for r in range(4)] for balanced in (True, False)]
    assert work == [[9, 9, 9, 9], [3, 7, 11, 15]]


@pytest.mark.launch
def test_context_parallel_matches_one_process_and_sends_the_theory(tmp_path):
    finished = fork_launch(main, [*GPT_TINY, "--strategy", "cp"], tmp_path / "run")
    summary = assert_gpt_passed(finished, 2)
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    metrics = summary["metrics"]
    counted = metrics["communication"]["counted"]
    whole = 4 * 32 * 32 * 4  # K (or V) of the whole sequence: 4 rows x 32 tokens x width 32, float32
    assert (
        counted["calls"]["all_gather"] == 2 * 2 and counted["bytes"]["all_gather"] == 2 * 2 * whole
    )  # K, V x 2 blocks
    assert counted["bytes"]["reduce_scatter"] == 2 * 2 * whole  # their gradients, back to their owners
    assert len(metrics["attention_s_per_rank"]) == 2 and metrics["attention_imbalance"] >= 1
    kept = [held["saved_activation_bytes"] for held in metrics["bytes_per_rank"]]
    assert kept[0] == kept[1] < tiny_gpt_kept_bytes()  # half the tokens each (the gathered K, V whole)


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["cp_merge_without_lse", "cp_causal_mask_not_shifted"])
def test_each_context_parallel_mistake_fails_the_parity_check(tmp_path, variant):
    args = [*GPT_TINY, "--strategy", "cp", "--wrong_variant", variant, "--max_steps", "6"]
    finished = fork_launch(main, args, tmp_path / "run")
    assert finished.returncode == 1, finished.stderr[-3000:]
    failed = {name for name, check in finished.summary["checks"].items() if not check["passed"]}
    assert "matches_single_process" in failed


def test_the_long_context_benchmark_refuses_a_context_it_cannot_split(capsys):
    from benchmarks.long_context import main as long_context_main

    with pytest.raises(SystemExit) as stop:
        long_context_main(["--context", "1022"])
    assert stop.value.code == 2 and "--context must be a multiple of 4" in capsys.readouterr().err


@pytest.mark.launch
def test_two_context_parallel_groups_read_their_own_samples(tmp_path):
    """cp x dp on 4 ranks: ranks 0, 1 split the sequences of data-parallel group 0, ranks 2, 3 those of group 1."""
    finished = fork_launch(
        main, [*GPT_TINY, "--strategy", "cp", "--dp_replicate", "2"], tmp_path / "run", num_processes=4
    )
    metrics = assert_gpt_passed(finished, 4)["metrics"]
    assert metrics["layout"]["dp_replicate"] == 2 and len(metrics["attention_s_per_rank"]) == 4
