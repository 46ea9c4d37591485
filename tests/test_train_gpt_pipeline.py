"""train_gpt --strategy pp (strategies/pp.py) for real on forked gloo ranks: every schedule passes every check
(one process's losses and parameters, the global clip norm, bytes held per stage, activations and gradients
sent per boundary) and measures its bubble; 2 stage-ranks x 2 data-parallel replicas on 4 ranks; each
mistake fails the check that exists for it. The closed forms and refusals are in test_strategies.py; the
resharding chain in test_train_gpt_checkpoints.py resumes a ddp checkpoint under pp and pp's under fsdp."""

from __future__ import annotations

import pytest

from experiments.train_gpt import main
from helpers import GPT_DISTRIBUTED_CHECKS, GPT_TINY, assert_gpt_passed, fork_launch

# 4 blocks: the two-stages-per-rank schedules cut 4 stages; 8 steps, parity over 4
PP_TINY = [*GPT_TINY, "--strategy", "pp", "--n_layer", "4", "--max_steps", "8", "--parity_steps", "4",
           "--log_every", "4"]  # fmt: skip
ACTIVATION = 1 * 32 * 32 * 4  # a micro-batch: 4 rows / 4 micro-batches x context 32 x width 32, float32
TIED = 512 * 32 * 4  # the tied embedding's gradient: vocabulary 512 x width 32


@pytest.mark.launch
@pytest.mark.parametrize(
    ("schedule", "boundaries", "tied_all_reduce", "extra"),
    [
        (
            "gpipe",
            1,
            True,
            [],
        ),  # rank 0: stage 0 -> 1 (1f1b, the default, runs in the pp x dp test, the resharding
        # chain and test_activation_checkpointing)
        ("interleaved_1f1b", 3, True, []),  # rank 0: stages 0 and 2: 0 -> 1, 1 -> 2, 2 -> 3
        ("interleaved_zero_bubble", 3, True, []),
        # rank 0: stages 0 and 3 (the V): 0 -> 1, 2 -> 3; it holds both ends of the tie. 6 blocks, the ends 1
        # lighter: stages of 1, 2, 2, 1 (as even: 2, 1, 1, 2), rank 0 holding 2 blocks (as even: 4)
        ("zbv", 2, False, ["--n_layer", "6", "--pp_fewer_blocks_at_ends", "1"]),
        ("dualpipev", 2, False, []),
    ],
)
def test_every_schedule_matches_one_process_and_sends_the_theory(
    tmp_path, schedule, boundaries, tied_all_reduce, extra
):
    finished = fork_launch(main, [*PP_TINY, "--pp_schedule", schedule, *extra], tmp_path / "run")
    summary = assert_gpt_passed(finished, 2)
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    metrics = summary["metrics"]
    assert metrics["layout"]["pp"] == 2 and metrics["layout"]["dp_shard"] == metrics["layout"]["tp"] == 1
    counted = metrics["communication"]["counted"]
    m = 4
    assert counted["calls"]["send"] == counted["calls"]["recv"] == boundaries * m
    assert counted["bytes"]["send"] == counted["bytes"]["recv"] == boundaries * m * ACTIVATION
    assert counted["bytes"]["broadcast"] == 4  # the step's loss, from the last stage
    assert counted["bytes"].get("all_reduce", 0) == (TIED if tied_all_reduce else 0)
    # the two ranks hold the whole model between them, plus the head's copy of the tied embedding
    held = [h["params"] for h in metrics["bytes_per_rank"]]
    assert sum(held) == 4 * metrics["parameters"] + TIED
    if extra:  # rank 1: blocks 1-4; rank 0: blocks 0 and 5, the embeddings, ln_f and the head's tied copy
        ends = 4 * (512 * 32 + 32 * 32 + 2 * 32) + TIED
        assert held[0] == ends + 2 * (held[1] // 4)
    pipeline = metrics["pipeline"]
    assert pipeline["schedule"] == schedule and pipeline["steps_measured"] == 8 - 2
    assert 0 < pipeline["measured_bubble"] < 1 and pipeline["step_ms"] > 0
    assert (tmp_path / "run" / "pipeline_timeline.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.launch
def test_two_pipelines_of_two_stages_average_their_gradients(tmp_path):
    """pp x dp_replicate on 4 ranks (--strategy pp --dp_replicate 2: the preset takes the ranks left): ranks 0, 1
    hold stage 0 of pipelines 0, 1; ranks 2, 3 stage 1. Each stage is one unit of PyTorch's replicate."""
    finished = fork_launch(
        main, [*GPT_TINY, "--strategy", "pp", "--dp_replicate", "2"], tmp_path / "run", num_processes=4
    )
    metrics = assert_gpt_passed(finished, 4)["metrics"]
    assert (metrics["layout"]["pp"], metrics["layout"]["dp_replicate"]) == (2, 2)
    held = [h["params"] for h in metrics["bytes_per_rank"]]
    assert held[0] == held[1] and held[2] == held[3]  # replicas hold the same stage
    counted = metrics["communication"]["counted"]
    # rank 0's stage 0: its gradients all-reduced over the 2 replicas, and the tied embedding's with stage 1
    assert counted["calls"]["all_reduce"] == 2 and counted["bytes"]["all_reduce"] == held[0] + 512 * 32 * 4


@pytest.mark.launch
@pytest.mark.parametrize(
    ("variant", "schedule", "failing"),
    [
        ("pp_unscaled_microbatch_gradients", "gpipe", {"matches_single_process", "grad_norm_is_global"}),
        ("pp_whole_model_on_every_rank", "1f1b", {"memory_per_rank"}),
        (
            "pp_tied_embedding_not_synced",
            "interleaved_1f1b",
            {"communication_volume", "matches_single_process"},
        ),
        ("local_grad_norm", "zbv", {"grad_norm_is_global"}),
    ],
)
def test_each_pipeline_mistake_fails_its_check(tmp_path, variant, schedule, failing):
    args = [
        *PP_TINY,
        "--max_steps",
        "6",
        "--parity_steps",
        "6",
        "--pp_schedule",
        schedule,
        "--wrong_variant",
        variant,
    ]
    finished = fork_launch(main, args, tmp_path / "run")
    assert finished.returncode == 1, finished.stderr[-3000:]
    failed = {name for name, check in finished.summary["checks"].items() if not check["passed"]}
    assert failing <= failed


def test_the_schedules_benchmark_refuses_what_it_cannot_run(capsys):
    from benchmarks.pipeline_schedules import main as schedules_main

    with pytest.raises(SystemExit) as stop:
        schedules_main(["--schedules", "gpipe,chimera"])
    assert stop.value.code == 2 and "['chimera'] must be among gpipe, 1f1b" in capsys.readouterr().err
