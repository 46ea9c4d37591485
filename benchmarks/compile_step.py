"""What `--compile` (torch.compile on each block, strategies/compile.py) costs and buys per preset: the first step
(which pays the compile) and the steady state's tokens/s, eager and compiled, run in turns in one command so the
ratios compare.

    python -m benchmarks.compile_step                                # ddp, zero2, fsdp, tp, pp: 60 steps each
    python -m benchmarks.compile_step --strategies tp --max_steps 40 --quick

Each run is train_gpt through `accelerate launch` (2 CPU ranks), passing every check compiled as eager. Writes
<output_dir>/<UTC time>/compile.md and compile.json; the table goes into docs/performance.md by hand, with this
command. Inductor caches what it compiled (/tmp/torchinductor_<user>): the first compiled run of a shape pays the
C++ build, later ones load it; the table says which runs started with a cold cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compare_strategies import QUICK
from benchmarks.workers import (
    accelerate_launch,
    checks_verdict,
    command_line,
    dated_folder,
    run_for_summary,
    write_table,
)
from common.config import finite_float
from strategies.args import PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--strategies", default="ddp,zero2,fsdp,tp,pp", help="presets, each eager and compiled"
    )
    parser.add_argument(
        "--max_steps", type=int, default=60, help="steps per run (tokens/s: the steady state's)"
    )
    parser.add_argument("--quick", action="store_true", help="a ~20k-parameter GPT: checks the table is made")
    parser.add_argument("--timeout_s", type=finite_float, default=900, help="per run")
    parser.add_argument("--output_dir", default="runs/compile_step", help="a new dated folder is made in it")
    args = parser.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in PRESETS or PRESETS[s].launch_config or PRESETS[s].ranks < 2]
    if unknown or not strategies or args.max_steps < 20:
        parser.error(f"--strategies {unknown or 'empty'}: presets of 2 or more ranks without a DeepSpeed config; "
                     f"--max_steps >= 20 (got {args.max_steps})")  # fmt: skip
    folder = dated_folder(args.output_dir, "compile_step")
    if folder is None:
        return 2
    # a cache of this benchmark's own, emptied first: the first compiled run of each shape pays the build
    cache = tempfile.mkdtemp(prefix="inductor-", dir=folder)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    rows = []
    for strategy in strategies:
        row = {"strategy": strategy}
        for mode in ("eager", "compiled"):
            run = folder / f"{strategy}_{mode}"
            flags = ["--strategy", strategy, "--output_dir", str(run), "--report_to", "none", *(QUICK if args.quick else []),
                     "--max_steps", str(args.max_steps), *(["--n_layer", "4"] if args.quick else []),
                     *(["--compile"] if mode == "compiled" else [])]  # fmt: skip
            print(f"{strategy} {mode} ...", flush=True)
            summary = run_for_summary(accelerate_launch("experiments/train_gpt.py", flags, PRESETS[strategy].ranks), run,
                                      args.timeout_s)  # fmt: skip
            if "error" in summary:
                row[mode] = {"error": summary["error"]}
                continue
            metrics = summary["metrics"]
            row[mode] = {"checks": checks_verdict(summary), "tokens_per_s": metrics["tokens_per_s"],
                         "first_step_ms": metrics["first_step_ms"], "step_ms": sum(metrics["step_time_ms"].values())}  # fmt: skip
        rows.append(row)
    shutil.rmtree(cache, ignore_errors=True)
    command = command_line("benchmarks.compile_step", argv)
    lines = [f"`{command.strip()}`", "", "| preset | first step ms: eager / compiled | steady tokens/s: eager / compiled "
             "| speed-up | checks (eager, compiled) |", "|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        eager, compiled = row.get("eager", {}), row.get("compiled", {})
        if "error" in eager or "error" in compiled:
            lines.append(
                f"| {row['strategy']} | {eager.get('error', '')} {compiled.get('error', '')} | | | |"
            )
            continue
        lines.append(f"| {row['strategy']} | {eager['first_step_ms']:,.0f} / {compiled['first_step_ms']:,.0f} "
                     f"| {eager['tokens_per_s']:,.0f} / {compiled['tokens_per_s']:,.0f} "
                     f"| {compiled['tokens_per_s'] / eager['tokens_per_s']:.2f} "
                     f"| {eager['checks']}, {compiled['checks']} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    write_table(folder, "compile", table, rows)
    passed = all(r.get(m, {}).get("checks") == "all passed" for r in rows for m in ("eager", "compiled"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
