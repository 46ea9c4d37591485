"""Benchmark 1: does Accelerate + common/ cost anything per training step?

ddp_linear's training step (Accelerate's prepared DDP model, accumulate(), backward(), our batch
iterator and heartbeat) against a bare torch.distributed DDP loop: same model, batch, data, 2 CPU
ranks with 1 thread each, in ONE run, in many short rounds whose order alternates (ABBA) so drift and
order effects hit both; medians over rounds. Figure: steps/s of each and the ratio accelerate / bare (target >= 0.95).

    python benchmarks/step_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import benchmark_parser, median, run_worker, spawn, write_result


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

    bare_model = DistributedDataParallel(build_linear(10, seed=0))  # the bare loop: torch only
    bare_optimizer = torch.optim.SGD(bare_model.parameters(), lr=0.1)
    bare_x, bare_y = x.clone(), y.clone()

    plain = build_linear(10, seed=0)
    model, optimizer = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    batches = iterate_batches(x, y, 32, 0)
    heartbeat = Heartbeat(folder, rank, world)
    window_loss = torch.zeros(())

    def bare_steps(n: int) -> None:
        for i in range(n):
            start = (i * 32) % (len(bare_x) - 32)
            xb, yb = bare_x[start : start + 32], bare_y[start : start + 32]  # raw slicing, no iterator
            loss = F.mse_loss(bare_model(xb), yb)
            bare_optimizer.zero_grad()
            loss.backward()
            bare_optimizer.step()

    def accelerate_steps(n: int) -> None:  # the body of ddp_linear's loop
        nonlocal window_loss
        for step in range(n):
            xb, yb = next(batches)
            heartbeat.entering(step + 1)
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            window_loss += loss.detach()
            heartbeat.finished(step + 1)

    rates = {"bare": [], "accelerate": []}
    bare_steps(50)
    accelerate_steps(50)  # warm-up both
    for round_index in range(args.rounds):
        # ABBA order: on 2 busy cores a loop's speed drifts by +-30% between rounds (two identical bare DDP
        # models measured 636 and 989 steps/s back to back); alternating who goes first cancels order effects.
        order = (("bare", bare_steps), ("accelerate", accelerate_steps))
        for name, fn in order if round_index % 2 == 0 else order[::-1]:
            dist.barrier()
            started = time.perf_counter()
            fn(args.steps)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rates[name].append(args.steps / elapsed.item())
    if rank == 0:
        bare, accel = median(rates["bare"]), median(rates["accelerate"])
        write_result(args.result, {"world_size": world, "steps_per_round": args.steps, "rounds": args.rounds,
                                   "bare_steps_per_s": bare, "accelerate_steps_per_s": accel, "ratio": accel / bare,
                                   "target": 0.95, "met": accel / bare >= 0.95})
    accelerator.wait_for_everyone()  # then run_worker's shutdown: no rank tears down while another still works


def run(quick: bool = False) -> dict:
    args = ["--steps", "100" if quick else "200", "--rounds", "4" if quick else "40"]
    result = spawn("step_overhead.py", 2, args)
    print(f"step overhead: bare DDP {result['bare_steps_per_s']:.0f} steps/s, Accelerate + common/ "
          f"{result['accelerate_steps_per_s']:.0f} steps/s, ratio {result['ratio']:.3f} (target >= 0.95)")
    return result


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument("--steps", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=9, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(worker, args)
    else:
        run(args.quick)


if __name__ == "__main__":
    main()
