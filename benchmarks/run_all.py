"""Run every benchmark, write benchmarks/results.json and the benchmark table of docs/performance.md.

    python -m benchmarks.run_all            # full: the figures in docs/performance.md (a few minutes)
    python -m benchmarks.run_all --quick    # seconds per benchmark: checks every figure is produced

Each benchmark measures its comparison side by side in one run; nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import collective_bench_overhead, data_path, scaling, startup, step_overhead
from benchmarks.workers import REPO
from common.config import finite_float  # noqa: E402

BENCHMARKS = {
    "step_overhead": step_overhead,
    "data_path": data_path,
    "scaling": scaling,
    "collective_bench_overhead": collective_bench_overhead,
    "startup": startup,
}
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
PAGE = os.path.join(
    REPO, "docs", "performance.md"
)  # the page whose table between START and END this rewrites


def machine() -> dict:
    import accelerate
    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "processor": platform.processor() or platform.machine(),
    }


def table(results: dict) -> str:
    m = results["machine"]
    so, dp, sc, ch, st = (results[k] for k in BENCHMARKS)
    lines = [
        f"Measured by `python -m benchmarks.run_all` on {m['cpus']} CPU cores, "
        f"torch {m['torch']}, accelerate {m['accelerate']}"
        f"{' (quick mode)' if results['quick'] else ''}.",
        "",
        "| benchmark | figure | target | met |",
        "|---|---|---|---|",
        f"| 1. step overhead (2 ranks, 1 thread each, median step) | bare DDP {so['bare_steps_per_s']:.0f} steps/s (the same loop again: "
        f"{so['bare_again_steps_per_s']:.0f}, noise floor {so['noise_floor_ratio']:.3f}); "
        f"+ common/ {so['bare_plus_common_steps_per_s']:.0f} (+{so['overhead_us']['common']:.0f} µs/step); "
        f"Accelerate + common/ {so['accelerate_steps_per_s']:.0f} (+{so['overhead_us']['accelerate_and_common']:.0f} µs/step: "
        f"prepared model {so['overhead_us']['prepared_model']:+.0f}, backward() + optimizer {so['overhead_us']['backward_and_optimizer']:+.0f}, accumulate() {so['overhead_us']['accumulate']:+.0f}): "
        f"ratio **{so['ratio']:.3f}**. Not what the experiments run: "
        "the same step with Accelerate's two per-step lookups cached, "
        f"{so['accelerate_cached_lookups_steps_per_s']:.0f} steps/s ({so['overhead_us']['lookups_saved_by_caching']:+.0f} µs/step saved) | ≥ 0.95 | {'yes' if so['met'] else 'no'} |",
    ]
    for batch in (32, 1024):
        d = dp[f"batch_{batch}"]
        lines.append(
            f"| 2. data path, batch {batch} | common/ {d['common_iterator']:,.0f} samples/s; raw slicing {d['raw_slicing']:,.0f}; raw shuffled {d['raw_shuffled_slicing']:,.0f}; "
            f"DataLoader over Dataset {d['dataloader']:,.0f}: common/ / raw shuffled = **{d['ratio_vs_raw_shuffled']:.2f}** (/ unshuffled {d['ratio_vs_raw']:.2f}) | ≥ 0.9 × raw (same work) | {'yes' if d['met'] else 'no'} |"
        )
    for name, row in sc["two_ranks"].items():
        lines.append(
            f"| 3. scaling, MLP width {sc['width']}, {name} | 1 rank {sc['one_rank_samples_per_s']:,.0f} samples/s, "
            f"2 ranks {row['samples_per_s']:,.0f}: efficiency **{row['efficiency']:.2f}** | (measured) | – |"
        )
    lines.append(
        "| 4. collective harness (2 ranks, gloo) | harness / bare loop − 1, paired per round, "
        f"over {len(ch['rows'])} op × size rows: **{100 * ch['overhead']:+.1f}%** "
        f"(noise floor, the bare loop against itself: {100 * ch['noise_floor']:+.1f}%; "
        f"worst row {100 * ch['max_row_overhead']:+.1f}%, rows' noise floors up to ±{100 * ch['max_row_noise_floor']:.1f}%); "
        f"best busbw {max(r['busbw_pct_of_memcpy'] for r in ch['rows']):.1f}% of memcpy ({ch['memcpy_gbps']:.1f} GB/s) | < 5% | {'yes' if ch['met'] else 'no'} |"
    )
    imports = ", ".join(f"{k} {v:.2f} s" for k, v in st["imports_s"].items())
    lines.append(
        f"| 5. start-up | `accelerate launch` → first step (2 ranks): **{st['launch_to_first_step_s']:.1f} s**; imports per process: "
        f"{imports}; wandb imported when not the tracker: {'yes' if st['wandb_imported_without_wandb_tracker'] else 'no'} | (measured) | – |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="seconds per benchmark; touches no tracked file (docs/performance.md, results.json)",
    )
    parser.add_argument(
        "--output",
        default="",
        help="where to write the figures (default: benchmarks/results.json; with --quick a temporary file)",
    )
    parser.add_argument(
        "--slow_loop", default="", help="for tests: slow this step_overhead loop down on purpose"
    )
    parser.add_argument(
        "--slow_us", type=finite_float, default=0.0, help="for tests: by this many µs per step"
    )
    args = parser.parse_args()
    if not args.output:  # a quick run's figures are not results: they never replace the tracked ones
        quick_output = os.path.join(tempfile.gettempdir(), f"benchmarks-quick-{os.getpid()}.json")
        args.output = quick_output if args.quick else os.path.join(REPO, "benchmarks", "results.json")
    results = {"quick": args.quick, "machine": machine()}
    for name, module in BENCHMARKS.items():
        extra = (
            {"slow_loop": args.slow_loop, "slow_us": args.slow_us}
            if name == "step_overhead" and args.slow_loop
            else {}
        )
        results[name] = module.run(quick=args.quick, **extra)
    with open(args.output, "w") as handle:
        json.dump(results, handle, indent=2)
    rendered = table(results)
    print(rendered)
    print(f"figures written to {args.output}")
    if not args.quick:
        with open(PAGE) as handle:
            page = handle.read()
        if START in page and END in page:
            head, rest = page.split(START, 1)
            page = head + START + "\n" + rendered + "\n" + END + rest.split(END, 1)[1]
            with open(PAGE, "w") as handle:
                handle.write(page)


if __name__ == "__main__":
    main()
