"""Every pipeline schedule on the GPT, side by side: bubble measured against its theory, step time, checks.

    python -m benchmarks.pipeline_schedules                   # the default GPT, 2 stage-ranks, m = 8
    python -m benchmarks.pipeline_schedules --quick           # a tiny GPT: checks the table is made

Each schedule is one `accelerate launch` of experiments/train_gpt.py --strategy pp --pp_schedule <s> (2
ranks, one thread each), which checks itself against one process and measures the bubble of every step after
the one-time work: 1 - the stage-ranks' mean busy time (their forward, backward and weight-gradient actions,
timed) / the step's span (strategies/pp.py `report`). Writes <output_dir>/<UTC time>/schedules.md and
schedules.json and each schedule's run folder with its pipeline_timeline.png; never overwrites.
"""

from __future__ import annotations

import argparse
import os
import sys

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
from common.config import finite_float  # noqa: E402
from strategies.pp_schedules import SCHEDULES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="comma-separated, from " + ", ".join(SCHEDULES)
    )
    parser.add_argument(
        "--microbatches", type=int, default=8, help="--pp_microbatches (one row of context each)"
    )
    parser.add_argument("--max_steps", type=int, default=40, help="optimizer steps per schedule")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT (4 blocks), 12 steps")
    parser.add_argument("--timeout_s", type=finite_float, default=900, help="per run")
    parser.add_argument(
        "--output_dir", default="runs/pipeline_schedules", help="a new dated folder is made in it"
    )
    args = parser.parse_args(argv)
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules or args.microbatches < 1 or args.max_steps < 20:
        parser.error(f"--schedules {unknown or schedules} must be among {', '.join(SCHEDULES)}, --microbatches >= 1, "
                     f"--max_steps >= 20 (got {args.microbatches}, {args.max_steps})")  # fmt: skip
    folder = dated_folder(args.output_dir, "pipeline_schedules")
    if folder is None:
        return 2
    rows = []
    for schedule in schedules:
        run = folder / schedule
        flags = [
            "--strategy",
            "pp",
            "--pp_schedule",
            schedule,
            "--report_to",
            "none",
            "--output_dir",
            str(run),
        ]
        flags += [*QUICK, "--n_layer", "4"] if args.quick else []
        flags += [
            "--pp_microbatches",
            str(args.microbatches),
            "--per_rank_batch_size",
            str(args.microbatches),
        ]
        flags += ["--max_steps", str(12 if args.quick else args.max_steps), "--parity_steps", "6"]
        print(f"{schedule} ...", flush=True)
        summary = run_for_summary(accelerate_launch("experiments/train_gpt.py", flags), run, args.timeout_s)
        if "error" in summary:
            rows.append({"schedule": schedule, "error": summary["error"]})
            continue
        rows.append({**summary["metrics"]["pipeline"], "tokens_per_s": summary["metrics"]["tokens_per_s"],
                     "checks": checks_verdict(summary)})  # fmt: skip
    command = command_line("benchmarks.pipeline_schedules", argv)
    table = markdown(rows, command.strip())
    write_table(folder, "schedules", table, rows, also=", <schedule>/pipeline_timeline.png")
    return 0 if all(r.get("checks") == "all passed" for r in rows) else 1


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "",
             "| schedule | stages per rank | bubble measured | bubble by theory | step ms | tokens/s | checks |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['schedule']} | | | | | | {r['error']} |")
            continue
        theory = "–" if r["theory_bubble"] is None else f"{r['theory_bubble']:.3f}"
        lines.append(
            f"| {r['schedule']} | {r['stages'] // r['stage_ranks']} | {r['measured_bubble']:.3f} | {theory} "
            f"| {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['checks']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
