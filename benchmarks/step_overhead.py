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
So accelerate - accelerate_no_accumulate is accumulate()'s cost, and so on down to bare.
Figure: steps/s of each, the ratio accelerate / bare (target >= 0.95) and the overhead in µs per step.

    python benchmarks/step_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import benchmark_parser, run_worker, spawn, write_result

LOOPS = ("bare", "bare_again", "bare_plus_common", "accelerate_model", "accelerate_no_accumulate", "accelerate")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from common.config import RunArgs
    from common.data import iterate_batches, make_regression_dataset, shard_tensors
    from common.models import build_linear
    from common.reliability import Heartbeat
    from common.runtime import make_accelerator

    folder = tempfile.mkdtemp()
    accelerator = make_accelerator(RunArgs(), folder)
    rank, world = accelerator.process_index, accelerator.num_processes
    dataset, _ = make_regression_dataset(1000, 10, 0.1, 0)
    x, y = shard_tensors(dataset, rank, world)

    def bare_loop(with_common: bool):
        """One step per call of a torch-only DDP loop; with_common adds what common/ does per step."""
        model = DistributedDataParallel(build_linear(10, seed=0))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches, heartbeat = iterate_batches(x, y, 32, 0), Heartbeat(os.path.join(folder, str(with_common)), rank, world)
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
        """"accelerate" is the body of ddp_linear's training loop; the other two leave parts of Accelerate out."""
        plain = build_linear(10, seed=0)
        model, optimizer = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        if name == "accelerate_model":
            optimizer = optimizer.optimizer  # the torch optimizer the AcceleratedOptimizer wraps
        backward = (lambda loss: loss.backward()) if name == "accelerate_model" else accelerator.backward
        step_context = (lambda: accelerator.accumulate(model)) if name == "accelerate" else contextlib.nullcontext
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

        return one_step

    loops = {"bare": bare_loop(False), "bare_again": bare_loop(False), "bare_plus_common": bare_loop(True),
             **{name: accelerate_loop(name) for name in ("accelerate_model", "accelerate_no_accumulate", "accelerate")}}
    seconds = {name: [] for name in LOOPS}
    for turn in range(args.warmup + args.steps):
        # ABBA: a loop's step never always follows the same other loop, so caches and order effects hit all alike
        for name in LOOPS if turn % 2 == 0 else LOOPS[::-1]:
            started = time.perf_counter()
            loops[name]()
            if turn >= args.warmup:
                seconds[name].append(time.perf_counter() - started)
    step_s = {}
    for name in LOOPS:
        per_step = torch.tensor(seconds[name], dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # a DDP step is as slow as its slowest rank
        step_s[name] = per_step.median().item()
    if rank == 0:
        ratio = step_s["bare"] / step_s["accelerate"]
        write_result(args.result, {
            "world_size": world, "steps_per_loop": args.steps,
            **{f"{name}_steps_per_s": 1 / step_s[name] for name in LOOPS},
            "ratio": ratio, "noise_floor_ratio": step_s["bare"] / step_s["bare_again"],
            "overhead_us": {"common": 1e6 * (step_s["bare_plus_common"] - step_s["bare"]),
                            "prepared_model": 1e6 * (step_s["accelerate_model"] - step_s["bare_plus_common"]),
                            "backward_and_optimizer": 1e6 * (step_s["accelerate_no_accumulate"] - step_s["accelerate_model"]),
                            "accumulate": 1e6 * (step_s["accelerate"] - step_s["accelerate_no_accumulate"]),
                            "accelerate_and_common": 1e6 * (step_s["accelerate"] - step_s["bare"])},
            "target": 0.95, "met": ratio >= 0.95,
        })
    accelerator.wait_for_everyone()  # then run_worker's shutdown: no rank tears down while another still works


def run(quick: bool = False) -> dict:
    result = spawn("step_overhead.py", 2, ["--steps", "300" if quick else "6000", "--warmup", "50" if quick else "300"])
    print(f"step overhead: bare DDP {result['bare_steps_per_s']:.0f} steps/s (again: {result['bare_again_steps_per_s']:.0f}), "
          f"+ common/ {result['bare_plus_common_steps_per_s']:.0f}, Accelerate + common/ {result['accelerate_steps_per_s']:.0f} steps/s: "
          f"ratio {result['ratio']:.3f} (target >= 0.95; noise floor {result['noise_floor_ratio']:.3f}); "
          f"overhead per step: " + ", ".join(f"{part} {us:.0f} µs" for part, us in result["overhead_us"].items()))
    return result


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument("--steps", type=int, default=6000, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(worker, args)
    else:
        run(args.quick)


if __name__ == "__main__":
    main()
