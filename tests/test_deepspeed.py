"""DeepSpeed ZeRO-1/2/3 through Accelerate, chosen by the accelerate config (strategies/deepspeed.py), for
real on 2 CPU ranks: each stage passes every check against its theory and one process; ZeRO-1 reduces
the gradients once per step and ZeRO-2 every micro-batch; ZeRO-3 shards for real and keeps its small
parameters whole; a ZeRO-3 checkpoint resumes bitwise; each wrong variant fails its check; contradictory
flags and configs are refused in one line; and the upstream behaviours the workarounds exist for are
recorded, so that a test fails when Accelerate or DeepSpeed change them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from experiments.train_gpt import main
from helpers import (
    GPT_DISTRIBUTED_CHECKS,
    GPT_TINY,
    REPO,
    assert_gpt_passed,
    fork_launch,
    launch,
    run_main_in_process,
)

CONFIG = str(REPO / "accelerate_configs" / "deepspeed_zero{}.yaml")
# ZeRO-3 on a model whose embedding (2,048 x 64 = 131,072 elements) is over DeepSpeed's persistence
# threshold of 100,000: it is really partitioned; every other parameter stays whole on every rank
NON_RESIDENT = ["--d_model", "64", "--vocab_size", "2048"]


def zero(stage: int, args: list[str], out: Path, real_launch: bool = False):
    """train_gpt under accelerate_configs/deepspeed_zero<stage>.yaml on 2 ranks: through `accelerate launch`
    (real_launch), or forked with the environment that launch gives its ranks (the same run, ~10 s less)."""
    if real_launch:
        return launch("train_gpt.py", [*GPT_TINY, *args], out, config=CONFIG.format(stage))
    return fork_launch(main, [*GPT_TINY, *args], out, config=CONFIG.format(stage))


@pytest.mark.launch
@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_reduces_once_per_step_and_zero2_every_micro_batch(tmp_path, stage):
    # ZeRO-1 through the README's command; ZeRO-2 forked
    finished = zero(stage, ["--gradient_accumulation_steps", "2"], tmp_path / "run", real_launch=stage == 1)
    summary = assert_gpt_passed(finished, 2)
    assert (
        set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
        and summary["config"]["strategy"] == f"deepspeed_zero{stage}"
    )
    metrics = summary["metrics"]
    full = 4 * metrics["parameters"]
    counted = metrics["communication"]["counted"]["bytes"]
    # the gradients all-reduced once (ZeRO-1) or per micro-batch (ZeRO-2), plus two 4-byte scalars (the
    # norm and the overflow check); the updated parameters all-gathered once
    assert counted == {"all_reduce": (1 if stage == 1 else 2) * full + 8, "all_gather": full}
    for held in metrics["bytes_per_rank"]:  # whole parameters; a float32 master + 2 moments of half of them
        assert held["params"] == full and held["optimizer"] == 3 * full // 2 + 8 and held["grads"] == 0


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """ZeRO-3 on 2 ranks, 12 steps, a checkpoint every 3 (DeepSpeed's own format, via Accelerate's save_state)."""
    out = tmp_path_factory.mktemp("zero3") / "run"
    return zero(
        3,
        [*NON_RESIDENT, "--checkpoint_every", "3", "--keep_checkpoints", "5", "--lr_decay_steps", "12"],
        out,
    )


@pytest.mark.launch
def test_zero3_partitions_what_is_large_and_keeps_the_rest_whole(zero3):
    summary = assert_gpt_passed(zero3, 2)
    metrics = summary["metrics"]
    full, embedding = 4 * metrics["parameters"], 4 * 2048 * 64
    counted = metrics["communication"]["counted"]["bytes"]
    # gradients reduce-scattered; the embedding gathered for forward and again for backward; the small
    # (resident) parameters gathered after the step; two 8-byte scalars
    assert counted == {
        "reduce_scatter": full,
        "all_gather": 2 * embedding + (full - embedding),
        "all_reduce": 16,
    }
    for held in metrics["bytes_per_rank"]:
        assert held["params"] == full // 2 + (full - embedding) and held["grads"] == full // 2
    files = {p.relative_to(zero3.output_dir / "checkpoints" / "step_00000003").as_posix()
             for p in (zero3.output_dir / "checkpoints" / "step_00000003").rglob("*") if p.is_file()}  # fmt: skip
    assert {"pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt", "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "step.json", "random_states_0.pkl", "random_states_1.pkl"} <= files  # fmt: skip


@pytest.mark.launch
@pytest.mark.parametrize(
    ("variant", "failing"),
    [("", set()), ("resume_without_optimizer_state", {"resume_restored_state"})],
    ids=["exact", "without-optimizer-state"],
)
def test_a_zero3_checkpoint_resumes_bitwise_and_a_half_resume_fails(zero3, tmp_path, variant, failing):
    checkpoint = zero3.output_dir / "checkpoints" / "step_00000006"
    args = [*NON_RESIDENT, "--lr_decay_steps", "12", "--resume_from_checkpoint", str(checkpoint)]
    finished = zero(3, [*args, *(["--wrong_variant", variant] if variant else [])], tmp_path / "run")
    assert (finished.output_dir / "summary.json").exists(), finished.stderr[-3000:]
    checks = finished.summary["checks"]
    assert {name for name, check in checks.items() if not check["passed"]} == failing, finished.stderr[-2000:]
    if not variant:
        metrics = finished.summary["metrics"]
        saved = json.loads((checkpoint / "step.json").read_text())["state_digest"]
        assert (
            metrics["resumed_state_digest"] == saved
            and metrics["final_state_digest"] == zero3.summary["metrics"]["final_state_digest"]
        )


@pytest.mark.launch
@pytest.mark.parametrize(
    ("stage", "args", "failing"),
    [
        # Accelerate fills the config's "auto" clipping with 1.0: the run clips at 1.0, not at --grad_clip
        (
            2,
            ["--wrong_variant", "clip_from_accelerate_default", "--grad_clip", "0.1"],
            {"matches_single_process", "grad_norm_is_global"},
        ),
        # textbook ZeRO-3 (every parameter partitioned) is not what DeepSpeed does with small parameters
        (3, ["--wrong_variant", "textbook_zero3_theory"], {"memory_per_rank", "communication_volume"}),
    ],
    ids=["clipping-left-to-accelerate", "textbook-zero3"],
)
def test_each_deepspeed_mistake_is_caught(tmp_path, stage, args, failing):
    finished = zero(stage, args, tmp_path / "run")
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert {name for name, check in finished.summary["checks"].items() if not check["passed"]} == failing


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, ["--strategy", "fsdp"],
         "--strategy fsdp: this launch's accelerate config is DeepSpeed ZeRO-3, which runs deepspeed_zero3"),
        ({"ACCELERATE_USE_DEEPSPEED": "false"}, ["--strategy", "deepspeed_zero2"],
         "launch with --config_file accelerate_configs/deepspeed_zero2.yaml (this launch has no DeepSpeed config)"),
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"}, ["--strategy", "deepspeed_zero1", "--mixed_precision", "bf16"],
         "--mixed_precision bf16 with DeepSpeed ZeRO-1: not built"),
        ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, [],
         "the accelerate config sets gradient_accumulation_steps 4, --gradient_accumulation_steps is 1"),
        ({"ACCELERATE_GRADIENT_CLIPPING": "1.0"}, ["--grad_clip", "0.5"],
         "the accelerate config sets gradient_clipping 1.0, --grad_clip is 0.5"),
        ({}, ["--wrong_variant", "textbook_zero3_theory"],
         "--wrong_variant textbook_zero3_theory changes nothing under dp_shard 2 (2 ranks) with DeepSpeed ZeRO-2"),
        ({}, ["--tp", "2"], "--tp 2 under a DeepSpeed ZeRO-2 accelerate config: DeepSpeed's ZeRO is data parallelism"),
    ],
)  # fmt: skip
def test_a_contradiction_between_flags_and_config_is_one_line(
    tmp_path, capsys, monkeypatch, env, args, message
):
    for name, value in {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        **env,
    }.items():
        monkeypatch.setenv(name, value)
    argv = [*GPT_TINY, "--expected_world_size", "2", "--output_dir", str(tmp_path / "run"), *args]
    code, stderr = run_main_in_process(main, argv, capsys)
    assert code == 2 and message in stderr and stderr.strip().count("\n") == 0, stderr


def test_a_deepspeed_checkpoint_resumes_only_under_its_own_stage_and_world_size(monkeypatch):
    from common.config import UsageError
    from experiments.train_gpt import Config

    deepspeed_3 = {
        "layout": {"strategy": "deepspeed_zero3", "checkpoint_format": "deepspeed ZeRO-3"},
        "world_size": 2,
    }
    dcp = {"layout": {"strategy": "fsdp", "checkpoint_format": "dcp"}, "world_size": 3}
    Config(strategy="ddp").refuse_resume(dcp, 2)  # DCP: any layout, any world size
    with pytest.raises(UsageError, match="DeepSpeed's checkpoints are its own format"):
        Config(strategy="fsdp").refuse_resume(deepspeed_3, 2)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    Config(strategy="deepspeed_zero3").refuse_resume(deepspeed_3, 2)
    for strategy, ranks, checkpoint in (("deepspeed_zero3", 3, deepspeed_3), ("deepspeed_zero3", 2, dcp)):
        with pytest.raises(UsageError, match="resumed only by the same stage on as many ranks"):
            Config(strategy=strategy).refuse_resume(checkpoint, ranks)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    with pytest.raises(
        UsageError,
        match="the checkpoint is in deepspeed ZeRO-3 format on 2 rank.* this run writes deepspeed ZeRO-2",
    ):
        Config(strategy="deepspeed_zero2").refuse_resume(deepspeed_3, 2)


# ------------------------------------------------------------------- what the workarounds exist for
def test_accelerates_deepspeed_plugin_imports_transformers(monkeypatch):
    """Why transformers is in requirements.txt although nothing here uses it. When this test fails,
    Accelerate no longer imports it when a DeepSpeed config is selected: drop the pin."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=2)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "transformers.integrations", None)
    with pytest.raises(ImportError):
        plugin.set_deepspeed_weakref()


def test_deepspeed_would_compile_its_shared_memory_op_at_start():
    """Why common/runtime.deepspeed_on_cpu marks the op not compatible while the Accelerator starts: on
    Linux DeepSpeed deems it buildable, and its communication backend JIT-compiles it (40 s with g++)."""
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    assert ShareMemCommBuilder().is_compatible()


@pytest.mark.launch
def test_the_upstream_behaviours_the_workarounds_exist_for(tmp_path):
    """Under a DeepSpeed config on CPU: a plain Accelerator() sees ONE process (its backend stays None)
    while gloo makes it see both; Accelerate leaves torch's thread count alone (for MULTI_CPU it sets
    cores / ranks: common/runtime.threads_as_for_multi_cpu); and ZeRO-2 leaves the second parameter group's parameters without
    their optimizer-state slice after the first step (strategies/deepspeed.link_every_group)."""
    from scripts.deepspeed_upstream import main as record_upstream

    done = fork_launch(record_upstream, [], tmp_path / "run", config=CONFIG.format(2), output_flag=False)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(done.stdout.strip().splitlines()[-1])
    assert recorded == {
        "num_processes_plain_accelerator": 1,
        "num_processes_with_gloo": 2,
        "threads_left_as_torch_set_them": True,
        "unmapped_after_first_step": 10,
    }


def test_deepspeed_ranks_on_cpu_take_their_share_of_the_cores(monkeypatch):
    """What Accelerate does for MULTI_CPU, done for DeepSpeed: physical cores / local ranks, at least 1,
    and nothing when the user set OMP_NUM_THREADS."""
    import psutil
    import torch

    from common.runtime import threads_as_for_multi_cpu

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
        threads_as_for_multi_cpu()
        assert torch.get_num_threads() == max(1, psutil.cpu_count(logical=False) // 64)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        threads_as_for_multi_cpu()
        assert torch.get_num_threads() == psutil.cpu_count(logical=False)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(before)
        threads_as_for_multi_cpu()
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


@pytest.mark.launch
def test_a_zero3_checkpoint_converts_to_the_weights_the_run_sampled_with(zero3, tmp_path, capsys):
    """tools/convert_checkpoint reads DeepSpeed's partitions through DeepSpeed's zero_to_fp32: the weights of the
    run's final checkpoint generate the very sample the run generated from its final state."""
    from safetensors.torch import load_file

    from common.gpt import GPTConfig, build_gpt, sample_text
    from common.text import load_corpus
    from tools.convert_checkpoint import main as convert

    final = zero3.output_dir / "checkpoints" / "step_00000012"
    code, _ = run_main_in_process(
        convert, ["to-safetensors", str(final), str(tmp_path / "w.safetensors")], capsys
    )
    assert code == 0
    config, metrics = zero3.summary["config"], zero3.summary["metrics"]
    corpus = load_corpus("", config["vocab_size"], config["block_size"], config["val_fraction"])
    model = build_gpt(GPTConfig(metrics["corpus"]["vocab_size"], config["block_size"], config["n_layer"],
                                config["n_head"], config["d_model"]), 0)  # fmt: skip
    sample = sample_text(model, load_file(str(tmp_path / "w.safetensors")), corpus["tokenizer"], corpus["val"][0][0][:8],
                         config["sample_tokens"], config["seed"], "cpu")  # fmt: skip
    assert sample == metrics["sample"]
