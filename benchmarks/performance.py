"""GPT training against this machine's physical limit, in one command: the peak, MFU per strategy, where
each step's time goes (torch.profiler traces), an alpha-beta cost model of its communication, and the
overhead of our experiment against the same step in bare PyTorch.

    python -m benchmarks.performance             # every strategy, 100 steps each: ~15 minutes here
    python -m benchmarks.performance --quick --strategies tp --overhead_strategies ddp --overhead_rounds 1

1. Peak and FLOPs per token: benchmarks/mfu.py (one thread, as each rank runs).
2. The collectives' cost: experiments/collectives_bench.py on 2 ranks (all_reduce, all_gather,
   reduce_scatter, 1 KiB to 16 MiB), and per op the alpha-beta fit time = alpha + bytes / bandwidth
   (least squares on relative error, so small messages weigh as much as large ones).
3. Every strategy: benchmarks/compare_strategies.py with train_gpt's --profile_steps: MFU from its
   tokens/s, and from rank 0's traces its mean profiled step split into compute / communication / overlapped
   / idle (common/profiling.py), one timeline per strategy in timelines.png.
4. The cost model's prediction per strategy: sum over the collectives one step's forward and backward
   issue (counted by train_gpt: calls and bytes per kind) of alpha + bytes / bandwidth, beside what the
   traces measured: rank 0's collective spans per step (mean over the profiled steps), split into the
   time before the other rank entered the same call (waiting: skew between ranks, not bandwidth) and
   after it (the transfer the bench timed). Clipping's norm all-reduces (optimizer phase) are in the
   spans but not in the prediction: one small call per step (two under fsdp_tp).
5. Overhead: train_gpt (accelerate launch) against benchmarks/bare_gpt.py (torchrun, torch only), ddp
   and fsdp, the same steps; runs take turns (bare, experiment, bare again, rotated each round) and each
   figure is the median over rounds of the training loop's tokens/s; bare again / bare is the noise floor.
Writes runs/performance/<UTC time>/ (never overwrites): performance.md, performance.json, timelines.png;
below it collectives_bench/, strategies/<time>/<strategy>/ (each run: summary.json, profile/rank<r>.json
traces for ui.perfetto.dev, profile/timeline.png) and overhead/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import compare_strategies, mfu
from benchmarks.workers import (
    accelerate_launch,
    command_line,
    dated_folder,
    free_port,
    run_one_thread_per_rank,
    write_table,
)
from common.config import finite_float  # noqa: E402
from common.profiling import (
    STEP_KINDS,
    median_step,
    plot_timeline,
    step_lanes,
    trace_breakdown,
    waiting_for_peers,
)
from strategies.args import PRESETS  # noqa: I001

REPO = Path(__file__).resolve().parent.parent
# the counter's kinds -> the bench's ops (the same message-size convention: common/comm_counter.py)
BENCH_OP = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all_single",
    "send": "send_recv",  # a pipeline's activations one way; the rank's recv waits for the peer's send
    "recv": "send_recv",
}
OVERHEAD_VARIANTS = ("bare", "experiment", "bare_again")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--strategies", default=",".join(PRESETS), help="strategies profiled (presets of strategies/)"
    )
    parser.add_argument("--max_steps", type=int, default=100, help="optimizer steps per training run")
    parser.add_argument("--profile_steps", type=int, default=5, help="steps traced per run (after step 16)")
    parser.add_argument(
        "--overhead_strategies", default="ddp,fsdp", help="bare PyTorch vs train_gpt: ddp, fsdp"
    )
    parser.add_argument(
        "--overhead_rounds", type=int, default=3, help="rounds of (bare, experiment, bare again)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small GEMMs, small messages, a tiny GPT, 12 steps"
    )
    parser.add_argument("--output_dir", default="runs/performance", help="a new dated folder is made in it")
    parser.add_argument("--timeout_s", type=finite_float, default=1200, help="per launched run")
    args = parser.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    args.overhead_strategies = [s.strip() for s in args.overhead_strategies.split(",") if s.strip()]
    bad = [s for s in args.strategies if s not in PRESETS]
    bad += [s for s in args.overhead_strategies if s not in ("ddp", "fsdp")]
    if bad:
        parser.error(f"unknown strategies {bad}: --strategies from {', '.join(PRESETS)}, "
                     "--overhead_strategies from ddp, fsdp")  # fmt: skip
    if args.quick:
        args.max_steps, args.profile_steps = 12, min(args.profile_steps, 3)
    # train_gpt profiles after its 15 parity steps (6 in --quick) and one warm-up step
    before = 7 if args.quick else 16
    if args.overhead_rounds < 0 or not 0 < args.profile_steps <= args.max_steps - before:
        parser.error(f"--overhead_rounds must be >= 0 and --profile_steps in 1..--max_steps - {before}, got "
                     f"{args.overhead_rounds}, {args.profile_steps} (--max_steps {args.max_steps})")  # fmt: skip
    return args


def launch(command: list[str], log: Path, timeout_s: float) -> bool:
    """A run with one thread per rank, its console in `log`; whether it exited 0 (TIMED_OUT is not 0)."""
    return run_one_thread_per_rank(command, str(log), timeout_s).returncode == 0


def bench_collectives(folder: Path, args) -> list[dict]:
    """collectives_bench's rows (op, bytes, time_us) on 2 ranks."""
    sizes = (
        ["--max_bytes", str(2**22), "--iters", "3", "--repeats", "3", "--memcpy_bytes", str(2**24)]
        if args.quick
        else []
    )
    flags = ["--ops", ",".join(dict.fromkeys(BENCH_OP.values())), "--report_to", "none", "--output_dir", str(folder),
             *sizes]  # fmt: skip
    if not launch(
        accelerate_launch("experiments/collectives_bench.py", flags),
        folder.with_suffix(".log"),
        args.timeout_s,
    ):
        raise SystemExit(f"performance: the collectives bench failed: see {folder.with_suffix('.log')}")
    return json.loads((folder / "summary.json").read_text())["metrics"]["rows"]


def fit_alpha_beta(rows: list[dict]) -> dict:
    """Per op: time = alpha + bytes / bandwidth, by least squares on the relative error (each row's
    equation divided by its time). Neither term may be negative: a negative latency is refitted as
    bandwidth only, a negative cost per byte (times falling with size: noise) as latency only, and then
    bandwidth is None. Also the worst relative error of the fit."""
    import torch

    fits = {}
    for op in sorted({r["op"] for r in rows}):
        points = [(r["bytes"], r["time_us"] * 1e-6) for r in rows if r["op"] == op]
        a = torch.tensor([[1 / t, s / t] for s, t in points], dtype=torch.float64)
        alpha, per_byte = (
            torch.linalg.lstsq(a, torch.ones(len(points), 1, dtype=torch.float64)).solution.flatten().tolist()
        )
        if alpha < 0:  # latency cannot be negative: bandwidth only
            alpha = 0.0
            per_byte = sum(s / t for s, t in points) / sum((s / t) ** 2 for s, t in points)
        if per_byte < 0:  # nor a cost per byte: latency only
            per_byte = 0.0
            alpha = sum(1 / t for _, t in points) / sum(1 / t**2 for _, t in points)
        worst = max(abs(alpha + per_byte * s - t) / t for s, t in points)
        fits[op] = {
            "alpha_us": alpha * 1e6,
            "ns_per_byte": per_byte * 1e9,
            "bandwidth_gbps": 1 / (per_byte * 1e9) if per_byte > 0 else None,
            "worst_relative_error": worst,
        }
    return fits


def predicted_ms(calls: dict, sizes: dict, fits: dict) -> float:
    """The cost model's communication time for one step's collectives (calls and bytes per kind)."""
    total_s = 0.0
    for kind, count in calls.items():
        fit = fits[BENCH_OP[kind]]
        total_s += count * fit["alpha_us"] * 1e-6 + sizes.get(kind, 0) * fit["ns_per_byte"] * 1e-9
    return total_s * 1e3


def overhead(folder: Path, args) -> dict:
    """Median loop tokens/s of bare PyTorch, train_gpt and bare PyTorch again, taking turns."""
    folder.mkdir()
    steps = ["--max_steps", str(args.max_steps)]
    # --quick: both sides on compare_strategies' tiny model
    model = [f for k, v in _quick_model().items() for f in (f"--{k}", str(v))] if args.quick else []
    quick = (
        ["--parity_steps", "6", "--warmup_steps", "2", "--sample_tokens", "5", "--min_loss_drop", "0", *model]
        if args.quick
        else []
    )
    results = {}
    for strategy in args.overhead_strategies:
        runs = {variant: [] for variant in OVERHEAD_VARIANTS}
        for round_index in range(args.overhead_rounds):
            shift = round_index % len(OVERHEAD_VARIANTS)
            for variant in OVERHEAD_VARIANTS[shift:] + OVERHEAD_VARIANTS[:shift]:
                name = folder / f"{strategy}_{variant}_{round_index}"
                if variant == "experiment":
                    flags = [
                        "--strategy",
                        strategy,
                        "--report_to",
                        "none",
                        "--output_dir",
                        str(name),
                        *steps,
                        *quick,
                    ]
                    command, result = (
                        accelerate_launch("experiments/train_gpt.py", flags),
                        name / "summary.json",
                    )
                else:
                    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), str(REPO / "benchmarks" / "bare_gpt.py"),
                               "--strategy", strategy, "--output", f"{name}.json", *steps, *model]  # fmt: skip
                    result = Path(f"{name}.json")
                if not launch(command, Path(f"{name}.log"), args.timeout_s):
                    raise SystemExit(f"performance: {name.name} failed: see {name}.log")
                figures = json.loads(result.read_text())
                # the whole loop on both sides: bare_gpt times every step, so train_gpt's loop rate (its
                # tokens_per_s leaves out the first steps and the parity snapshot) is the like-for-like one
                runs[variant].append(
                    figures["metrics"]["loop_tokens_per_s"]
                    if variant == "experiment"
                    else figures["tokens_per_s"]
                )
        medians = {variant: statistics.median(values) for variant, values in runs.items()}
        results[strategy] = {
            "runs": runs,
            "median_tokens_per_s": medians,
            "ratio": medians["experiment"] / medians["bare"],
            "noise_floor": medians["bare_again"] / medians["bare"],
        }
    return results


def plot_timelines(folder: Path, rows: list[dict], path: Path) -> None:
    """Rank 0's median profiled step of every strategy, on one time axis."""
    traced = [(r, trace_breakdown(str(folder / r["strategy"] / "profile" / "rank0.json"))) for r in rows]
    labelled = [
        (f"{r['strategy']} ({r['ranks']})", step_lanes(median_step(steps))) for r, steps in traced if steps
    ]
    plot_timeline(
        labelled,
        STEP_KINDS,
        "Where one training step's time goes (rank 0, its median profiled step)",
        str(path),
    )


def markdown(report: dict, command: str) -> str:
    peak = report["peak"]
    lines = [f"`{command}`", "", "```", mfu.describe(peak), "```", "", mfu.mfu_table(report["mfu"]), ""]
    lines += ["| strategy | step ms | compute | communication | overlapped | idle | exposed communication |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, b in report["breakdown"].items():
        exposed = b["communication_ms"] - b["overlapped_ms"]
        lines.append(f"| {name} | {b['step_ms']:.1f} | {b['compute_ms']:.1f} | {b['communication_ms']:.1f} "
                     f"| {b['overlapped_ms']:.1f} | {b['idle_ms']:.1f} | {exposed:.1f} |")  # fmt: skip
    lines += [
        "",
        "| op (2 ranks) | alpha µs | bandwidth GB/s | worst relative error of the fit |",
        "|---|---|---|---|",
    ]
    for op, fit in report["cost_model"]["fits"].items():
        lines.append(
            f"| {op} | {fit['alpha_us']:.0f} | {fit['bandwidth_gbps'] or float('inf'):.2f} | {fit['worst_relative_error']:.0%} |"
        )
    lines += ["", "| strategy | collectives per step, forward + backward (calls: bytes) | predicted ms | traced: "
              "collective spans ms (calls) | of which waiting for the other rank | after both arrived "
              "| after both arrived / predicted | spans / predicted |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in report["cost_model"]["strategies"].items():
        calls = (
            "; ".join(f"{k} {row['calls'][k]}: {row['bytes'].get(k, 0):,}" for k in row["calls"]) or "none"
        )
        w = row["traced"]
        if "waiting_ms" in w:
            transfer_ratio = w["after_arrival_ms"] / row["predicted_ms"]
            lines.append(f"| {name} | {calls} | {row['predicted_ms']:.1f} | {w['spans_ms']:.1f} ({w['calls_per_step']:.0f}) "
                         f"| {w['waiting_ms']:.1f} | {w['after_arrival_ms']:.1f} | **{transfer_ratio:.2f}** "
                         f"| {w['spans_ms'] / row['predicted_ms']:.2f} |")  # fmt: skip
        else:  # several groups: the spans do not pair across ranks
            lines.append(f"| {name} | {calls} | {row['predicted_ms']:.1f} | {w['spans_ms']:.1f} (union) | – | – | – "
                         f"| {w['spans_ms'] / row['predicted_ms']:.2f} |")  # fmt: skip
    if report["overhead"]:
        lines += ["", "| overhead | bare PyTorch tokens/s | train_gpt | bare again | train_gpt / bare | noise floor |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, o in report["overhead"].items():
            m = o["median_tokens_per_s"]
            lines.append(f"| {name} | {m['bare']:,.0f} | {m['experiment']:,.0f} | {m['bare_again']:,.0f} "
                         f"| **{o['ratio']:.3f}** | {o['noise_floor']:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = dated_folder(args.output_dir, "performance")
    if folder is None:
        return 2
    print("1/5 peak and FLOPs per token ...", flush=True)
    peak = mfu.measure(*((256, 0.05) if args.quick else (2048, 1.0)))
    print("2/5 collectives bench ...", flush=True)
    fits = fit_alpha_beta(bench_collectives(folder / "collectives_bench", args))
    print("3/5 every strategy, profiled ...", flush=True)
    compare_args = ["--strategies", ",".join(args.strategies), "--max_steps", str(args.max_steps),
                    "--profile_steps", str(args.profile_steps), "--output_dir", str(folder / "strategies"),
                    "--timeout_s", str(args.timeout_s)] + (["--quick"] if args.quick else [])  # fmt: skip
    compared = compare_strategies.main(compare_args)
    (strategies_folder,) = (folder / "strategies").iterdir()
    rows = json.loads((strategies_folder / "comparison.json").read_text())
    rows = [r for r in rows if "error" not in r]
    flops_per_token = (
        mfu.flops_per_token_formula(_quick_model())["total"]
        if args.quick
        else peak["flops_per_token"]["formula"]["total"]
    )
    report = {
        "peak": peak,
        "mfu": mfu.mfu_rows(rows, peak["peak_flops_per_s_one_thread"]["float32"], flops_per_token),
        "breakdown": {r["strategy"]: r["step_breakdown_ms"][0] for r in rows if r["step_breakdown_ms"]},
        "cost_model": {"fits": fits, "strategies": {}},
    }
    print("4/5 the cost model ...", flush=True)
    for r in rows:
        if r["strategy"] == "none" or not r["step_breakdown_ms"]:
            continue
        predicted = predicted_ms(r["comm_calls"], r["comm_counted"], fits)
        traces = [
            str(strategies_folder / r["strategy"] / "profile" / f"rank{k}.json") for k in range(r["ranks"])
        ]
        # one group of all ranks: each rank's k-th collective is the same call; a layout of two dimensions has
        # two kinds of group
        traced = waiting_for_peers(traces) if " x " not in r["layout"] else {}
        traced = traced or {"spans_ms": r["step_breakdown_ms"][0]["communication_ms"]}
        report["cost_model"]["strategies"][r["strategy"]] = {
            "calls": r["comm_calls"], "bytes": r["comm_counted"], "predicted_ms": predicted, "traced": traced,
        }  # fmt: skip
    print("5/5 overhead against bare PyTorch ...", flush=True)
    report["overhead"] = overhead(folder / "overhead", args) if args.overhead_rounds else {}
    plot_timelines(strategies_folder, rows, folder / "timelines.png")
    command = command_line("benchmarks.performance", argv)
    table = markdown(report, command.strip())
    write_table(folder, "performance", table, report, also=", timelines.png")
    return 0 if compared == 0 else 1


def _quick_model() -> dict:
    """compare_strategies --quick's model, for its FLOPs per token."""
    quick = compare_strategies.QUICK
    return {
        k: int(quick[quick.index(f"--{k}") + 1])
        for k in ("vocab_size", "block_size", "n_layer", "n_head", "d_model")
    }


if __name__ == "__main__":
    sys.exit(main())
