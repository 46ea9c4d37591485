"""The three things every experiment does before and right after it meets its ranks.

- `prepare_output_dir`: refuse to write over a finished run (before any process group exists);
- `make_accelerator`: `Accelerator(...)` with the two settings our CPU-first world needs (and one
  measured per-step cost of Accelerate's removed, see `remove_per_step_lookups`);
- `check_distributed`: prove the launch really made `world_size` distinct ranks.
"""

from __future__ import annotations

import functools
import inspect
import os
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from common.config import RunArgs, UsageError


def prepare_output_dir(cfg: RunArgs, experiment: str, resuming: bool = False) -> str:
    """Resolve --output_dir; a finished run there is kept unless --overwrite.

    Default: runs/<experiment>, or under a W&B sweep (the agent sets WANDB_SWEEP_ID and WANDB_RUN_ID)
    one folder per trial, <folder of WANDB_SWEEP_PARAM_PATH or runs/sweeps/<sweep id>>/<run id>,
    so trials never collide."""
    default = os.path.join("runs", experiment)
    sweep_id, run_id = os.environ.get("WANDB_SWEEP_ID"), os.environ.get("WANDB_RUN_ID")
    if sweep_id and run_id:
        param_path = os.environ.get("WANDB_SWEEP_PARAM_PATH")
        default = os.path.join(os.path.dirname(param_path) if param_path else os.path.join("runs", "sweeps", sweep_id), run_id)
    output_dir = os.path.abspath(cfg.output_dir or default)
    if os.path.exists(os.path.join(output_dir, "summary.json")) and not (cfg.overwrite or resuming):
        raise UsageError(f"--output_dir {output_dir} already holds a finished run (summary.json); pass --overwrite, --resume_from_checkpoint or another --output_dir")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"--output_dir {output_dir} exists and is not a directory")
    return output_dir


def remove_per_step_lookups() -> None:
    """Two answers Accelerate 1.16 recomputes on every optimizer step, computed once instead.

    - AcceleratedOptimizer.step() asks `is_lomo_available()` twice per step: an uncached
      importlib.util.find_spec over sys.path. We measured optimizer.step() + zero_grad() at 135 µs
      against 19 µs for the bare torch optimizer. Whether a package is installed cannot change during
      a run, so the answer is cached.
    - AcceleratedOptimizer.zero_grad() calls `inspect.signature(optimizer.zero_grad)` on every call,
      25-35 µs here, to learn whether it takes `set_to_none`: asked once per optimizer instead (the
      same method otherwise, line for line; only for the version whose code it repeats).
    Both were a few % of ddp_linear's 0.8 ms 2-rank step (benchmarks/step_overhead.py). Remove once
    Accelerate caches them itself."""
    import accelerate
    import accelerate.optimizer

    if not hasattr(accelerate.optimizer.is_lomo_available, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(accelerate.optimizer.is_lomo_available)
    if accelerate.__version__ == "1.16.0":
        accelerate.optimizer.AcceleratedOptimizer.zero_grad = _zero_grad_asking_the_signature_once


def _zero_grad_asking_the_signature_once(self, set_to_none=None):
    """accelerate 1.16.0's AcceleratedOptimizer.zero_grad, with its signature check done once per optimizer."""
    if self.gradient_state.sync_gradients:
        accept_arg = self.__dict__.get("_zero_grad_takes_set_to_none")
        if accept_arg is None:
            accept_arg = self._zero_grad_takes_set_to_none = "set_to_none" in inspect.signature(self.optimizer.zero_grad).parameters
        if accept_arg:
            if set_to_none is None:
                set_to_none = True
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            if set_to_none is not None:
                raise ValueError("`set_to_none` for Optimizer.zero_grad` is not supported by this optimizer.")
            self.optimizer.zero_grad()


def make_accelerator(cfg: RunArgs, output_dir: str, log_with=None, backend: str | None = None, extra_handlers=(),
                     **accelerator_kwargs) -> Accelerator:
    """Accelerator(...) plus two settings and one refusal, all about never failing silently:

    - `cpu=True` when torch sees no accelerator. Accelerate 1.16 otherwise starts a multi-process launch
      on a CPU-only machine as N independent `DistributedType.NO` processes that each think they are
      rank 0 (measured). With cpu=True the same launch becomes MULTI_CPU over gloo. On a GPU machine
      this is False and Accelerate picks NCCL as usual.
    - a process-group timeout, so a dead or stuck rank ends the job instead of hanging it.
    """
    remove_per_step_lookups()
    if accelerator_kwargs.get("mixed_precision") == "":
        accelerator_kwargs["mixed_precision"] = None  # "": whatever `accelerate launch` / its config says
    try:
        accelerator = Accelerator(
            cpu=not torch.accelerator.is_available(),
            log_with=log_with or None,  # [] would warn that no tracker is installed
            project_dir=output_dir,
            kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=cfg.dist_timeout_s)), *extra_handlers],
            **accelerator_kwargs,
        )
    except ValueError as error:  # e.g. "Your assigned backend mpi is not available, please use gloo"
        raise UsageError(f"cannot start the run: {error}") from None
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # Accelerate 1.16 accepts fp16 on CPU and silently trains in float32 (measured): refuse instead.
        raise UsageError("--mixed_precision fp16 needs a GPU; on CPU use bf16 or no")
    return accelerator


def one_rank_group_if_needed() -> bool:
    """Experiments about the raw torch.distributed API need a process group even in one process, where
    Accelerate makes none: a 1-rank gloo group on a port the OS picks. True when it made one (the caller
    destroys it)."""
    if torch.distributed.is_initialized():
        return False
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    return True


def launched_world_size(cfg: RunArgs) -> int:
    """How many ranks the launcher started: --expected_world_size, else WORLD_SIZE (set by torchrun and
    `accelerate launch` for multi-process runs), else 1."""
    if cfg.expected_world_size:
        return cfg.expected_world_size
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
