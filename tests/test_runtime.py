"""Unit tests of common/runtime.py: what Accelerate does on CPU with the plugins it cannot honour, and our
refusal of them; launches that asked for several processes but started one."""

from __future__ import annotations

import pytest

from common.config import RunArgs, UsageError
from common.runtime import launched_world_size, refuse_plugins_dropped_on_cpu


def accelerate_with_an_fsdp2_plugin(argv: list[str]) -> int:
    """Runs in each of 2 CPU ranks (forked from tests/helpers' fork server, torchrun's environment): what Accelerate
    makes of an FSDP2 plugin here, written to argv[0] + the rank."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    record = f"{accelerator.distributed_type.value} {accelerator.is_fsdp2} {type(model).__name__}\n"
    with open(argv[0] + str(accelerator.process_index), "w") as handle:
        handle.write(record)
    accelerator.end_training()
    return 0


@pytest.mark.launch
def test_accelerate_still_drops_fsdp_on_cpu_silently(tmp_path):
    """The fallback our refusal exists for, recorded: when this fails, Accelerate changed (re-measure,
    and perhaps let train_gpt use Accelerate's FSDP path). Two ranks from the fork server (Accelerate's
    debug_launcher forks the xdist worker itself, which deadlocked or lost a rank under a loaded suite)."""
    from helpers import fork_launch

    record = str(tmp_path / "rank")
    finished = fork_launch(accelerate_with_an_fsdp2_plugin, [record], tmp_path / "run", output_flag=False)
    assert finished.returncode == 0, finished.stderr[-2000:]
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
