"""Benchmark 1: does Accelerate + common/ cost anything per training step?

ddp_linear's training step (Accelerate's prepared DDP model, accumulate(), backward(), our batch
iterator, heartbeat and loss window) against a bare torch.distributed DDP loop: same model, batch and
data, 2 CPU ranks with 1 thread each, in ONE run. The loops take turns step by step (ABBA order), each
step timed alone; a step's time is the slowest rank's, and each loop's figure is its median step.
Rounds of many steps per loop were too noisy here: two identical bare DDP loops measured 636 and 989
steps/s back to back. Four more loops locate the cost:
- bare_again: a second, identical bare loop: the noise floor of the comparison (should read 1.00);
- bare_plus_common: the bare loop plus common/'s per-step work (iterator, heartbeat, loss window);
- accelerate_model: bare_plus_common on Accelerate's prepared DDP model (torch's optimizer, loss.backward());
- accelerate_no_accumulate: that plus accelerator.backward() and the AcceleratedOptimizer.
So accelerate - accelerate_no_accumulate is accumulate()'s cost, and so on down to bare. And one
variant that is NOT what the experiments run:
- accelerate_cached_lookups: `accelerate` with two answers Accelerate 1.16 recomputes every step
  asked once (`is_lomo_available()`, an uncached importlib search, twice per optimizer.step(); the
  signature check in AcceleratedOptimizer.zero_grad()). Applied around this loop's steps only, so the
  experiments, and the `accelerate` row, run Accelerate as shipped.
Figure: steps/s of each, the ratio accelerate / bare (target >= 0.95) and the overhead in µs per step.

    python benchmarks/step_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workers import benchmark_parser, run_worker, scratch_folder, spawn, write_result
from common.config import finite_float

LOOPS = (
    "bare",
    "bare_again",
    "bare_plus_common",
    "accelerate_model",
    "accelerate_no_accumulate",
    "accelerate",
    "accelerate_cached_lookups",
)


@contextlib.contextmanager
def lookups_asked_once():
    """Accelerate 1.16's two per-step lookups answered once (the `accelerate_cached_lookups` variant).
    Whether a package is installed, or what an optimizer's zero_grad accepts, cannot change mid-run."""
    import functools
    import inspect

    import accelerate.optimizer as accelerated

    lookup, zero_grad = accelerated.is_lomo_available, accelerated.AcceleratedOptimizer.zero_grad
    cached_lookup = lookups_asked_once.__dict__.setdefault("cached", functools.cache(lookup))

    def zero_grad_asking_once(self, set_to_none=None):  # accelerate 1.16.0's zero_grad, signature asked once
        if self.gradient_state.sync_gradients:
            takes = self.__dict__.get("_takes_set_to_none")
            if takes is None:
                takes = self._takes_set_to_none = (
                    "set_to_none" in inspect.signature(self.optimizer.zero_grad).parameters
                )
            if takes:
                self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)
            else:
                self.optimizer.zero_grad()

    accelerated.is_lomo_available, accelerated.AcceleratedOptimizer.zero_grad = (
        cached_lookup,
        zero_grad_asking_once,
    )
    try:
        yield
    finally:
        accelerated.is_lomo_available, accelerated.AcceleratedOptimizer.zero_grad = lookup, zero_grad


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from common.config import RunArgs
    from common.data import iterate_batches, make_regression_dataset, shard_tensors
    from common.models import build_linear
    from common.reliability import Heartbeat
    from common.runtime import make_accelerator

    folder = scratch_folder(args)
    from common.device import device_time

    accelerator = make_accelerator(RunArgs(), folder)
    rank, world = accelerator.process_index, accelerator.num_processes
    dataset, _ = make_regression_dataset(1000, 10, 0.1, 0)
    x, y = shard_tensors(dataset, rank, world)

    def bare_loop(with_common: bool):
        """One step per call of a torch-only DDP loop; with_common adds what common/ does per step."""
        model = DistributedDataParallel(build_linear(10, seed=0))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches, heartbeat = (
            iterate_batches(x, y, 32, 0),
            Heartbeat(os.path.join(folder, str(with_common)), rank, world),
        )
        window_loss, step = torch.zeros(()), 0

        def one_step():
            nonlocal step
            if with_common:
                xb, yb = next(batches)
                heartbeat.entering(step + 1)
            else:
                start = (step * 32) % (len(x) - 32)
                xb, yb = x[start : start + 32], y[start : start + 32]  # raw slicing, no iterator
            loss = F.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if with_common:
                window_loss.add_(loss.detach())
                heartbeat.finished(step)

        return one_step

    def accelerate_loop(name: str):
        """ "accelerate" is the body of ddp_linear's training loop; the other two leave parts of Accelerate out."""
        plain = build_linear(10, seed=0)
        model, optimizer = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        if name == "accelerate_model":
            optimizer = optimizer.optimizer  # the torch optimizer the AcceleratedOptimizer wraps
        backward = (lambda loss: loss.backward()) if name == "accelerate_model" else accelerator.backward
        with_accumulate = name in ("accelerate", "accelerate_cached_lookups")
        step_context = (lambda: accelerator.accumulate(model)) if with_accumulate else contextlib.nullcontext
        batches, heartbeat = iterate_batches(x, y, 32, 0), Heartbeat(os.path.join(folder, name), rank, world)
        window_loss, step = torch.zeros(()), 0

        def one_step():
            nonlocal step
            xb, yb = next(batches)
            heartbeat.entering(step + 1)
            with step_context():
                loss = F.mse_loss(model(xb), yb)
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            window_loss.add_(loss.detach())
            step += 1
            heartbeat.finished(step)
            if name == args.slow_loop:  # a deliberately slowed loop, which the figures must show
                until = time.perf_counter() + args.slow_us * 1e-6
                while time.perf_counter() < until:
                    pass

        return one_step

    loops = {
        "bare": bare_loop(False),
        "bare_again": bare_loop(False),
        "bare_plus_common": bare_loop(True),
        **{name: accelerate_loop(name) for name in LOOPS[3:]},
    }
    seconds = {name: [] for name in LOOPS}
    for turn in range(args.warmup + args.steps):
        # ABBA: a loop's step never always follows the same other loop, so caches and order effects hit all alike
        for name in LOOPS if turn % 2 == 0 else LOOPS[::-1]:
            with lookups_asked_once() if name == "accelerate_cached_lookups" else contextlib.nullcontext():
                started = device_time(accelerator.device)  # the device's time for the step, on a GPU too
                loops[name]()
                elapsed = device_time(accelerator.device) - started
            if turn >= args.warmup:
                seconds[name].append(elapsed)
    step_s = {}
    for name in LOOPS:
        # on the group's device: NCCL takes no host tensors
        per_step = torch.tensor(seconds[name], dtype=torch.float64, device=accelerator.device)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # a DDP step is as slow as its slowest rank
        step_s[name] = per_step.median().item()
    if rank == 0:
        ratio = step_s["bare"] / step_s["accelerate"]
        write_result(
            args.result,
            {
                "world_size": world,
                "steps_per_loop": args.steps,
                **{f"{name}_steps_per_s": 1 / step_s[name] for name in LOOPS},
                "ratio": ratio,
                "noise_floor_ratio": step_s["bare"] / step_s["bare_again"],
                "overhead_us": {
                    "common": 1e6 * (step_s["bare_plus_common"] - step_s["bare"]),
                    "prepared_model": 1e6 * (step_s["accelerate_model"] - step_s["bare_plus_common"]),
                    "backward_and_optimizer": 1e6
                    * (step_s["accelerate_no_accumulate"] - step_s["accelerate_model"]),
                    "accumulate": 1e6 * (step_s["accelerate"] - step_s["accelerate_no_accumulate"]),
                    "lookups_saved_by_caching": 1e6
                    * (step_s["accelerate"] - step_s["accelerate_cached_lookups"]),
                    "accelerate_and_common": 1e6 * (step_s["accelerate"] - step_s["bare"]),
                },
                "target": 0.95,
                "met": ratio >= 0.95,
            },
        )
    return accelerator  # run_worker shuts it down


def run(quick: bool = False, slow_loop: str = "", slow_us: float = 0.0) -> dict:
    result = spawn(
        "step_overhead.py",
        2,
        [
            "--steps",
            "150" if quick else "6000",
            "--warmup",
            "25" if quick else "300",
            "--slow_loop",
            slow_loop,
            "--slow_us",
            str(slow_us),
        ],
    )
    print(
        f"step overhead: bare DDP {result['bare_steps_per_s']:.0f} steps/s (again: "
        f"{result['bare_again_steps_per_s']:.0f}), "
        f"+ common/ {result['bare_plus_common_steps_per_s']:.0f}, "
        f"Accelerate + common/ {result['accelerate_steps_per_s']:.0f} steps/s: "
        f"ratio {result['ratio']:.3f} (target >= 0.95; noise floor {result['noise_floor_ratio']:.3f}); "
        f"overhead per step: "
        + ", ".join(f"{part} {us:.0f} µs" for part, us in result["overhead_us"].items())
    )
    return result


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument("--steps", type=int, default=6000, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=300, help=argparse.SUPPRESS)
    parser.add_argument(
        "--slow_loop", default="", choices=("", *LOOPS[3:]), help="for tests: slow this loop down on purpose"
    )
    parser.add_argument(
        "--slow_us", type=finite_float, default=0.0, help="for tests: by this many µs per step"
    )
    args = parser.parse_args()
    if args.worker:
        run_worker(worker, args)
    else:
        run(args.quick, args.slow_loop, args.slow_us)


if __name__ == "__main__":
    main()
