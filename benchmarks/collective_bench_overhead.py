"""Benchmark 4: does collectives_bench.py's timing (common/collective_bench.py) add to what it measures?

For all_reduce and all_gather_into_tensor at a few sizes, on 2 gloo ranks, side by side in one run,
three timings of the same op take turns round after round (ABBA order):
- harness: `common.collective_bench.time_per_call_s`, what the experiment times with
  (torch.utils.benchmark, fixed counts, slowest rank);
- bare: perf_counter around the same calls by hand (same warm-up, barrier, 2 untimed calls, slowest rank);
- bare_again: the bare loop once more: the noise floor, what "no difference" looks like on this machine.
Overhead = the median over rounds of harness / bare in the same round, - 1, beside the noise floor, the
same for bare_again / bare; per row, and over all rows' rounds together (the figure with the target
< 5%). Paired, because a timing here is heavy-tailed (a 64 KiB
all_reduce: 240 µs in most rounds, up to 2 ms in others): medians of each timing alone differed by up
to 30% between the two identical bare loops; paired ratios by up to 6%. Also busbw as a fraction of
this machine's memcpy bandwidth, from the same run.

    python benchmarks/collective_bench_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workers import benchmark_parser, median, run_worker, scratch_folder, spawn, write_result

TIMINGS = ("harness", "bare", "bare_again")


def worker(args):

    import torch
    import torch.distributed as dist

    from common.collective_bench import make_bench_call, memcpy_gbps, time_per_call_s
    from common.comm_counter import bus_factor
    from common.config import RunArgs
    from common.device import device_time
    from common.runtime import make_accelerator

    accelerator = make_accelerator(RunArgs(), scratch_folder(args))
    warmup = 3
    n, device = dist.get_world_size(), accelerator.device
    copy_gbps = memcpy_gbps(2**26, device)

    def bare_time_per_call_s(fn) -> float:  # what time_per_call_s does, by hand
        for _ in range(warmup):
            fn()
        dist.barrier()
        fn()
        fn()  # torch.utils.benchmark's warm-up: ranks leave the barrier's skew behind
        # the device's time (a GPU's collectives are queued, not done, at return)
        started = device_time(device)
        for _ in range(args.iters):
            fn()
        elapsed = (device_time(device) - started) / args.iters
        # on the group's device: NCCL takes no host tensor
        slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()

    rows, all_overheads, all_noise = [], [], []
    for op in ("all_reduce", "all_gather_into_tensor"):
        for size in args.sizes:
            fn, message_bytes = make_bench_call(op, size, n, device)
            seconds = {name: [] for name in TIMINGS}
            for round_index in range(args.rounds):
                for name in TIMINGS if round_index % 2 == 0 else TIMINGS[::-1]:
                    seconds[name].append(
                        time_per_call_s(fn, warmup, args.iters, 1, device)[0]
                        if name == "harness"
                        else bare_time_per_call_s(fn)
                    )
            harness_s, bare_s, again_s = (median(seconds[name]) for name in TIMINGS)
            overheads = [h / b - 1 for h, b in zip(seconds["harness"], seconds["bare"], strict=True)]
            noise = [a / b - 1 for a, b in zip(seconds["bare_again"], seconds["bare"], strict=True)]
            all_overheads += overheads
            all_noise += noise
            overhead, noise_floor = median(overheads), median(noise)
            busbw = message_bytes / harness_s / 1e9 * bus_factor(op, n)
            rows.append(
                {
                    "op": op,
                    "bytes": message_bytes,
                    "harness_us": harness_s * 1e6,
                    "bare_us": bare_s * 1e6,
                    "bare_again_us": again_s * 1e6,
                    "overhead": overhead,
                    "noise_floor": noise_floor,
                    "busbw_gbps": busbw,
                    "busbw_pct_of_memcpy": 100 * busbw / copy_gbps,
                }
            )
    if accelerator.is_main_process:
        # The harness is one piece of code, so its overhead is one figure: the median over every round of
        # every row. A row alone is at the mercy of the noise (see the rows' own noise floors).
        overhead = median(all_overheads)
        write_result(
            args.result,
            {
                "memcpy_gbps": copy_gbps,
                "rows": rows,
                "overhead": overhead,
                "noise_floor": median(all_noise),
                "max_row_overhead": max(r["overhead"] for r in rows),
                "max_row_noise_floor": max(abs(r["noise_floor"]) for r in rows),
                "target": 0.05,
                "met": overhead < 0.05,
            },
        )
    return accelerator  # run_worker shuts it down


def run(quick: bool = False) -> dict:
    sizes = ["65536", "1048576"] if quick else ["65536", "1048576", "8388608"]
    result = spawn(
        "collective_bench_overhead.py",
        2,
        ["--sizes", *sizes, "--iters", "5" if quick else "20", "--rounds", "2" if quick else "60"],
    )
    for row in result["rows"]:
        print(
            f"harness {row['op']:<24}{row['bytes']:>10,} B: "
            f"harness {row['harness_us']:.0f} us, bare {row['bare_us']:.0f} us, "
            f"overhead {100 * row['overhead']:+.1f}% (noise floor {100 * row['noise_floor']:+.1f}%), "
            f"busbw {row['busbw_gbps']:.2f} GB/s = {row['busbw_pct_of_memcpy']:.1f}% of memcpy"
        )
    print(
        f"harness overhead over all rows {100 * result['overhead']:+.1f}% (target < 5%; "
        f"noise floor {100 * result['noise_floor']:+.1f}%)"
    )
    return result


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument("--sizes", nargs="+", type=int, default=[65536], help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(worker, args)
    else:
        run(args.quick)


if __name__ == "__main__":
    main()
