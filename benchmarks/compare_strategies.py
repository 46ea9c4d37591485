"""Every training strategy side by side: the same GPT, data and seed trained by every preset of strategies/
and any layout of degrees (experiments/train_gpt.py, each launched by `accelerate launch`), one table + one PNG.

    python -m benchmarks.compare_strategies                      # train_gpt's defaults, 300 steps each
    python -m benchmarks.compare_strategies --max_steps 100 --strategies ddp,tp
    python -m benchmarks.compare_strategies --strategies none --layouts dp_shard=2:tp=2,tp=2:pp=2,dp_shard=2:tp=2:pp=2
    python -m benchmarks.compare_strategies --quick              # a tiny model: checks the table is made

Columns: the layout (its degrees and ranks), the run's checks, loss / parameter difference from one
process over the first --parity_steps steps, bytes rank 0 holds (parameters / gradients / AdamW state),
bytes one step's forward and backward send (counted as they pass the dispatcher, against the closed form),
training tokens/s, and the median step split into forward / backward / optimizer (clipping's all-reduce
included). Each run's own folder holds its summary.json, metrics.jsonl and console log.
Writes <output_dir>/<UTC time>/comparison.md, comparison.png and comparison.json; never overwrites.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

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
from strategies.args import PRESETS
from strategies.layout import DIMS, Layout

REPO = Path(__file__).resolve().parent.parent
QUICK = (
    "--max_steps 12 --parity_steps 6 --log_every 6 --d_model 32 --n_layer 2 --n_head 2 --block_size 32 "
    "--vocab_size 512 --warmup_steps 2 --sample_tokens 5 --min_loss_drop 0.1"
).split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--strategies", default=",".join(PRESETS), help="comma-separated presets, from " + ", ".join(PRESETS)
    )
    parser.add_argument(
        "--layouts",
        default="",
        help="comma-separated layouts, each degrees joined by ':' (dp_shard=2:tp=2:pp=2), "
        "launched on their product of ranks; ':sequence_parallel' adds tp's --sequence_parallel",
    )
    parser.add_argument(
        "--max_steps", type=int, default=0, help="optimizer steps per run (0: train_gpt's default)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a ~20k-parameter GPT for 12 steps: seconds per run"
    )
    parser.add_argument(
        "--profile_steps",
        type=int,
        default=0,
        help="passed to train_gpt: torch.profiler traces of this many steps per run (0: off)",
    )
    parser.add_argument("--model_flags", default="", help="train_gpt flags given to every run, quoted: the model's "
                        "(--hf_config llama_tiny, --n_layer 6 ...) or any other (--activation_checkpointing full)")  # fmt: skip
    parser.add_argument(
        "--output_dir", default="runs/compare_strategies", help="a new dated folder is made in it"
    )
    parser.add_argument(
        "--timeout_s", type=finite_float, default=1200, help="per run; the whole run is ended after it"
    )
    args = parser.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in PRESETS]
    if unknown:
        parser.error(f"--strategies: {unknown} not among {', '.join(PRESETS)}")
    args.runs = [Run(name, ["--strategy", name], PRESETS[name].ranks, PRESETS[name].launch_config)
                 for name in args.strategies]  # fmt: skip
    args.runs += layout_runs(args.layouts, parser.error)
    args.model_flags = model_flags(args.model_flags, args.quick, "compare_strategies --model_flags")
    if not args.runs:
        parser.error("nothing to run: --strategies and --layouts are both empty")
    if args.max_steps < 0:
        parser.error(f"--max_steps must be >= 0, got {args.max_steps}")
    if args.profile_steps < 0:
        parser.error(f"--profile_steps must be >= 0, got {args.profile_steps}")
    return args


@dataclass(frozen=True)
class Run:
    """One row: its label (a preset's name, or a layout's degrees), train_gpt's flags for it, the ranks it is
    launched on, and the accelerate config it needs (default: the 2-rank CPU one)."""

    label: str
    flags: list
    ranks: int
    launch_config: str


def model_flags(text: str, quick: bool, prog: str) -> list[str]:
    """train_gpt's flags in `text` (shell words), refused by train_gpt itself in one line (exit 2) before any run."""
    from common.config import parse_config
    from experiments import train_gpt

    words = shlex.split(text)
    parse_config(train_gpt.Config, ["--report_to", "none", *(QUICK if quick else []), *words], prog=prog)
    return words


def layout_runs(text: str, error) -> list[Run]:
    """--layouts' rows: comma-separated layouts, each its degrees joined by ':' (dp_shard=2:tp=2), ':sequence_parallel'
    adding tp's flag; `error(message)` for one that is not (argparse's: one line, exit 2)."""
    runs = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split(":")
        try:
            degrees = {
                dim: int(n) for dim, n in (part.split("=") for part in parts if part != "sequence_parallel")
            }
            layout = Layout(**degrees)
        except (TypeError, ValueError):
            error(f"--layouts: {item!r} is not degrees like dp_shard=2:tp=2 (of {', '.join(DIMS)}), optionally "
                  ":sequence_parallel")  # fmt: skip
        runs.append(layout_run(layout, degrees, "sequence_parallel" in parts))
    return runs


def layout_run(layout: Layout, degrees: dict, sequence_parallel: bool = False) -> Run:
    """A row of a layout given by its degrees: train_gpt's degree flags, on its world size."""
    flags = [item for dim, n in degrees.items() for item in (f"--{dim}", str(n))]
    label = layout.describe().split(" (")[0]
    if sequence_parallel:
        flags, label = [*flags, "--sequence_parallel"], f"{label} + SP"
    return Run(label, flags, layout.world_size, "")


def launch_command(run: Run, run_dir: Path, args: argparse.Namespace) -> list[str]:
    """`accelerate launch` with the 2-rank CPU config (its --num_processes overridden), or plain python
    for the one-process reference: the commands the README gives."""
    flags = [*run.flags, "--output_dir", str(run_dir), "--report_to", "none"]
    flags += QUICK if args.quick else []
    flags += args.model_flags
    flags += ["--max_steps", str(args.max_steps)] if args.max_steps else []
    flags += ["--profile_steps", str(args.profile_steps)] if args.profile_steps else []
    if run.ranks > 1:  # a DeepSpeed stage is chosen by its accelerate config
        return accelerate_launch(
            "experiments/train_gpt.py", flags, num_processes=run.ranks, config=run.launch_config
        )
    return [sys.executable, str(REPO / "experiments" / "train_gpt.py"), *flags]


def run_strategy(run: Run, run_dir: Path, args: argparse.Namespace) -> dict:
    """One run; its summary.json, or what went wrong. The console goes to <run_dir>.log."""
    summary = run_for_summary(launch_command(run, run_dir, args), run_dir, args.timeout_s)
    return {"strategy": run.label, **summary} if "error" in summary else {"label": run.label, **summary}


def row(summary: dict) -> dict:
    """The figures of one run that the table and the plot show."""
    if "error" in summary:
        return {"strategy": summary["strategy"], "error": summary["error"]}
    metrics, config = summary["metrics"], summary["config"]
    communication = metrics.get("communication", {})
    layout = Layout(**metrics["layout"])
    return {
        "strategy": summary.get("label", config["strategy"]),
        "ranks": layout.world_size,
        "layout": layout.describe().split(" (")[0],
        "checks": checks_verdict(summary),
        "loss_diff": metrics.get("loss_max_abs_diff"),
        "param_diff": metrics.get("param_max_abs_diff"),
        "bytes": {k: metrics["bytes_per_rank"][0][k] for k in ("params", "grads", "optimizer")},
        "comm_counted": communication.get("counted", {}).get("bytes", {}),
        "comm_theory": communication.get("theory", {}).get("by_kind", {}),
        "wire_bytes": communication.get("theory", {}).get("wire_bytes", 0),
        "tokens_per_s": metrics["tokens_per_s"],
        "step_time_ms": metrics["step_time_ms"],
        "tokens_per_step": config["per_rank_batch_size"]
        * config["block_size"]
        * layout.dp
        * config["gradient_accumulation_steps"],
        "comm_calls": communication.get("counted", {}).get("calls", {}),
        "step_breakdown_ms": metrics.get("step_breakdown_ms", []),
    }


def markdown(rows: list[dict], command: str) -> str:
    def number(value, form="{:.1e}"):
        return "–" if value is None else form.format(value)

    lines = [
        f"`{command}`",
        "",
        "| strategy | ranks: layout | checks | loss / param diff vs one process | bytes per rank: params / grads "
        "/ AdamW | bytes per step, counted = theory (wire per rank) | tokens/s | step ms: fwd / bwd / clip / opt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | | {r['error']} | | | | | |")
            continue
        b, t = r["bytes"], r["step_time_ms"]
        kinds = sorted(set(r["comm_counted"]) | {k for k, v in r["comm_theory"].items() if v})
        comm = "; ".join(
            f"{kind} {r['comm_counted'].get(kind, 0):,}"
            + (
                ""
                if r["comm_counted"].get(kind, 0) == r["comm_theory"].get(kind, 0)
                else f" (theory {r['comm_theory'].get(kind, 0):,})"
            )
            for kind in kinds
        )
        comm = f"{comm} ({r['wire_bytes']:,.0f})" if comm else "none"
        lines.append(
            f"| {r['strategy']} | {r['ranks']}: {r['layout']} | {r['checks']} "
            f"| {number(r['loss_diff'])} / {number(r['param_diff'])} "
            f"| {b['params']:,} / {b['grads']:,} / {b['optimizer']:,} | {comm} | {r['tokens_per_s']:,.0f} "
            f"| {t['forward']:.1f} / {t['backward']:.1f} / {t.get('clip', 0.0):.1f} / {t['optimizer']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Four panels, one horizontal bar per strategy or layout (its name and ranks fit beside it, on the left panels'
    axis): bytes held, bytes sent by kind, step time split, tokens/s."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to leave behind

    rows = [r for r in rows if "error" not in r]
    names = [f"{r['strategy']} ({r['ranks']} rank{'s' * (r['ranks'] > 1)})" for r in rows]
    figure = Figure(figsize=(14, 2.6 + 0.5 * len(rows)), layout="constrained")  # room for the legends beside
    axes = figure.subplots(2, 2, sharey=True)
    mib = 2**20
    sent_kinds = sorted({kind for r in rows for kind, size in r["comm_counted"].items() if size})

    def stacked(axis, parts: list[str], values, title: str, unit: str) -> None:
        left = [0.0] * len(rows)
        for part in parts:
            widths = [values(r).get(part, 0) for r in rows]
            axis.barh(names, widths, left=left, label=part)
            left = [b + w for b, w in zip(left, widths, strict=True)]
        axis.set_title(title)
        axis.set_xlabel(unit)
        axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never on them

    stacked(axes[0][0], ["params", "grads", "optimizer"], lambda r: {k: v / mib for k, v in r["bytes"].items()},
            "held by rank 0 at rest", "MiB")  # fmt: skip
    stacked(axes[0][1], sent_kinds, lambda r: {k: v / mib for k, v in r["comm_counted"].items()},
            "sent per step by rank 0 (counted)", "MiB")  # fmt: skip
    stacked(
        axes[1][0],
        ["forward", "backward", "clip", "optimizer"],
        lambda r: r["step_time_ms"],
        "median step",
        "ms",
    )
    axes[1][1].barh(names, [r["tokens_per_s"] for r in rows])
    axes[1][1].set_title("training throughput")
    axes[1][1].set_xlabel("tokens/s")
    axes[0][0].invert_yaxis()  # the first row on top, as in the table (shared by every panel)
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = dated_folder(args.output_dir, "compare_strategies")
    if folder is None:
        return 2
    summaries = []
    for run in args.runs:
        print(f"{run.label} on {run.ranks} rank(s) ...", flush=True)
        summaries.append(run_strategy(run, folder / run.label.replace(" ", ""), args))
    rows = [row(s) for s in summaries]
    command = command_line("benchmarks.compare_strategies", argv)
    table = markdown(rows, command.strip())
    plot(rows, folder / "comparison.png")
    write_table(folder, "comparison", table, rows, also=", comparison.png")
    return 0 if all("error" not in r and r["checks"] == "all passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
