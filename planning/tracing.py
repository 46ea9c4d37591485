"""Running a module on fake tensors under the op recorder a fake rank records with (planning/ops.OpRecorder):
what planning/compute_ops.py and planning/kernels.py build their op lists from."""

from __future__ import annotations

from collections import Counter

import torch

from planning.ops import OpRecorder


def built(make, dtype):
    """`make()`'s module with its parameters in `dtype` (fake tensors cannot be converted after)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return make()
    finally:
        torch.set_default_dtype(default)


def record(run, autocast: bool) -> dict[str, Counter]:
    """`run(recorder)`'s ops on fake tensors, as a fake rank records them; `run` sets the phase."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), OpRecorder() as recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            run(recorder)
    return recorder.calls


def dense(calls: dict[str, Counter]) -> dict[str, list]:
    """The forward's and backward's calls that move data or compute ([(OpCall, count)]; views and allocations left out)."""
    return {phase: [(c, n) for c, n in calls.get(phase, Counter()).items() if c.kind != "view"]
            for phase in ("forward", "backward")}  # fmt: skip


def module_ops(build_and_run, autocast: bool) -> dict[str, Counter]:
    """The ops of a module run alone (forward, then backward from an empty gradient): what kernels.fused takes out of
    a block's eager list to put its fused kernel in. `build_and_run(recorder)` builds its inputs, clears what the
    recorder saw of that, and returns the output."""

    def run(recorder):
        out = build_and_run(recorder)
        recorder.phase = "backward"
        out.backward(torch.empty_like(out))

    return record(run, autocast)
