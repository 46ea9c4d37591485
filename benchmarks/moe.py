"""A mixture of experts against the dense GPT at equal active parameters, and its load balancing measured: train_gpt
on 2 CPU ranks, in turns in one command so the figures compare.

    python -m benchmarks.moe                      # 6 runs of 200 steps: ~7 minutes here
    python -m benchmarks.moe --max_steps 40       # a quicker look

Runs (each through `accelerate launch`, every train_gpt check passing):
  dense            the default GPT (MLP hidden 512), data parallel (--dp_replicate 2)
  moe_ddp          4 experts of hidden 256, top 2 (the same active MLP width: 2 x 256), data parallel
  ep_none          the same under --ep 2 (2 experts a rank, all-to-all), no balancing; the experts by grouped GEMM
  ep_loop          ep_none with --expert_matmul loop: one matmul per expert (the reference the grouped GEMM is
                   checked against), side by side with it
  ep_aux           + the auxiliary loss (--aux_loss_coef 0.01)
  ep_bias          + auxiliary-loss-free balancing instead (--bias_update_rate 0.001)
Writes <output_dir>/<UTC time>/moe.md and moe.json; the table goes into docs/train_gpt.md by hand, with this command.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workers import (
    accelerate_launch,
    checks_verdict,
    command_line,
    dated_folder,
    run_for_summary,
    write_table,
)
from common.config import finite_float

MOE = ["--n_experts", "4", "--top_k", "2", "--d_ff", "256"]
RUNS = {
    "dense": ["--dp_replicate", "2"],
    "moe_ddp": [*MOE, "--dp_replicate", "2"],
    "ep_none": [*MOE, "--ep", "2"],
    "ep_loop": [*MOE, "--ep", "2", "--expert_matmul", "loop"],
    "ep_aux": [*MOE, "--ep", "2", "--aux_loss_coef", "0.01"],
    "ep_bias": [*MOE, "--ep", "2", "--bias_update_rate", "0.001"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--max_steps", type=int, default=200, help="steps per run (tokens/s: the steady state's)"
    )
    parser.add_argument("--runs", default=",".join(RUNS), help="which of the runs, comma-separated")
    parser.add_argument("--timeout_s", type=finite_float, default=900, help="per run")
    parser.add_argument("--output_dir", default="runs/moe", help="a new dated folder is made in it")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.runs.split(",") if name.strip()]
    unknown = [name for name in names if name not in RUNS]
    if unknown or not names or args.max_steps < 20:
        parser.error(f"--runs {unknown or 'empty'}: choose from {', '.join(RUNS)}; --max_steps >= 20 (got "
                     f"{args.max_steps})")  # fmt: skip
    folder = dated_folder(args.output_dir, "moe")
    if folder is None:
        return 2
    rows = []
    for name in names:
        run = folder / name
        flags = [*RUNS[name], "--output_dir", str(run), "--report_to", "none", "--max_steps", str(args.max_steps),
                 "--log_every", str(args.max_steps // 4)]  # fmt: skip
        print(f"{name} ...", flush=True)
        summary = run_for_summary(
            accelerate_launch("experiments/train_gpt.py", flags, 2), run, args.timeout_s
        )
        if "error" in summary:
            rows.append({"run": name, "error": summary["error"]})
            continue
        metrics = summary["metrics"]
        counted = metrics["communication"]["counted"]["bytes"]
        moe = metrics.get("moe", {})
        rows.append({"run": name, "checks": checks_verdict(summary), "parameters": metrics["parameters"],
                     "active_parameters": metrics.get("active_parameters", metrics["parameters"]),
                     "val_loss": metrics["val_loss"], "tokens_per_s": metrics["tokens_per_s"],
                     "params_bytes_rank0": metrics["bytes_per_rank"][0]["params"],
                     "all_to_all_bytes": counted.get("all_to_all", 0), "all_reduce_bytes": counted.get("all_reduce", 0),
                     "imbalance_first": moe.get("imbalance_first"), "imbalance_last": moe.get("imbalance_last"),
                     "all_to_all_share": moe.get("all_to_all_share_of_step")})  # fmt: skip
    command = command_line("benchmarks.moe", argv)
    lines = [f"`{command.strip()}`", "",
             "| run | parameters (active) | val loss | tokens/s | param bytes / rank | all-to-all / all-reduce bytes a "
             "step | tokens per expert max/mean: first -> last tenth | all-to-all share | checks |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['run']} | {row['error']} | | | | | | | |")
            continue
        balance = (
            f"{row['imbalance_first']:.2f} -> {row['imbalance_last']:.2f}" if row["imbalance_first"] else ""
        )
        share = f"{100 * row['all_to_all_share']:.0f}%" if row["all_to_all_share"] else ""
        lines.append(f"| {row['run']} | {row['parameters']:,} ({row['active_parameters']:,}) | {row['val_loss']:.3f} "
                     f"| {row['tokens_per_s']:,.0f} | {row['params_bytes_rank0']:,} | {row['all_to_all_bytes']:,} / "
                     f"{row['all_reduce_bytes']:,} | {balance} | {share} | {row['checks']} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    write_table(folder, "moe", table, rows)
    return 0 if all(row.get("checks") == "all passed" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
