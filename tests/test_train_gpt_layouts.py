"""train_gpt under composed layouts, for real on forked gloo ranks: every pair of dp_shard / tp / pp / cp on 4
ranks (2 x 2) and the 3-D layout dp_shard 2 x tp 2 x pp 2 on 8 ranks pass every check (one process's losses
and parameters, the global clip norm, each rank's bytes held and each rank's collectives to the byte against
the composed theory); the 3-D run's checkpoint continues the same run under --dp_shard 2 on 2 ranks and under
one process. Tiny runs (8 steps, 8 ranks share 2 cores); the 3-D run is shared by three tests."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from experiments.train_gpt import main
from helpers import GPT_DISTRIBUTED_CHECKS, GPT_TINY, assert_gpt_passed, fork_launch

# 4 blocks, so that a 2-stage pipeline of any schedule has blocks on both stages; 8 steps, parity over 4
LAYOUT_TINY = [*GPT_TINY, "--n_layer", "4", "--max_steps", "8", "--parity_steps", "4", "--log_every", "4"]
# what each dimension sends, in the theory's words (strategies/theory.py sent_bytes' by_dimension)
SENDS = {"dp_shard": {"all_gather", "reduce_scatter"}, "tp": {"all_reduce"}, "pp": {"send", "recv", "broadcast"},
         "cp": {"all_gather", "reduce_scatter"}}  # fmt: skip


# Llama's changes to GPT-2: grouped-query attention (4 query heads share 2 key/value heads), SwiGLU with its own
# width, RMSNorm, rotary positions, no biases, an untied head
LLAMA_SHAPED = ("--n_head 4 --n_kv_head 2 --mlp swiglu --d_ff 48 --norm rmsnorm --positions rope --bias false "
                "--tie_weights false").split()  # fmt: skip
LLAMA_PAIRS = (("tp", "cp"), ("dp_shard", "pp"))


@pytest.mark.launch
@pytest.mark.parametrize(
    "pair", list(itertools.combinations(("dp_shard", "tp", "pp", "cp"), 2)), ids="x".join
)
def test_every_pair_of_dimensions_on_four_ranks_passes_every_check(tmp_path, pair):
    """Two of the pairs train a Llama-shaped model instead (LLAMA_SHAPED): tp splits the key/value heads too, cp
    turns each rank's chunk by its own positions (rope) and gathers the few key/value heads; dp_shard and pp hold
    the gate projection and the untied head. (tp x cp has one data-parallel rank: 8 steps of 4 blocks take its
    validation loss down by 0.09.)"""
    degrees = [item for dim in pair for item in (f"--{dim}", "2")]
    shape = [*LLAMA_SHAPED, "--min_loss_drop", "0.05"] if pair in LLAMA_PAIRS else []
    summary = assert_gpt_passed(
        fork_launch(main, [*LAYOUT_TINY, *shape, *degrees], tmp_path / "run", num_processes=4), 4
    )
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    metrics = summary["metrics"]
    assert {dim: n for dim, n in metrics["layout"].items() if n > 1} == dict.fromkeys(pair, 2)
    # each dimension did its part on rank 0 (the checks hold every rank's counts to its theory)
    theory = metrics["communication"]["theory"]["by_dimension"]
    for dim in pair:
        assert SENDS[dim] <= {kind for kind, size in theory[dim].items() if size}, (dim, theory)


@pytest.fixture(scope="module")
def three_d(tmp_path_factory) -> Path:
    """dp_shard 2 x tp 2 x pp 2 on 8 ranks, 8 steps, a checkpoint at step 4 (and at the end)."""
    run = tmp_path_factory.mktemp("three_d") / "run"
    args = [*LAYOUT_TINY, "--dp_shard", "2", "--tp", "2", "--pp", "2", "--checkpoint_every", "4"]
    finished = fork_launch(main, args, run, num_processes=8)
    assert_gpt_passed(finished, 8)
    return run


@pytest.mark.launch
def test_three_dimensions_on_eight_ranks_pass_every_check(three_d):
    summary = json.loads((three_d / "summary.json").read_text())
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS and summary["passed"]
    metrics = summary["metrics"]
    held = [rank["params"] for rank in metrics["bytes_per_rank"]]
    # the two stages' 4 ranks each hold a quarter of their stage (2 tp x 2 dp_shard pieces): equal within a stage
    assert held[:4] == [held[0]] * 4 and held[4:] == [held[4]] * 4
    counted = metrics["communication"]["counted_per_rank"]
    assert all(
        set(c["bytes"]) >= {"all_gather", "reduce_scatter", "all_reduce", "send", "recv"} for c in counted
    )


@pytest.mark.launch
@pytest.mark.parametrize(
    ("ranks", "layout"),
    [
        (2, ["--dp_shard", "2"]),
        (1, ["--gradient_accumulation_steps", "2"]),
    ],  # the global batch kept: 8 samples
    ids=["dp_shard_2", "one_process"],
)
def test_the_three_d_checkpoint_continues_under_another_layout(three_d, tmp_path, ranks, layout):
    step_4 = three_d / "checkpoints" / "step_00000004"
    args = [*LAYOUT_TINY, "--resume_from_checkpoint", str(step_4), *layout]
    summary = assert_gpt_passed(fork_launch(main, args, tmp_path / "run", num_processes=ranks), ranks)
    checks = summary["checks"]
    assert checks["resume_restored_state"]["passed"]  # the state loaded is, by digest, the state saved
    assert summary["metrics"]["resumed_from_step"] == 4 and summary["metrics"]["samples_seen"] == 8 * 8
    if ranks > 1:  # from the checkpoint's state, the next 4 steps equal one process's
        assert checks["matches_single_process"]["passed"]
    uninterrupted = json.loads((three_d / "summary.json").read_text())["metrics"]["step_losses"]
    # the same run: the steps after the checkpoint are the uninterrupted run's (to float rounding)
    assert summary["metrics"]["step_losses"] == pytest.approx(uninterrupted[4:], abs=2e-5)


@pytest.mark.launch
@pytest.mark.parametrize(
    "degrees",
    [
        ["--dp_shard", "2", "--tp", "2", "--sequence_parallel"],
        ["--pp", "2", "--dp_shard", "2"],
        ["--dp_shard", "2", "--cp", "2"],
    ],
    ids=["dp_shard_x_tp_sp", "pp_x_dp_shard", "dp_shard_x_cp"],
)
def test_bf16_under_composed_layouts_sends_each_tensor_in_its_own_dtype(tmp_path, degrees):
    # FSDP's bf16 policy makes everything tp and pp send bf16 (the residual stream too), and FSDP all-reduces
    # sequence parallelism's partial norm gradients over tp: the communication check holds it to the byte
    args = [*LAYOUT_TINY, "--mixed_precision", "bf16", "--parity_steps_bf16", "4", *degrees]
    summary = assert_gpt_passed(fork_launch(main, args, tmp_path / "run", num_processes=4), 4)
    assert summary["checks"]["matches_single_process"]["passed"]
    assert summary["checks"]["communication_volume"]["passed"]
    counted = summary["metrics"]["communication"]["counted"]["bytes"]
    if (
        "--tp" in degrees
    ):  # the embedding's output (4 x 32 tokens x 32) and the 9 LayerNorms' weights and biases
        assert counted["all_reduce"] == 4 * 32 * 32 * 2 + 9 * 2 * 32 * 2
    elif "--pp" in degrees:  # a micro-batch of 1 row x 32 tokens x 32 wide, in bf16, 4 times each way
        assert counted["send"] == counted["recv"] == 4 * 32 * 32 * 2
    else:  # each of 4 blocks gathers K and V of the 4 x 32 tokens x 32 wide, bf16, and FSDP its gathered copies
        assert counted["all_gather"] > 4 * 2 * 4 * 32 * 32 * 2


@pytest.mark.launch
def test_sequence_parallelism_in_an_interleaved_pipeline_of_fsdp_ranks_in_bf16(tmp_path):
    # pp 2 (two stages a rank) x dp_shard 2 x tp 2 with SP: under the pipeline FSDP sums the micro-batches'
    # unsharded gradients in float32, so the norms' partial gradients are all-reduced over tp in float32, not in
    # the bf16 they are gathered in without a pipeline: the communication check holds it to the byte
    args = [*LAYOUT_TINY, "--mixed_precision", "bf16", "--parity_steps_bf16", "4", "--pp", "2", "--dp_shard", "2",
            "--tp", "2", "--sequence_parallel", "--pp_schedule", "interleaved_1f1b"]  # fmt: skip
    summary = assert_gpt_passed(fork_launch(main, args, tmp_path / "run", num_processes=8), 8)
    assert summary["checks"]["matches_single_process"]["passed"]
    assert summary["checks"]["communication_volume"]["passed"]
    # rank 0: its 2 blocks' 4 LayerNorms (weight and bias, width 32) in float32; the embedding's output (4
    # micro-batches of 1 row x 32 tokens x 32, bf16); the tied embedding's gradient with the last stage's rank
    # (its quarter of 512 x 32, float32)
    counted = summary["metrics"]["communication"]["counted"]["bytes"]["all_reduce"]
    assert counted == 4 * 2 * 32 * 4 + 4 * 32 * 32 * 2 + 512 * 32 // 4 * 4
