"""train_gpt's sharded checkpoints (torch.distributed.checkpoint), for real on CPU ranks:
- killed twice (-9, every process), resumed twice, mid-epoch: bitwise the uninterrupted run;
- fsdp on 2 ranks (the uninterrupted run every other test resumes) passes every check;
- resharding: a chain of resumes fsdp@2 -> fsdp@3 -> tp@2 -> ddp@2 -> pp@2 -> fsdp@2 -> none@1, each loading
  the previous one's checkpoint bitwise (full-state digest) and then matching one process, the global batch
  (12 samples) kept by each link's rows per rank;
- the two classic half-resumes (optimizer state or data position not restored) fail their checks;
- the DCP <-> safetensors converter round-trips bitwise and refuses a checkpoint missing a shard.
The corpus is a small piece of pydoc topics, so that an epoch is a few steps and checkpoints fall
mid-epoch."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
import torch

from experiments.train_gpt import main
from helpers import (
    CPU_DDP,
    GPT_DISTRIBUTED_CHECKS,
    GPT_TINY,
    REPO,
    assert_data_parallel_facts,
    assert_gpt_passed,
    clean_env,
    fork_launch,
    free_port,
    run_in_process,
    start_and_kill_every_process,
)

# the learning-rate schedule is the 12-step run's in every resume, whatever its --max_steps; a global batch of
# 12 samples, which 1, 2 and 3 data-parallel ranks can each make
CHECKPOINTED = [
    *GPT_TINY,
    "--val_fraction",  # the small corpus's validation share (GPT_TINY's 2 % is for pydoc topics)
    "0.1",
    "--per_rank_batch_size",
    "6",
    "--checkpoint_every",
    "3",
    "--keep_checkpoints",
    "5",
    "--log_every",
    "3",
    "--lr_decay_steps",
    "12",
]


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> str:
    """3,600 characters of pydoc topics: 34 training blocks of 33 tokens, an epoch every 2.8 steps of 12."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("text") / "topics.txt"
    path.write_text("".join(topics[key] for key in sorted(topics))[:3600])
    return str(path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, small_text):
    """fsdp on 2 (forked) ranks, 12 steps, a checkpoint (and its state digest) every 3 steps."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    finished = fork_launch(main, [*CHECKPOINTED, "--text_files", small_text, "--strategy", "fsdp"], out)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished


@pytest.mark.launch
def test_fsdp_on_two_ranks_matches_one_process_holds_half_and_sends_the_theory(uninterrupted):
    summary = assert_gpt_passed(uninterrupted, 2)
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    assert_data_parallel_facts(summary, "fsdp")
    assert sorted(summary["metrics"]["state_digests"]) == ["12", "3", "6", "9"]  # one per checkpoint


def checkpoint(run_dir: Path, step: int) -> str:
    return str(run_dir / "checkpoints" / f"step_{step:08d}")


@pytest.mark.launch
def test_killed_twice_mid_epoch_then_resumed_is_bitwise_the_uninterrupted_run(
    uninterrupted, small_text, tmp_path
):
    out, home = tmp_path / "run", tmp_path / "home"
    home.mkdir()
    env = clean_env(HOME=str(home))
    args = [*CHECKPOINTED, "--text_files", small_text, "--strategy", "fsdp"]
    resume = ["--resume_from_checkpoint", "latest"]

    def launch_then_kill(extra: list[str], hang_after: int) -> None:
        """rank 0 stops responding after step `hang_after`; then every process is killed with -9"""
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_DDP,
                   "--main_process_port", str(free_port()), str(REPO / "experiments" / "train_gpt.py"),
                   "--output_dir", str(out), *args, *extra, "--hang_at_step", str(hang_after)]  # fmt: skip
        start_and_kill_every_process(command, env, until=lambda: finished_step(out, rank=0) >= hang_after)

    launch_then_kill([], hang_after=4)  # checkpoint 3 written
    launch_then_kill(resume, hang_after=8)  # resumed at 3; checkpoint 6 written
    # the kills were real processes; the resume needs none
    final = fork_launch(main, [*args, *resume], out, env=env)
    assert final.returncode == 0, final.stderr[-3000:]
    metrics, clean = final.summary["metrics"], uninterrupted.summary["metrics"]
    assert metrics["resumed_from_step"] == 6  # sample 72 of the stream: 4 samples into the third epoch
    assert metrics["resumed_state_digest"] == clean["state_digests"]["6"]
    assert metrics["final_state_digest"] == clean["final_state_digest"]
    assert final.summary["checks"]["resume_restored_state"]["passed"]
    assert [record["step"] for record in final.metrics] == [3, 6, 9, 12]  # each step logged once


def finished_step(run_dir: Path, rank: int) -> float:
    """The last step rank `rank` finished, from its heartbeat file (common/reliability.Heartbeat)."""
    try:
        return struct.unpack("<d", (run_dir / "heartbeat" / f"rank{rank}").read_bytes()[:8])[0]
    except (FileNotFoundError, struct.error):
        return -1.0


@pytest.mark.launch
def test_resharding_chain_loads_bitwise_and_matches_one_process(uninterrupted, small_text, tmp_path):
    """Each link resumes the previous link's checkpoint under another layout, trains 3-5 steps, checkpoints."""
    chain = [  # (strategy, ranks, rows per data-parallel rank, max_steps): checkpoints every 3 steps
        ("fsdp", 3, 4, 8),  # 2 -> 3 ranks
        ("tp", 2, 12, 11),  # 3 shards -> the matrices split by tensor parallelism (AdamW grouped by kind)
        ("ddp", 2, 6, 14),  # tensor-parallel pieces -> every rank whole
        ("pp", 2, 12, 17),  # whole -> a pipeline stage each (and the tied embedding's copy on the last)
        ("fsdp", 2, 6, 20),  # pipeline stages -> 2 shards
        ("none", 1, 12, 22),  # any -> one process
    ]
    source, step = Path(uninterrupted.output_dir), 3
    for index, (strategy, ranks, rows, max_steps) in enumerate(chain):
        out = tmp_path / f"link{index}_{strategy}{ranks}"
        args = [*CHECKPOINTED, "--text_files", small_text, "--strategy", strategy, "--max_steps", str(max_steps),
                "--per_rank_batch_size", str(rows), "--resume_from_checkpoint", checkpoint(source, step)]  # fmt: skip
        if ranks > 1:
            finished = fork_launch(main, args, out, num_processes=ranks)
        else:
            finished = run_in_process(main, args, out, capsys=None)
        assert finished.returncode == 0, f"{strategy} on {ranks}: " + finished.stderr[-3000:]
        checks = finished.summary["checks"]
        assert checks["resume_restored_state"]["passed"]  # full parameters + AdamW state bitwise the saved
        assert strategy == "none" or checks["matches_single_process"]["passed"]
        assert (
            finished.summary["world_size"] == ranks
            and finished.summary["metrics"]["resumed_from_step"] == step
        )
        if strategy == "ddp":  # ddp's correct run in this suite: bytes held and sent, parity
            assert_data_parallel_facts(finished.summary, "ddp")
        if ranks == 3:  # uneven shards, as torch.chunk splits (a vocabulary of 512 rows: 171, 171, 170)
            metrics = finished.summary["metrics"]
            params = [held["params"] for held in metrics["bytes_per_rank"]]
            assert params[0] == params[1] > params[2] and sum(params) == 4 * metrics["parameters"]
        source, step = out, (max_steps - 1) // 3 * 3


@pytest.mark.launch
@pytest.mark.parametrize(
    ("variant", "strategy", "failing"),
    [
        # the digest check runs in any layout: one process is enough to show it
        ("resume_without_optimizer_state", "none", "resume_restored_state"),
        # the parity check needs a distributed run to compare with one process
        ("resume_without_data_position", "fsdp", "matches_single_process"),
    ],
)
def test_half_resumes_fail_their_check(uninterrupted, small_text, tmp_path, variant, strategy, failing):
    args = [*CHECKPOINTED, "--text_files", small_text, "--strategy", strategy, "--wrong_variant", variant,
            "--resume_from_checkpoint", checkpoint(Path(uninterrupted.output_dir), 6)]  # fmt: skip
    args += (
        ["--per_rank_batch_size", "12"] if strategy == "none" else []
    )  # the global batch of 12 on one rank
    if strategy == "none":
        finished = run_in_process(main, args, tmp_path / "run", capsys=None)
    else:
        finished = fork_launch(main, args, tmp_path / "run")
    assert finished.returncode == 1, finished.stderr[-3000:]
    failed = {name for name, check in finished.summary["checks"].items() if not check["passed"]}
    assert failing in failed


@pytest.mark.launch
def test_dcp_safetensors_round_trip_is_bitwise(uninterrupted, tmp_path, capsys):
    from common.gpt import GPT, GPTConfig
    from tools.convert_checkpoint import main as convert

    source = checkpoint(Path(uninterrupted.output_dir), 9)
    first, again = tmp_path / "model.safetensors", tmp_path / "again.safetensors"
    assert convert(["to-safetensors", source, str(first)]) == 0
    assert convert(["from-safetensors", str(first), str(tmp_path / "dcp")]) == 0
    assert convert(["to-safetensors", str(tmp_path / "dcp"), str(again)]) == 0
    assert first.read_bytes() == again.read_bytes()

    from safetensors.torch import load_file

    weights = load_file(str(first))
    config = uninterrupted.summary["config"]
    vocab = uninterrupted.summary["metrics"]["corpus"]["vocab_size"]
    model = GPT(
        GPTConfig(vocab, config["block_size"], config["n_layer"], config["n_head"], config["d_model"])
    )
    model.load_state_dict(weights, strict=True)  # every name and shape of the model, nothing else
    assert torch.equal(weights["head.weight"], weights["tok_emb.weight"])  # the tied weight, stored twice


@pytest.mark.launch
def test_converter_refuses_a_checkpoint_missing_a_shard_and_never_overwrites(uninterrupted, tmp_path, capsys):
    import shutil

    from tools.convert_checkpoint import main as convert

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint(Path(uninterrupted.output_dir), 9), broken)
    next((broken / "state").glob("__1_*.distcp")).unlink()  # rank 1's shards gone
    with pytest.raises(SystemExit) as exit_info:
        convert(["to-safetensors", str(broken), str(tmp_path / "out.safetensors")])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and str(broken) in error and error.count("\n") == 0
    assert not (tmp_path / "out.safetensors").exists()
    existing = tmp_path / "exists.safetensors"
    existing.write_text("keep me")
    with pytest.raises(SystemExit):
        convert(["to-safetensors", checkpoint(Path(uninterrupted.output_dir), 9), str(existing)])
    assert existing.read_text() == "keep me"
