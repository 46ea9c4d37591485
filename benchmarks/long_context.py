"""Long sequences: what context parallelism buys against one process and ddp, at a context where it matters.

    python -m benchmarks.long_context                 # 1,024-token context, a 2 x 64 GPT, 30 steps per run
    python -m benchmarks.long_context --quick         # 128 tokens, 12 steps: checks the table is made

Runs experiments/train_gpt.py (one `accelerate launch` each, one thread per rank) as none (1 process), ddp
(2 ranks, one sequence each) and cp (2 ranks sharing each sequence), with balanced and unbalanced chunks; per
run: activation bytes each rank keeps for backward (counted in one forward: saved-tensor hooks), training
tokens/s, each rank's seconds computing attention (cp) and the checks. Writes <output_dir>/<UTC time>/
long_context.md and .json; never overwrites.
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
from common.config import finite_float  # noqa: E402

RUNS = [  # (label, strategy, ranks, extra flags)
    ("none", "none", 1, []),
    ("ddp", "ddp", 2, []),
    ("cp, balanced chunks", "cp", 2, []),
    ("cp, neighbouring chunks", "cp", 2, ["--cp_load_balance", "false"]),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--context", type=int, default=1024, help="--block_size: tokens per sequence")
    parser.add_argument("--max_steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--quick", action="store_true", help="128 tokens, 12 steps")
    parser.add_argument("--timeout_s", type=finite_float, default=900, help="per run")
    parser.add_argument("--output_dir", default="runs/long_context", help="a new dated folder is made in it")
    args = parser.parse_args(argv)
    if args.context < 8 or args.context % 4 or args.max_steps < 12:
        parser.error(f"--context must be a multiple of 4 (2 ranks x 2 chunks), >= 8; --max_steps >= 12; got "
                     f"{args.context}, {args.max_steps}")  # fmt: skip
    context, steps = (128, 12) if args.quick else (args.context, args.max_steps)
    folder = dated_folder(args.output_dir, "long_context")
    if folder is None:
        return 2
    model = ["--block_size", str(context), "--d_model", "64", "--n_layer", "2", "--n_head", "2", "--vocab_size", "512",
             "--per_rank_batch_size", "1", "--max_steps", str(steps), "--parity_steps", "5", "--warmup_steps", "5",
             "--min_loss_drop", "0", "--sample_tokens", "0", "--report_to", "none"]  # fmt: skip
    rows = []
    for label, strategy, ranks, extra in RUNS:
        run = folder / label.replace(", ", "_").replace(" ", "_")
        flags = ["--strategy", strategy, "--output_dir", str(run), *model, *extra]
        if ranks > 1:
            command = accelerate_launch("experiments/train_gpt.py", flags, num_processes=ranks)
        else:
            command = [sys.executable, "experiments/train_gpt.py", *flags]
        print(f"{label} ...", flush=True)
        summary = run_for_summary(command, run, args.timeout_s)
        if "error" in summary:
            rows.append({"run": label, "error": summary["error"]})
            continue
        metrics = summary["metrics"]
        rows.append({
            "run": label, "ranks": ranks, "kept_bytes_per_rank": [h["saved_activation_bytes"] for h in metrics["bytes_per_rank"]],
            "tokens_per_s": metrics["tokens_per_s"], "attention_s_per_rank": metrics.get("attention_s_per_rank"),
            "checks": checks_verdict(summary),
        })  # fmt: skip
    command = command_line("benchmarks.long_context", argv)
    table = markdown(rows, command.strip(), context)
    write_table(folder, "long_context", table, rows)
    return 0 if all(r.get("checks") == "all passed" for r in rows) else 1


def markdown(rows: list[dict], command: str, context: int) -> str:
    lines = [f"`{command}` — {context}-token sequences, GPT 2 x 64, one sequence per data-parallel rank per step", "",
             "| run | ranks | activation bytes kept per rank | tokens/s | attention s per rank (slowest / fastest) | checks |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | | | | | {r['error']} |")
            continue
        attention = r["attention_s_per_rank"]
        balance = (f"{', '.join(f'{s:.2f}' for s in attention)} ({max(attention) / min(attention):.2f})"
                   if attention else "–")  # fmt: skip
        lines.append(f"| {r['run']} | {r['ranks']} | {max(r['kept_bytes_per_rank']):,} | {r['tokens_per_s']:,.0f} "
                     f"| {balance} | {r['checks']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
