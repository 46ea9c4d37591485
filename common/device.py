"""The run's device, in the few places where a GPU differs from the CPU: which device type a launch will run on
(before any Accelerator exists, for refusals), the process-group backend for a device, timings that wait for
the device, and the device's own memory. Everything else is the same code on every device: tensors go to
`accelerator.device`, and that is all.

Why timings need a sync: a CUDA kernel launch returns before the kernel runs, so `time.perf_counter()` around
GPU work measures the launches (microseconds), not the work. torch.accelerator.synchronize() waits for every
kernel queued on the device; on the CPU there is nothing to wait for and it is skipped.
"""

from __future__ import annotations

import os
import time

import torch

# DIST_REHEARSAL names the device type a CPU rehearsal stands in for (common/rehearsal.py): refusals made
# before start-up then answer as they would on that device.
REHEARSAL_ENV = "DIST_REHEARSAL"


def planned_device_type() -> str:
    """The device type this launch will train on, known before the Accelerator starts: an accelerator's (cuda)
    where torch sees one and Accelerate is not told to stay on the CPU; the rehearsed one in a CPU rehearsal."""
    rehearsed = os.environ.get(REHEARSAL_ENV, "")
    if rehearsed:
        return "cuda" if rehearsed in ("1", "true") else rehearsed
    if os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"):
        return "cpu"
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def process_device(slot: int) -> torch.device:
    """The device of a process this program started itself (not a launcher's rank: those get accelerator.device),
    the `slot`-th of this machine: its own accelerator where torch sees any (slot modulo their count), else the
    CPU."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, slot % torch.accelerator.device_count())


def backend_for(device: torch.device | str) -> str:
    """The process-group backend PyTorch uses for tensors on `device` (cpu: gloo, cuda: nccl)."""
    device_type = torch.device(device).type
    return torch.distributed.Backend.default_device_backend_map.get(device_type, "gloo")


def synchronize(device: torch.device | str | None) -> None:
    """Wait until every kernel queued on `device` has run (nothing to wait for on the CPU)."""
    if device is not None and torch.device(device).type != "cpu":
        torch.accelerator.synchronize(torch.device(device))


def device_time(device: torch.device | str | None) -> float:
    """time.perf_counter() once the device has finished its queued work: the difference of two calls is the
    device's time for what ran between them, on any device."""
    synchronize(device)
    return time.perf_counter()


def peak_memory_bytes(device: torch.device | str | None) -> int | None:
    """The most bytes the run's tensors held on `device` at once (torch's caching allocator:
    max_memory_allocated), or None on the CPU, which has no such counter (the host's RSS is measured instead)."""
    if device is None or torch.device(device).type == "cpu":
        return None
    return int(torch.accelerator.max_memory_allocated(torch.device(device)))


def device_memory_bytes(device_type: str) -> tuple[int, int] | None:
    """(free, total) bytes of the current accelerator of `device_type`, or None for the CPU (or a rehearsal:
    no such device here)."""
    if device_type == "cpu" or not torch.accelerator.is_available():
        return None
    free, total = torch.accelerator.get_memory_info()
    return int(free), int(total)
