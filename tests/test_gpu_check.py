"""scripts/gpu_check.sh (tools/gpu_check.py) on a machine without a GPU: --dry_run lists every command a GPU owner
will run, a real run refuses in one line, bad flags are refused. (Its runs are the experiments' own; on a GPU
machine the script is the test.)"""

from __future__ import annotations

import subprocess

from helpers import REPO
from tools import gpu_check


def test_the_dry_run_lists_every_gpu_path(capsys):
    assert gpu_check.main(["--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = {line.split("] ")[1].split(":")[0] for line in lines}
    assert {"ddp_linear", "collectives", "loss_normalization", "manual_data_parallel", "train_gpt_bf16",
            "train_gpt_moe_bf16", "train_gpt_ddp", "train_gpt_fsdp", "train_gpt_zero2", "train_gpt_tp2_sp",
            "train_gpt_pp2", "train_gpt_ep2", "train_gpt_cp2", "deepspeed_zero2", "fault_tolerance_nccl",
            "train_gpt_fsdp2_tp2", "pytest_gpu_tier", "train_gpt_hf_llama_bf16", "train_gpt_hf_fsdp",
            "train_gpt_hf_tp2"} <= names  # fmt: skip
    hf = next(line for line in lines if "] train_gpt_hf_tp2:" in line)
    assert "--hf_config llama_tiny" in hf and "--tp=2" in hf
    # what at_scale beside a run is given: train_gpt's own
    from common.gpt import PER_RANK_BATCH_SIZE, GPTConfig

    assert (gpu_check.PER_RANK_BATCH_SIZE, gpu_check.VOCABULARY) == (
        PER_RANK_BATCH_SIZE,
        GPTConfig().vocab_size,
    )
    multi = [line for line in lines if line.startswith("[2 GPUs] train_gpt_ddp")]
    assert "multi_gpu_ddp.yaml --num_processes 2" in multi[0] and "--dp_replicate=2" in multi[0]
    assert "deepspeed_zero2.yaml" in next(line for line in lines if "] deepspeed_zero2:" in line)
    assert all(("--output_dir" in line) != ("pytest" in line) for line in lines)


def test_the_script_without_a_gpu_says_so_in_one_line_and_exits_2():
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "no GPU visible" in done.stderr and "--dry_run" in done.stderr


def test_bad_flags_are_refused(capsys):
    import pytest

    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--only", "train_gpt_tp3"])
    assert stop.value.code == 2 and "--only train_gpt_tp3: no such check" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--max_steps", "3"])
    assert stop.value.code == 2 and "--max_steps must be >= 10" in capsys.readouterr().err
