"""How a run meets its ranks (used by common/run.py, which owns the run's start and end).

- `launched_world_size`: how many ranks the launcher started, refusing a launch that asked for
  several processes but started one;
- `make_accelerator`: `Accelerator(...)` with the two settings our CPU-first world needs, Accelerate
  otherwise as shipped;
- `check_distributed`: prove the launch really made `world_size` distinct ranks.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import psutil
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from common.config import RunArgs, UsageError


def make_accelerator(
    cfg: RunArgs,
    output_dir: str,
    log_with=None,
    backend: str | None = None,
    extra_handlers=(),
    **accelerator_kwargs,
) -> Accelerator:
    """Accelerator(...) plus two settings and one refusal, all about never failing silently:

    - `cpu=True` when torch sees no accelerator. Accelerate 1.16 otherwise starts a multi-process launch
      on a CPU-only machine as N independent `DistributedType.NO` processes that each think they are
      rank 0 (measured). With cpu=True the same launch becomes MULTI_CPU over gloo. On a GPU machine
      this is False and Accelerate picks NCCL as usual.
    - a process-group timeout, so a dead or stuck rank ends the job instead of hanging it.
    Under a DeepSpeed accelerate config (which Accelerate CAN run on CPU), see deepspeed_on_cpu.
    """
    refuse_plugins_dropped_on_cpu(accelerator_kwargs)
    if accelerator_kwargs.get("mixed_precision") == "":
        accelerator_kwargs["mixed_precision"] = None  # "": whatever `accelerate launch` / its config says
    on_cpu = not torch.accelerator.is_available()
    deepspeed_cpu = on_cpu and deepspeed_stage() is not None
    try:
        with deepspeed_on_cpu() if deepspeed_cpu else contextlib.nullcontext():
            accelerator = Accelerator(
                cpu=on_cpu and not deepspeed_cpu,  # cpu=True would turn DeepSpeed off
                log_with=log_with or None,  # [] would warn that no tracker is installed
                project_dir=output_dir,
                kwargs_handlers=[
                    InitProcessGroupKwargs(
                        backend=backend or ("gloo" if deepspeed_cpu else None),
                        timeout=timedelta(seconds=cfg.dist_timeout_s),
                    ),
                    *extra_handlers,
                ],
                **accelerator_kwargs,
            )
    except ValueError as error:  # e.g. "Your assigned backend mpi is not available, please use gloo"
        raise UsageError(f"cannot start the run: {error}") from None
    if deepspeed_cpu:
        threads_as_for_multi_cpu()
    if deepspeed_stage() is not None and accelerator.distributed_type.value != "DEEPSPEED":
        # a DeepSpeed config with use_cpu: true on a GPU host: Accelerate turns DeepSpeed off, and train_gpt would
        # still pick DeepSpeed's engine
        raise UsageError(f"the accelerate config asks for DeepSpeed but Accelerate runs {accelerator.distributed_type.value}"
                         " (use_cpu: true turns DeepSpeed off on a GPU host): set use_cpu: false")  # fmt: skip
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # Accelerate 1.16 accepts fp16 on CPU and silently trains in float32 (measured): refuse instead.
        raise UsageError("--mixed_precision fp16 needs a GPU; on CPU use bf16 or no")
    return accelerator


def refuse_plugins_dropped_on_cpu(accelerator_kwargs: dict) -> None:
    """Accelerate 1.16 on CPU drops FSDP silently: `Accelerator(cpu=True, fsdp_plugin=...)` under a 2-rank
    launch is MULTI_CPU with a plain DDP model (measured; tests/test_runtime.py records it), and an FSDP
    launch config gives N independent DistributedType.NO processes. Refuse instead. (DeepSpeed does run
    on CPU: deepspeed_on_cpu.)"""
    if torch.accelerator.is_available():
        return
    asked = [name for name in ("fsdp_plugin", "parallelism_config") if accelerator_kwargs.get(name)]
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes"):
        asked.append("ACCELERATE_USE_FSDP")
    if asked:
        raise UsageError(
            f"{', '.join(asked)}: Accelerate cannot run FSDP on CPU and would silently run DDP instead; on CPU "
            "use experiments/train_gpt.py --strategy fsdp (PyTorch's fully_shard), or a DeepSpeed config "
            "(accelerate_configs/deepspeed_zero3.yaml)"
        )


def deepspeed_stage() -> int | None:
    """The ZeRO stage when `accelerate launch` runs a DeepSpeed config (it sets ACCELERATE_USE_DEEPSPEED and
    ACCELERATE_DEEPSPEED_ZERO_STAGE in every rank's environment), else None."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() not in ("1", "true", "yes"):
        return None
    return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))


@contextlib.contextmanager
def deepspeed_on_cpu():
    """The two settings Accelerate 1.16 + DeepSpeed 0.19 need to run a DeepSpeed config on CPU, in one place
    (each recorded upstream by tests/test_deepspeed.py, so we learn when it changes):
    - the process-group backend named (gloo, passed by make_accelerator): on CPU Accelerate leaves it None,
      and its state falls back to "no distributed" (num_processes 1 on every rank) while DeepSpeed's own
      group has all of them; prepare() then dies on DeepSpeed's batch-size assertion (measured);
    - DeepSpeed's shared-memory all-reduce op is not built: DeepSpeed JIT-compiles it with g++ when its
      communication backend starts (40 s here, and a failure on a machine without a compiler), and it
      serves inference all-reduces only; training's collectives go through torch.distributed (gloo).
      DeepSpeed keeps the ops it may build in deepspeed.ops.__compatible_ops__; the op is marked not
      compatible while the Accelerator starts its backend, and the mark is undone after.
    (And a third, after the Accelerator exists: threads_as_for_multi_cpu.)
    DeepSpeed fills that dict by compiling a test program per op; the one for async I/O fails to link
    without libaio and the linker's two error lines would land in every rank's output (they mean only
    "no NVMe offload"), so the probe runs with file descriptor 2 silenced."""
    import deepspeed.ops

    with _file_descriptor_silenced(2):  # the compiler is a child process: sys.stderr alone is not enough
        compatible = deepspeed.ops.__compatible_ops__
    before = compatible.get("deepspeed_shm_comm", False)
    compatible["deepspeed_shm_comm"] = False
    try:
        yield
    finally:
        compatible["deepspeed_shm_comm"] = before


def threads_as_for_multi_cpu() -> None:
    """For MULTI_CPU Accelerate sets torch's threads to physical cores / local ranks when OMP_NUM_THREADS is
    unset; for DEEPSPEED on CPU it does not (tests/test_deepspeed.py records it), and every rank takes every
    core: 2 ranks x 2 threads on 2 cores ran a tiny ZeRO-2 run in 8-37 s instead of 4.5 s (measured).
    Set here as Accelerate sets it for MULTI_CPU, at the run's start (as Accelerate does)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (psutil.cpu_count(logical=False) or 1) // local_ranks))


@contextlib.contextmanager
def _file_descriptor_silenced(fd: int):
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def launched_world_size(cfg: RunArgs) -> int:
    """How many ranks the launcher started: --expected_world_size, else WORLD_SIZE (set by torchrun and
    `accelerate launch` for multi-process runs), else 1.

    `accelerate launch` with `distributed_type: MULTI_CPU` and num_processes > 1 but no mpirun starts
    ONE process, with MASTER_ADDR set and no WORLD_SIZE (accelerate 1.16, measured). That one process
    would pass every check as a 1-rank run, so it is refused here."""
    if cfg.expected_world_size:
        return cfg.expected_world_size
    mpi_sizes = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
    if (
        os.environ.get("MASTER_ADDR")
        and "WORLD_SIZE" not in os.environ
        and not any(v in os.environ for v in mpi_sizes)
    ):
        raise UsageError(
            "this launch asked for several processes (MASTER_ADDR is set) but started one: accelerate's "
            "`distributed_type: MULTI_CPU` needs mpirun; use accelerate_configs/cpu_ddp.yaml or torchrun"
        )
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a whole number") from None


def check_distributed(accelerator: Accelerator, cfg: RunArgs) -> dict:
    """The `distributed` check: the ranks Accelerate sees are exactly the ranks that were launched.

    Gathering every rank's index is what catches the silent failure: N processes that each run alone
    gather only their own index, [0], not [0, 1, ..., N-1].
    """
    expected = launched_world_size(cfg)
    my_rank = torch.tensor([accelerator.process_index], device=accelerator.device)
    ranks = sorted(accelerator.gather(my_rank).tolist())
    passed = (
        accelerator.num_processes == expected
        and ranks == list(range(expected))
        and (expected == 1 or accelerator.distributed_type.value != "NO")
    )
    detail = (
        f"launched {expected}, Accelerate sees num_processes={accelerator.num_processes}, "
        f"distributed_type={accelerator.distributed_type.value}, gathered ranks {ranks}"
    )
    return {"passed": passed, "detail": detail}
