"""Benchmark 4: does collectives.py's timing harness add to what it measures?

For all_reduce and all_gather_into_tensor at a few sizes, on 2 gloo ranks, side by side in one run:
the experiment's `time_per_call_s` (torch.utils.benchmark, fixed counts, slowest rank) and a bare loop
(perf_counter around the same number of calls, slowest rank). Overhead = the median over rounds of harness / bare - 1
(target < 5%). Both skip the first 2 calls after a barrier, as torch.utils.benchmark does. Also busbw as a fraction of this machine's memcpy bandwidth, from the same run.

    python benchmarks/collective_harness.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import benchmark_parser, median, run_worker, spawn, write_result


def worker(args) -> None:
    import tempfile

    import torch
    import torch.distributed as dist

    from common.runtime import make_accelerator
    from experiments.collectives import Config, bus_factor, make_bench_call, memcpy_gbps, time_per_call_s

    accelerator = make_accelerator(Config(), tempfile.mkdtemp())
    cfg = Config(warmup=3, iters=args.iters, repeats=args.repeats, memcpy_bytes=2**26)
    n, device = dist.get_world_size(), accelerator.device
    copy_gbps = memcpy_gbps(cfg, device)
    rows = []
    for op in ("all_reduce", "all_gather_into_tensor"):
        for size in args.sizes:
            fn, message_bytes = make_bench_call(op, size, n, device)
            harness, bare, ratios = [], [], []
            for _ in range(args.rounds):  # alternate, so drift hits both
                harness.append(median(time_per_call_s(fn, cfg, device)))
                bare_timings = []
                for _ in range(cfg.repeats):  # the same estimator by hand: barrier, 2 untimed calls, timed loop
                    dist.barrier()
                    fn()
                    fn()  # torch.utils.benchmark's warm-up: ranks leave the barrier's skew behind
                    started = time.perf_counter()
                    for _ in range(cfg.iters):
                        fn()
                    bare_timings.append((time.perf_counter() - started) / cfg.iters)
                slowest = torch.tensor(bare_timings, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                bare.append(median(slowest.tolist()))
                ratios.append(harness[-1] / bare[-1])  # measured back to back: drift cancels in the pair
            harness_s, bare_s = median(harness), median(bare)
            busbw = message_bytes / harness_s / 1e9 * bus_factor(op, n)
            rows.append({"op": op, "bytes": message_bytes, "harness_us": harness_s * 1e6, "bare_us": bare_s * 1e6,
                         "overhead": median(ratios) - 1, "busbw_gbps": busbw, "busbw_pct_of_memcpy": 100 * busbw / copy_gbps})
    if accelerator.is_main_process:
        worst = max(r["overhead"] for r in rows)  # what the harness adds; below 0 is noise in its favour
        write_result(args.result, {"memcpy_gbps": copy_gbps, "rows": rows, "max_overhead": worst, "target": 0.05, "met": worst < 0.05})
    accelerator.wait_for_everyone()  # then run_worker's shutdown: no rank tears down while another still works


def run(quick: bool = False) -> dict:
    sizes = ["65536", "1048576"] if quick else ["65536", "1048576", "8388608"]
    result = spawn("collective_harness.py", 2, ["--sizes", *sizes, "--iters", "5" if quick else "50",
                                                 "--repeats", "3" if quick else "5", "--rounds", "2" if quick else "15"])
    for row in result["rows"]:
        print(f"harness {row['op']:<24}{row['bytes']:>10,} B: harness {row['harness_us']:.0f} us, bare {row['bare_us']:.0f} us, "
              f"overhead {100 * row['overhead']:+.1f}%, busbw {row['busbw_gbps']:.2f} GB/s = {row['busbw_pct_of_memcpy']:.1f}% of memcpy")
    return result


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument("--sizes", nargs="+", type=int, default=[65536], help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(worker, args)
    else:
        run(args.quick)


if __name__ == "__main__":
    main()
