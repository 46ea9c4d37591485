"""train_gpt for real: every data-parallel strategy on 2 CPU ranks passes its checks, and each check is
shown failing on the wrong variant it exists for. Each strategy's correct run is launched once in the
suite (a launch costs ~20 s of CPU here): zero2 here; fsdp on 2 ranks (the uninterrupted run), on 3
ranks (uneven shards) and ddp in test_train_gpt_checkpoints.py; tp in test_compare_strategies.py;
fsdp_tp in test_train_gpt_tensor_parallel.py."""

from __future__ import annotations

import os

import pytest

from experiments.train_gpt import main
from helpers import (
    GPT_DISTRIBUTED_CHECKS,
    GPT_TINY,
    assert_data_parallel_facts,
    assert_gpt_passed,
    fork_launch,
    launch,
    run_in_process,
    run_main_in_process,
)


def test_one_process_is_the_reference_and_learns(tmp_path, capsys):
    summary = assert_gpt_passed(
        run_in_process(main, [*GPT_TINY, "--profile_steps", "3"], tmp_path / "run", capsys), 1
    )
    assert set(summary["checks"]) == {"distributed", "loss_decreased", "memory_per_rank"}
    metrics = summary["metrics"]
    assert metrics["corpus"]["name"] == "pydoc_data/topics.py" and len(metrics["corpus"]["sha256"]) == 64
    assert metrics["val_loss"] < metrics["val_loss_before"] - 0.1 and len(metrics["step_losses"]) == 12
    assert isinstance(metrics["sample"], str) and metrics["sample"]
    held, theory = metrics["bytes_per_rank"][0], metrics["bytes_theory"][0]
    assert held["params"] == held["grads"] == 4 * metrics["parameters"]  # float32, all on one process
    assert (
        2 * held["params"] < held["optimizer"] < 2 * held["params"] + 4 * 100
    )  # exp_avg, exp_avg_sq, a step count each
    assert all(held[kind] == theory[kind] for kind in theory)
    (profiled,) = metrics["step_breakdown_ms"]  # one process sends nothing: compute and idle only
    assert profiled["communication_ms"] == 0 and 0 < profiled["compute_ms"] <= profiled["step_ms"]
    # tokens/s is the steady state's: the first 6 steps (the parity snapshot's), the profiler's warm-up step
    # and its 3 steps are left out of it; the whole loop's rate is beside it
    assert metrics["steady_steps"] == 12 - 6 - 1 - 3
    assert metrics["tokens_per_s"] > 0 and metrics["loop_tokens_per_s"] > 0


@pytest.mark.launch
def test_zero2_on_two_ranks_matches_one_process_and_is_profiled(tmp_path):
    args = [*GPT_TINY, "--strategy", "zero2", "--profile_steps", "2"]
    summary = assert_gpt_passed(launch("train_gpt.py", args, tmp_path / "run"), 2)
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    assert_data_parallel_facts(summary, "zero2")
    # a chrome trace per rank, and each rank's steps split: all-gathers and reduce-scatters take time
    profile = tmp_path / "run" / "profile"
    assert {p.name for p in profile.iterdir()} == {"rank0.json", "rank1.json", "timeline.png"}
    for rank in summary["metrics"]["step_breakdown_ms"]:
        assert rank["compute_ms"] > 0 and rank["communication_ms"] > 0
        parts = rank["compute_ms"] + rank["communication_ms"] - rank["overlapped_ms"] + rank["idle_ms"]
        assert parts == pytest.approx(rank["step_ms"], rel=1e-6) and rank["idle_ms"] >= 0


@pytest.mark.launch
@pytest.mark.parametrize(
    ("variant", "failing"),
    [
        ("same_data_on_every_rank", {"matches_single_process", "grad_norm_is_global"}),
        ("local_grad_norm", {"matches_single_process", "grad_norm_is_global"}),
        # the root's parameters, never sharded, are never all-gathered either
        (
            "unwrapped_root",
            {"memory_per_rank", "communication_volume", "matches_single_process", "grad_norm_is_global"},
        ),
    ],
)
def test_each_wrong_variant_is_caught(tmp_path, variant, failing):
    # clipping must bite for local_grad_norm to matter: a small --grad_clip
    args = [*GPT_TINY, "--strategy", "fsdp", "--wrong_variant", variant, "--grad_clip", "0.1"]
    finished = fork_launch(main, args, tmp_path / "run")
    assert finished.returncode == 1
    checks = finished.summary["checks"]
    assert {name for name, check in checks.items() if not check["passed"]} == failing


@pytest.mark.launch
@pytest.mark.parametrize(
    ("layout", "steps", "verdict"),
    [(["--dp_replicate", "2", "--d_model", "256"], 3, "PASS"), (["--pp", "2"], 1, "SKIP")],
    ids=["ddp_3_steps", "pp_1_step"],
)
def test_a_short_run_counts_a_steady_step_or_says_why_it_cannot(tmp_path, layout, steps, verdict):
    """The bytes sent are counted in the layout's first step free of one-time work: step 1 (the evaluation before
    it reshards FSDP's root), DDP's step 3 (it learns its gradients' order in step 1 and rebuilds its buckets in
    step 2, with two broadcasts), a pipeline's step 2 (its first schedule step votes and sends shapes once). A
    3-step DDP run passes and counts DDP's steady buckets: this GPT's 6.9 MB of gradients in two all-reduces (DDP's
    first bucket holds 1 MB; step 1 sent them in one); a 1-step pipeline has no steady step and says so: not run,
    neither pass nor fail."""
    args = [
        *GPT_TINY,
        *layout,
        "--max_steps",
        str(steps),
        "--parity_steps",
        str(steps),
        "--min_loss_drop",
        "0",
    ]
    summary = assert_gpt_passed(fork_launch(main, args, tmp_path / "run"), 2)
    check = summary["checks"]["communication_volume"]
    if verdict == "PASS":
        assert check["passed"] is True and "every rank equals its theory" in check["detail"]
        assert summary["metrics"]["communication"]["counted"]["calls"] == {"all_reduce": 2}
        # the step timed phase by phase, the clipping by the global norm one of its own
        assert set(summary["metrics"]["step_time_ms"]) == {"forward", "backward", "clip", "optimizer"}
    else:
        assert check["passed"] is None and check["skipped"] and "train at least 2 steps" in check["detail"]
    assert all(c["passed"] for name, c in summary["checks"].items() if name != "communication_volume")


def test_a_model_that_does_not_learn_fails_loss_decreased(tmp_path, capsys):
    finished = run_in_process(main, [*GPT_TINY, "--lr", "1e-7"], tmp_path / "run", capsys)
    assert finished.returncode == 1 and not finished.summary["checks"]["loss_decreased"]["passed"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n_head", "3"], "--n_head 3 must divide --d_model 32"),
        (
            ["--strategy", "fsdp"],
            "--strategy fsdp on 1 rank(s): nothing else leaves 1 rank(s) for --dp_shard",
        ),
        (["--text_files", "no/such.txt"], "--text_files: 'no/such.txt' is not a file"),
        (["--parity_steps", "50"], "--parity_steps must be in [0, --max_steps], got 50"),
        (
            ["--wrong_variant", "local_grad_norm"],
            "--wrong_variant local_grad_norm changes nothing under one process",
        ),
        (
            ["--wrong_variant", "resume_without_data_position"],
            "is a mistake made when resuming: add --resume_from",
        ),
        (
            [
                "--strategy",
                "ddp",
                "--wrong_variant",
                "row_parallel_without_all_reduce",
                "--expected_world_size",
                "2",
            ],
            "--wrong_variant row_parallel_without_all_reduce changes nothing under dp_replicate 2 (2 ranks)",
        ),
        (
            ["--strategy", "ddp", "--wrong_variant", "seed_per_rank", "--expected_world_size", "2"],
            "--wrong_variant seed_per_rank changes nothing under dp_replicate 2",
        ),
        (
            ["--strategy", "tp", "--n_head", "2", "--expected_world_size", "4"],
            "--n_head 2 must be divisible by --tp 4: each rank must hold whole heads",
        ),
        (
            ["--dp_shard", "3", "--tp", "2", "--expected_world_size", "4"],
            "--dp_shard 3 x --tp 2 = 6 rank(s), but 4 were launched",
        ),
        (
            ["--strategy", "fsdp_tp", "--expected_world_size", "2"],
            "--strategy fsdp_tp on 2 rank(s): --tp 2 leaves 1 rank(s) for --dp_shard",
        ),
        (
            ["--strategy", "tp", "--dp_shard", "3", "--expected_world_size", "4"],
            "--strategy tp on 4 rank(s): --dp_shard 3 leaves 1.33333 rank(s) for --tp",
        ),
        (["--tp", "-1"], "--tp must be >= 0 (0, 1: off), got -1"),
        (
            ["--strategy", "zero2", "--reshard_after_forward", "always", "--expected_world_size", "2"],
            "--strategy zero2 is --reshard_after_forward never, got always",
        ),
        (
            ["--reshard_after_forward", "never"],
            "--reshard_after_forward never is for sharded data parallelism",
        ),
        (["--sequence_parallel"], "--sequence_parallel is tensor parallelism's: add --tp N"),
        (
            ["--pp", "2", "--n_layer", "1", "--expected_world_size", "2"],
            "cuts the GPT into 2 stages: --n_layer 1",
        ),
        (
            ["--cp", "2", "--activation_checkpointing", "full", "--expected_world_size", "2"],
            "--activation_checkpointing with --cp: not built",
        ),
        (
            ["--cp", "3", "--expected_world_size", "3"],
            "--block_size 32 with --cp 3: the sequence is cut into 6",
        ),
        (["--cp", "2", "--compile", "--expected_world_size", "2"], "--compile with --cp: not built"),
        (["--vocab_size", "100"], "--vocab_size must be >= 260"),
        (["--n_kv_head", "3"], "--n_kv_head 3 must divide --n_head 2"),
        (
            ["--d_model", "30", "--n_head", "2", "--positions", "rope"],
            "head width --d_model / --n_head = 15 must",
        ),
        (
            ["--n_head", "4", "--n_kv_head", "2", "--tp", "4", "--expected_world_size", "4"],
            "--n_head 4 and --n_kv_head 2 must be divisible by --tp 4",
        ),
        (["--profile_steps", "6"], "--profile_steps 6: must be 0 (off) or 1..5 with --max_steps 12"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message, capsys):
    code, stderr = run_main_in_process(
        main, [*GPT_TINY, "--output_dir", str(tmp_path / "run"), *args], capsys
    )
    assert code == 2 and message in stderr and stderr.strip().count("\n") == 0
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8, "is not text (a NUL byte at offset"),
        ("caf\u00e9 ".encode("latin-1") * 400, "is not UTF-8 text (byte 0xe9 at offset 3)"),
        ("tiny", "the corpus has 4 characters; give it at least 1,000"),
        (None, "cannot be read (Permission denied)"),
        ("folder", "is not a file (a folder?)"),
    ],
    ids=["empty", "binary", "latin-1", "too-short", "unreadable", "a-folder"],
)
def test_text_files_that_are_no_use_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "corpus.txt"
    if content == "folder":
        path.mkdir()
    elif content is None:
        path.write_text("some text " * 200)
        path.chmod(0)
        if os.access(path, os.R_OK):
            pytest.skip("root reads a file whatever its mode")
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    code, stderr = run_main_in_process(
        main, [*GPT_TINY, "--text_files", str(path), "--output_dir", str(tmp_path / "run")], capsys
    )
    assert code == 2 and message in stderr and stderr.strip().count("\n") == 0, stderr
    assert not (tmp_path / "run").exists()


def test_a_model_too_big_for_this_machine_is_one_line(tmp_path, capsys):
    code, stderr = run_main_in_process(
        main,
        [*GPT_TINY, "--d_model", "65536", "--n_head", "2", "--output_dir", str(tmp_path / "run")],
        capsys,
    )
    assert code == 2 and stderr.strip().count("\n") == 0
    assert "--d_model 65536 --n_layer 2" in stderr and "-parameter model would need about" in stderr


def test_trains_on_your_own_text_files(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    finished = run_in_process(
        main, [*GPT_TINY, "--text_files", str(text), "--val_fraction", "0.2"], tmp_path / "run", capsys
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.summary["metrics"]["corpus"]["name"] == "text_files"
