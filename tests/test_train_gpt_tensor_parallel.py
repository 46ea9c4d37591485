"""train_gpt's tensor parallelism for real: two mistakes in tp are caught, and sequence parallelism sends what
tp sends and keeps less. (tp's own correct run is asserted in test_compare_strategies.py, which runs it beside
one process; FSDP x TP on 4 ranks in test_train_gpt_layouts.py. A file of its own: pytest-xdist hands out whole
files, and these runs take a minute.)"""

from __future__ import annotations

import pytest

from experiments.train_gpt import main
from helpers import GPT_TINY, assert_gpt_passed, fork_launch


@pytest.mark.launch
@pytest.mark.parametrize(
    ("strategy", "variant", "num_processes", "failing"),
    [
        (
            "tp",
            "row_parallel_without_all_reduce",
            2,
            {"communication_volume", "matches_single_process", "grad_norm_is_global"},
        ),
        # on 2 ranks, not fsdp_tp's 4: the same mistake, caught by the same checks, for half the processes
        ("tp", "seed_per_rank", 2, {"matches_single_process", "grad_norm_is_global"}),
    ],
)
def test_tensor_parallel_mistakes_are_caught(tmp_path, strategy, variant, num_processes, failing):
    # 6 steps, parity over 4: a mistake needs no more to show, and tp's steps are the suite's slowest
    args = [
        *GPT_TINY,
        "--strategy",
        strategy,
        "--wrong_variant",
        variant,
        "--max_steps",
        "6",
        "--parity_steps",
        "4",
    ]
    finished = fork_launch(main, args, tmp_path / "run", num_processes=num_processes)
    assert finished.returncode == 1
    checks = finished.summary["checks"]
    assert {name for name, check in checks.items() if not check["passed"]} == failing


@pytest.mark.launch
def test_sequence_parallelism_sends_what_tp_sends_and_keeps_less(tmp_path):
    """tp with and without --sequence_parallel, side by side: both match one process; SP's all-reduces
    become all-gathers and reduce-scatters (counted = its theory), about the same bytes on the wire, and
    each rank keeps fewer activation bytes (the LayerNorms and the residual stream on half the tokens)."""
    runs = {}
    for name, extra in (("tp", []), ("sp", ["--sequence_parallel"])):
        args = [
            *GPT_TINY,
            "--strategy",
            "tp",
            "--max_steps",
            "6",
            "--parity_steps",
            "4",
            "--min_loss_drop",
            "0",
            *extra,
        ]
        finished = fork_launch(main, args, tmp_path / name)
        runs[name] = assert_gpt_passed(finished, 2)["metrics"]
    activation = 4 * 32 * 32 * 4  # 4 rows x 32 tokens x width 32, float32
    sp = runs["sp"]["communication"]["counted"]
    assert sp["calls"] == {"all_reduce": 1, "all_gather": 4 * 2 + 2 + 1, "reduce_scatter": 4 * 2 + 1}
    assert sp["bytes"]["reduce_scatter"] == (4 * 2 + 1) * activation
    wire = {name: runs[name]["communication"]["theory"]["wire_bytes"] for name in runs}
    assert wire["sp"] == wire["tp"] + activation / 2  # + the head's input, gathered and scattered back
    kept = {name: runs[name]["bytes_per_rank"][0]["saved_activation_bytes"] for name in runs}
    assert kept["sp"] < kept["tp"]


@pytest.mark.launch
def test_compiled_blocks_pass_every_check_under_tensor_parallelism(tmp_path):
    """--compile (torch.compile per block, Inductor): the run still matches one process, and holds and sends what
    the theory says (the collectives DTensor issues around and inside the compiled blocks counted as ever)."""
    args = [*GPT_TINY, "--strategy", "tp", "--compile", "--max_steps", "6", "--parity_steps", "4"]
    summary = assert_gpt_passed(fork_launch(main, args, tmp_path / "run"), 2)
    assert summary["config"]["compile"] is True and summary["metrics"]["first_step_ms"] > 0


@pytest.mark.launch
def test_sequence_parallelism_under_a_pipeline_sends_each_rank_its_own_tokens(tmp_path):
    """pp 2 x tp 2 with --sequence_parallel: a stage hands the next its last block's local tokens (each
    tensor-parallel rank its half of the sequence: Megatron's scatter-gather), the next stage's first block takes
    them as they are; the run matches one process, and every rank holds and sends its theory: half the pipeline's
    bytes of pp 2 x tp 2 without it."""
    sends = {}
    for name, extra in (("tp", []), ("sp", ["--sequence_parallel"])):
        args = [*GPT_TINY, "--pp", "2", "--tp", "2", "--max_steps", "6", "--parity_steps", "4", "--min_loss_drop",
                "0", *extra]  # fmt: skip
        summary = assert_gpt_passed(fork_launch(main, args, tmp_path / name, num_processes=4), 4)
        assert summary["checks"]["communication_volume"]["passed"]
        sends[name] = summary["metrics"]["communication"]["counted"]["bytes"]["send"]
    # 4 micro-batches of 1 row x 32 tokens x width 32 in float32 each way; under SP 16 of the tokens
    assert sends == {"tp": 4 * 32 * 32 * 4, "sp": 4 * 16 * 32 * 4}
