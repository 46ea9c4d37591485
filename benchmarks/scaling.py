"""Benchmark 3: how well does data parallelism scale on this machine?

A compute-bound MLP (--width, 4 layers) trained through Accelerate on 1 rank and on 2 ranks (1 thread
each), samples/s and scaling efficiency = samples/s(2) / (2 x samples/s(1)); then on 2 ranks with
gradient accumulation 4 (one all-reduce per 4 micro-batches) and with DDP buckets of 1 MiB and 25 MiB.
Per-rank batch is fixed (weak scaling), as in data-parallel training.

    python benchmarks/scaling.py [--quick] [--width 1024]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workers import benchmark_parser, run_worker, scratch_folder, spawn, write_result
from common.config import finite_float


def worker(args):

    import torch
    import torch.nn.functional as F
    from accelerate.utils import DistributedDataParallelKwargs

    from common.config import RunArgs
    from common.models import build_mlp
    from common.runtime import make_accelerator

    handlers = [DistributedDataParallelKwargs(bucket_cap_mb=args.bucket_mb)] if args.bucket_mb else []
    accelerator = make_accelerator(
        RunArgs(),
        scratch_folder(args),
        gradient_accumulation_steps=args.accumulation,
        extra_handlers=handlers,
    )
    model = build_mlp(64, args.width, 1, seed=0, n_layers=4)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-4))
    x, y = torch.randn(args.batch, 64), torch.randn(args.batch, 1)

    def micro_steps(n):
        for _ in range(n):
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()

    micro_steps(4 * args.accumulation)  # warm-up
    accelerator.wait_for_everyone()
    started = time.perf_counter()
    micro_steps(args.steps * args.accumulation)
    accelerator.wait_for_everyone()
    elapsed = time.perf_counter() - started
    if accelerator.is_main_process:
        samples = args.steps * args.accumulation * args.batch * accelerator.num_processes
        write_result(
            args.result, {"world_size": accelerator.num_processes, "samples_per_s": samples / elapsed}
        )
    return accelerator  # run_worker shuts it down


def run(quick: bool = False, width: int = 1024) -> dict:
    common = ["--width", str(256 if quick else width), "--batch", "64", "--steps", "5" if quick else "40"]
    one = spawn("scaling.py", 1, common)["samples_per_s"]
    rows = {}
    variants = [
        ("ddp", []),
        ("ddp_accumulation_4", ["--accumulation", "4"]),
        ("ddp_bucket_1mb", ["--bucket_mb", "1"]),
        ("ddp_bucket_25mb", ["--bucket_mb", "25"]),
    ]
    for name, extra in variants[:1] if quick else variants:  # quick: the figures' shape, in seconds
        two = spawn("scaling.py", 2, [*common, *extra])["samples_per_s"]
        rows[name] = {"samples_per_s": two, "efficiency": two / (2 * one)}
        print(
            f"scaling {name}: 1 rank {one:,.0f} samples/s, "
            f"2 ranks {two:,.0f} samples/s, efficiency {two / (2 * one):.2f}"
        )
    return {"width": 256 if quick else width, "one_rank_samples_per_s": one, "two_ranks": rows}


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument(
        "--width", type=int, default=1024, help="hidden width of the MLP (compute per step grows as width^2)"
    )
    parser.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40, help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--bucket_mb", type=finite_float, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(worker, args)
    else:
        run(args.quick, args.width)


if __name__ == "__main__":
    main()
