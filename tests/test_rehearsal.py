"""The GPU rehearsal on the CPU (common/rehearsal.py, DIST_REHEARSAL=1): the fixed code passes it under every
train_gpt layout and every other experiment that runs on a GPU, and each crash a first GPU run would have hit
(issue #66's reading of the code), put back by a monkeypatch in the ranks, fails it in one line naming the op and
the line. The ranks are forked from tests/helpers' fork server: a mutation is applied inside them, by the
`main` the test hands fork_launch."""

from __future__ import annotations

import pytest
import torch
import yaml

from experiments import (
    collectives,
    ddp_linear,
    loss_normalization,
    manual_data_parallel,
    model_parallel,
    pipeline_parallel,
    train_gpt,
)
from helpers import GPT_TINY, HF_TINY, REPO, assert_gpt_passed, fork_launch, run_in_process

REHEARSAL = {"DIST_REHEARSAL": "1"}
# 4 blocks (a 2-stage pipeline has blocks on both stages), 4 steps, parity over 2
REHEARSAL_TINY = [*GPT_TINY, "--n_layer", "4", "--max_steps", "4", "--parity_steps", "2", "--log_every", "2",
                  "--min_loss_drop", "0", "--parity_steps_bf16", "2"]  # fmt: skip
MOE = ["--n_experts", "4", "--top_k", "2"]


def failure_line(finished) -> str:
    """The rehearsal's one line (every rank that hit it says it)."""
    lines = [line for line in finished.stderr.splitlines() if "rehearsal:" in line]
    assert finished.returncode == 1 and lines, finished.stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------------- what passes
@pytest.mark.launch
@pytest.mark.parametrize("ranks,degrees", [
    (1, ""), (2, "--dp_shard 2 --reshard_after_forward never"),  # (dp_replicate: the resume test's first run)
    (2, "--tp 2 --sequence_parallel"), (2, "--pp 2 --pp_schedule interleaved_1f1b"),
    (2, "--ep 2 --mixed_precision bf16"), (4, "--dp_shard 2 --tp 2 --mixed_precision bf16"),
])  # fmt: skip
def test_rehearsal_passes_train_gpt_layouts(tmp_path, ranks, degrees):
    """Every check passes under the rehearsal (ep's with a mixture of experts in bf16: its experts' autocast)."""
    args = [*REHEARSAL_TINY, *degrees.split(), *(MOE if "--ep" in degrees else [])]
    assert_gpt_passed(
        fork_launch(train_gpt.main, args, tmp_path / "run", num_processes=ranks, env=REHEARSAL), ranks
    )


@pytest.mark.launch
def test_rehearsal_passes_a_transformers_model_under_fsdp_and_its_own_tensor_parallel_plan(tmp_path):
    """--hf_config llama_tiny, dp_shard 2 x tp 2 in bf16: its rotary buffers, masks and plan as a GPU sees them."""
    args = [*HF_TINY, "--hf_config", "llama_tiny", "--dp_shard", "2", "--tp", "2", "--mixed_precision", "bf16",
            "--max_steps", "4", "--parity_steps_bf16", "2", "--log_every", "2", "--min_loss_drop", "0"]  # fmt: skip
    assert_gpt_passed(fork_launch(train_gpt.main, args, tmp_path / "run", num_processes=4, env=REHEARSAL), 4)


@pytest.mark.launch
def test_rehearsal_passes_deepspeed_zero2(tmp_path):
    config = str(REPO / "accelerate_configs" / "deepspeed_zero2.yaml")
    finished = fork_launch(train_gpt.main, REHEARSAL_TINY, tmp_path / "run", env=REHEARSAL, config=config)
    summary = assert_gpt_passed(finished, 2)
    assert summary["config"]["strategy"] == "deepspeed_zero2"


@pytest.mark.launch
@pytest.mark.parametrize("experiment,ranks,args", [
    (ddp_linear, 2, ["--max_steps", "150"]),
    (collectives, 2, ["--ops", "all_reduce,all_gather_into_tensor,reduce_scatter_tensor,send_recv,all_to_all_single"]),
    (manual_data_parallel, 2, ["--max_steps", "10"]),
    (loss_normalization, 2, []),
    (pipeline_parallel, 2, ["--bubble_steps", "2"]),  # it found iterate_batches' host index for device rows
    (model_parallel, 1, ["--device_map", "auto"]),
], ids=["ddp_linear", "collectives", "manual_data_parallel", "loss_normalization", "pipeline_parallel",
        "model_parallel"])  # fmt: skip
def test_rehearsal_passes_every_other_experiment(tmp_path, experiment, ranks, args):
    """manual_data_parallel and loss_normalization under multi_gpu_ddp.yaml's bf16 as every rank sees it
    (ACCELERATE_MIXED_PRECISION): they train in float32 whatever it says (their parity is float32's; before, only the prepared
    model autocast and parity failed), and pass."""
    bf16 = experiment in (manual_data_parallel, loss_normalization)
    env = {**REHEARSAL, **({"ACCELERATE_MIXED_PRECISION": "bf16"} if bf16 else {})}
    finished = fork_launch(experiment.main, ["--report_to", "none", *args], tmp_path / "run", num_processes=ranks,
                           env=env)  # fmt: skip
    assert finished.returncode == 0 and "rehearsal" not in finished.stderr, finished.stderr[-3000:]
    assert finished.summary["passed"]


@pytest.mark.launch
def test_rehearsal_passes_fault_tolerance_with_tp_in_each_group(tmp_path, monkeypatch, capsys):
    """The launcher (in this process) and every replica group's process (train_gpt with --fault_tolerant: its exact
    accumulation, the torchft all-reduce of its sums and tallies, its one-process reference) under the rehearsal:
    the groups start with the launcher's environment, DIST_REHEARSAL included (tests/test_fault_tolerance.py's
    test_a_group_starts_with_the_launchers_environment)."""
    from common.rehearsal import rehearse
    from experiments.fault_tolerance import main

    args = ["--report_to", "none", "--max_steps", "8", "--global_batch_size", "4", "--micro_batch_size", "1",
            "--d_model", "32", "--replica_groups", "2", "--tp", "2", "--failures", "0"]  # fmt: skip
    monkeypatch.setenv("DIST_REHEARSAL", "1")
    with rehearse():
        finished = run_in_process(main, args, tmp_path / "run", capsys)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    checks = finished.summary["checks"]
    assert checks["matches_one_process"]["passed"] and checks["groups_passed_their_checks"]["passed"], checks


@pytest.mark.launch
def test_rehearsal_refuses_cp_in_one_line_before_anything_starts(tmp_path):
    """cp's attention is the CPU kernel: on a GPU (as rehearsed) the layout is refused before start-up."""
    finished = fork_launch(train_gpt.main, [*REHEARSAL_TINY, "--cp", "2"], tmp_path / "run", env=REHEARSAL)
    assert finished.returncode == 2 and "--cp 2 on cuda" in finished.stderr, finished.stderr[-2000:]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


# ---------------------------------------------------------------------- each crash put back, and caught
def train_gpt_with_batch_left_on_host(argv):
    """The crash: Job.forward_backward never moved the training batch to the device."""
    import strategies.job

    strategies.job.on_device = lambda batch, device: batch
    return train_gpt.main(argv)


@pytest.mark.launch
@pytest.mark.parametrize("ranks,degrees", [(1, ""), (2, "--dp_replicate 2")])
def test_rehearsal_catches_the_training_batch_left_on_the_host(tmp_path, ranks, degrees):
    finished = fork_launch(train_gpt_with_batch_left_on_host, [*REHEARSAL_TINY, *degrees.split()], tmp_path / "run",
                           num_processes=ranks, env=REHEARSAL)  # fmt: skip
    line = failure_line(finished)
    # one process: the embedding of host tokens; DDP moves the inputs, not the targets: the loss's host targets
    assert "mixes a host tensor" in line and (
        "embedding" in line or "nll_loss" in line or "cross_entropy" in line
    )


def loss_normalization_with_batches_on_host(argv):
    """The crash: loss_normalization all-reduced a host tensor (its token count) and kept its targets there."""
    loss_normalization.on_device = lambda batch, device: batch
    return loss_normalization.main(argv)


@pytest.mark.launch
def test_rehearsal_catches_a_host_tensor_handed_to_a_collective(tmp_path):
    finished = fork_launch(loss_normalization_with_batches_on_host, ["--report_to", "none"], tmp_path / "run",
                           env=REHEARSAL)  # fmt: skip
    line = failure_line(finished)
    assert "c10d" in line and "got a host tensor" in line and "loss_normalization.py" in line


def moe_autocast_of_cpu(tokens):
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else tokens.dtype


def train_gpt_with_cpu_autocast_in_experts(argv):
    """The crash: the experts asked autocast about the CPU only (on a GPU they stayed float32)."""
    import common.moe

    common.moe.expert_dtype = moe_autocast_of_cpu
    return train_gpt.main(argv)


@pytest.mark.launch
def test_rehearsal_catches_an_autocast_of_a_literal_device_type(tmp_path):
    args = [*REHEARSAL_TINY, "--n_experts", "2", "--mixed_precision", "bf16"]
    finished = fork_launch(train_gpt_with_cpu_autocast_in_experts, args, tmp_path / "run", num_processes=1,
                           env=REHEARSAL)  # fmt: skip
    line = failure_line(finished)
    assert "with a literal device type" in line and "test_rehearsal.py" in line


def train_gpt_without_cp_refusal(argv):
    """The crash: cp was refused on CUDA only at its first forward, after start-up."""
    train_gpt.planned_device_type = lambda: "cpu"  # the up-front refusal does not see the GPU
    return train_gpt.main(argv)


@pytest.mark.launch
def test_rehearsal_catches_a_cpu_only_kernel_reached_without_a_refusal(tmp_path):
    finished = fork_launch(train_gpt_without_cp_refusal, [*REHEARSAL_TINY, "--cp", "2"], tmp_path / "run",
                           env=REHEARSAL)  # fmt: skip
    line = failure_line(finished)
    assert "_scaled_dot_product_flash_attention_for_cpu" in line and "CPU-only kernel" in line


def train_gpt_loading_optimizer_state_on_host(argv):
    """The crash: a resumed run's one-process reference loaded its fused AdamW state while the model was on the
    host, then only the parameters moved."""
    import strategies.checks

    load = strategies.checks.load_full_optimizer_state

    def load_on_host(optimizer, model, state):
        model.cpu()
        load(optimizer, model, state)

    strategies.checks.load_full_optimizer_state = load_on_host
    return train_gpt.main(argv)


@pytest.mark.launch
def test_rehearsal_catches_a_resumed_reference_whose_optimizer_state_stayed_on_host(tmp_path):
    """A run's step-2 checkpoint resumed into a new folder: the reference replays the parity steps from its state."""
    args = [*REHEARSAL_TINY, "--dp_replicate", "2", "--max_steps", "6"]
    first = fork_launch(train_gpt.main, [*args, "--checkpoint_every", "2", "--keep_checkpoints", "3"], tmp_path / "first",
                        env=REHEARSAL)  # fmt: skip
    assert_gpt_passed(first, 2)  # dp_replicate under the rehearsal: every check passes
    resumed = [*args, "--resume_from_checkpoint", str(tmp_path / "first" / "checkpoints" / "step_00000002")]
    fixed = fork_launch(train_gpt.main, resumed, tmp_path / "fixed", env=REHEARSAL)
    assert_gpt_passed(fixed, 2)  # the fixed code passes
    finished = fork_launch(
        train_gpt_loading_optimizer_state_on_host, resumed, tmp_path / "run", env=REHEARSAL
    )
    line = failure_line(finished)
    assert "mixes a host tensor" in line and "adamw" in line.lower()


# -------------------------------------------------------------------------------- what is not rehearsed
def test_rehearsal_deepspeed_configs_leave_the_gpus_on():
    """use_cpu: true turns DeepSpeed off on a GPU host while train_gpt picks DeepSpeed's engine: every DeepSpeed
    config leaves it false (on a CPU-only machine make_accelerator runs DeepSpeed on the CPU all the same)."""
    configs = sorted((REPO / "accelerate_configs").glob("deepspeed_zero*.yaml"))
    assert len(configs) == 3
    for path in configs:
        assert yaml.safe_load(path.read_text())["use_cpu"] is False, path.name


def test_the_rehearsal_tracks_where_tensors_would_live():
    """Host: factories without a device, a host tensor's own .device, .cpu(), a literal "cpu"; device: a
    torch.device (accelerator.device), a module's .to(device); an op's result lives where its inputs do."""
    from common.rehearsal import RehearsalFailure, rehearse

    device = torch.device("cpu")  # what accelerator.device is here
    with rehearse() as marks:
        host = torch.zeros(3)
        on_device = host.to(device)
        assert marks.is_host(host) and not marks.is_host(on_device) and on_device is not host
        assert marks.is_host(torch.arange(3, device=host.device)) and not marks.is_host(
            torch.arange(3, device=device)
        )
        assert marks.is_host(on_device.cpu()) and marks.is_host(on_device.to("cpu"))
        assert not marks.is_host(on_device * 2) and marks.is_host(host * 2)
        assert not marks.is_host(on_device + torch.tensor(1.0))  # a 0-dim host tensor is a scalar, as on CUDA
        layer = torch.nn.Linear(3, 2)
        assert marks.is_host(layer.weight)
        layer.to(device)
        assert not marks.is_host(layer.weight) and not marks.is_host(layer(on_device))
        with pytest.raises(RehearsalFailure, match="mixes a host tensor"):
            layer(host)
        on_device[torch.tensor([0, 1])] = 1.0  # host indices index a device tensor, as on CUDA
        on_device.copy_(host)  # a copy crosses
    # outside the rehearsal nothing is tracked, nothing fails
    torch.nn.Linear(3, 2)(torch.zeros(3))


def test_collectives_closed_form_for_an_integer_average_floors_as_nccl_does(monkeypatch):
    """NCCL's AVG of integers is the sum divided by the ranks, rounded down (gloo refuses it): the closed form the
    experiment checks it against (a stand-in all_reduce that does what NCCL does)."""
    import torch.distributed as dist

    def nccl_like_all_reduce(tensor, op=None, **_):
        tensor.copy_(sum(tensor * (r + 1) for r in range(2)) // 2)  # 2 ranks, rank r holds (r + 1) x base

    monkeypatch.setattr(dist, "all_reduce", nccl_like_all_reduce)
    assert "avg" in collectives.verify_op("all_reduce", "avg", torch.int64, 0, 2, 5, torch.device("cpu"))


def test_the_device_helpers_wait_for_a_gpu_and_read_its_memory(monkeypatch):
    """On a GPU the timings wait for the device and the peak is the allocator's; on the CPU neither is asked."""
    from common import device as device_module

    calls = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda d=None: calls.append(("sync", str(d))))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda d=None: 12345)
    device_module.device_time(torch.device("cpu"))
    assert calls == [] and device_module.peak_memory_bytes(torch.device("cpu")) is None
    device_module.device_time(torch.device("cuda", 0))
    assert calls == [("sync", "cuda:0")] and device_module.peak_memory_bytes(torch.device("cuda", 0)) == 12345
    assert (
        device_module.backend_for(torch.device("cuda", 0)) == "nccl"
        and device_module.backend_for("cpu") == "gloo"
    )


def test_train_gpt_takes_the_launch_configs_precision_when_not_given(monkeypatch):
    from common.config import parse_config

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert parse_config(train_gpt.Config, ["--report_to", "none"]).mixed_precision == "bf16"
    assert parse_config(train_gpt.Config, ["--mixed_precision", "no"]).mixed_precision == "no"
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert parse_config(train_gpt.Config, ["--report_to", "none"]).mixed_precision == "no"
