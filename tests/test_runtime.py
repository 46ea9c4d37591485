"""Unit tests of common/runtime.py: what Accelerate does on CPU with the plugins it cannot honour, and our
refusal of them; launches that asked for several processes but started one."""

from __future__ import annotations

import os

import pytest

from common.config import RunArgs, UsageError
from common.runtime import launched_world_size, refuse_plugins_dropped_on_cpu


def _accelerate_with_an_fsdp2_plugin():
    """Runs in each of 2 forked CPU ranks: what Accelerate makes of an FSDP2 plugin here."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    record = f"{accelerator.distributed_type.value} {accelerator.is_fsdp2} {type(model).__name__}\n"
    with open(os.environ["FALLBACK_RECORD"] + str(accelerator.process_index), "w") as handle:
        handle.write(record)


@pytest.mark.launch
def test_accelerate_still_drops_fsdp_on_cpu_silently(tmp_path, monkeypatch):
    """The fallback our refusal exists for, recorded: when this fails, Accelerate changed (re-measure,
    and perhaps let train_gpt use Accelerate's FSDP path)."""
    from accelerate import debug_launcher

    monkeypatch.setenv("FALLBACK_RECORD", str(tmp_path / "rank"))
    debug_launcher(_accelerate_with_an_fsdp2_plugin, num_processes=2)
    records = {(tmp_path / f"rank{r}").read_text().strip() for r in (0, 1)}
    assert records == {"MULTI_CPU False DistributedDataParallel"}


def test_plugins_accelerate_would_drop_are_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    with pytest.raises(
        UsageError, match="fsdp_plugin: Accelerate cannot run FSDP on CPU and would silently run DDP"
    ):
        refuse_plugins_dropped_on_cpu({"fsdp_plugin": object()})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what an FSDP launch config sets
    with pytest.raises(UsageError, match="ACCELERATE_USE_FSDP: .*train_gpt.py --strategy fsdp"):
        refuse_plugins_dropped_on_cpu({})
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    refuse_plugins_dropped_on_cpu({"mixed_precision": "bf16"})  # nothing to refuse
    monkeypatch.setenv(
        "ACCELERATE_USE_DEEPSPEED", "true"
    )  # DeepSpeed does run on CPU (tests/test_deepspeed.py)
    refuse_plugins_dropped_on_cpu({})


def test_a_launch_that_asked_for_ranks_but_started_one_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(UsageError, match="MULTI_CPU` needs mpirun"):
        launched_world_size(RunArgs())
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_world_size(RunArgs()) == 2
