"""The GPU tier: what only a GPU can show, skipped (with the reason) where torch sees none. scripts/gpu_check.sh
runs it on a GPU machine beside every experiment's GPU run; here `pytest -m gpu` collects it and skips it. What a
GPU run would crash on is caught on the CPU by the rehearsal (tests/test_rehearsal.py)."""

from __future__ import annotations

import pytest
import torch

from common.device import device_time, peak_memory_bytes
from experiments import collectives, train_gpt
from helpers import GPT_TINY, run_in_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU tier runs on a GPU machine "
                       "(bash scripts/gpu_check.sh); the CPU rehearsal stands in here (tests/test_rehearsal.py)"),
]  # fmt: skip


def test_a_train_gpt_step_runs_on_the_device_and_its_peak_is_the_devices(tmp_path, capsys):
    finished = run_in_process(train_gpt.main, [*GPT_TINY, "--mixed_precision", "bf16", "--parity_steps_bf16", "6"],
                              tmp_path / "run", capsys)  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    (held,) = finished.summary["metrics"]["bytes_per_rank"]
    # the device held at least the parameters, gradients and AdamW state the theory counts
    assert held["peak_device_bytes"] >= held["params"] + held["grads"] + held["optimizer"]
    assert finished.summary["config"]["mixed_precision"] == "bf16"


def test_the_device_timer_waits_for_the_kernels():
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    started = device_time(device)
    for _ in range(20):
        a = a @ a / 64
    waited = device_time(device) - started
    launched_only = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    launched_only[0].record()
    for _ in range(20):
        a = a @ a / 64
    launched_only[1].record()
    torch.cuda.synchronize()
    kernels_s = launched_only[0].elapsed_time(launched_only[1]) / 1e3
    assert waited > 0.5 * kernels_s  # the timer saw the kernels' time, not only their launches
    assert peak_memory_bytes(device) >= 4096 * 4096 * 4


def test_collectives_on_one_gpu_use_nccl(tmp_path, capsys):
    finished = run_in_process(collectives.main, ["--report_to", "none"], tmp_path / "run", capsys)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.summary["metrics"]["backend"] == "nccl"
