"""The step-time predictor (planning/cost_model.py) against steps this machine really runs: measure this machine
into a hardware profile, train every 2-rank layout, predict each one's step from its own workload, compare.

    python -m benchmarks.at_scale_calibration                # the profile, then ddp, zero2, fsdp, tp, pp, cp: ~5 min
    python -m benchmarks.at_scale_calibration --quick        # a tiny GPT, 12 steps: checks the figures are made

1. The profile: one thread's matmul peak (float32, a 2048 square: benchmarks/mfu.py) and copy bandwidth
   (256 MiB), and gloo's collectives on 2 ranks (experiments/collectives_bench.py) fitted per kind as
   alpha + bytes / bandwidth (benchmarks/performance.py's fit). Written as this_machine.yaml, the entry
   planning/hardware.yaml keeps (pasted by hand, with this command).
2. Each preset's run: train_gpt on 2 ranks through `accelerate launch`, one thread per rank; its median step
   (forward + backward + optimizer) and the collectives it counted (calls per kind).
3. The prediction of that step: predict_step on the run's own layout, workload and flags, the calls counted.
Writes <output_dir>/<UTC time>/: calibration.md (the table docs/at_scale.md shows), calibration.json,
this_machine.yaml, and every run's folder.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import yaml

from benchmarks import compare_strategies, mfu
from benchmarks.performance import bench_collectives, fit_alpha_beta
from benchmarks.workers import benchmark_parser, dated_folder, write_table
from common.gpt import GPT, GPTConfig
from planning.cost_model import hardware_from, predict_step
from strategies.args import PRESETS
from strategies.layout import Layout, Workload

KIND_OF_OP = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter"}  # fmt: skip
STRATEGIES = ("ddp", "zero2", "fsdp", "tp", "pp", "cp")


def copy_gbps(size_bytes: int = 256 * 2**20) -> float:
    """One thread copying `size_bytes` (read + write counted), best of 5."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source, target = torch.empty(size_bytes // 4), torch.empty(size_bytes // 4)
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return 2 * size_bytes / best / 1e9


def measure_profile(folder: Path, args) -> dict:
    """this_machine's profile, measured now (the module docstring, step 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what each rank gets
    try:
        peak = mfu.gemm_flops_per_s(2048, 2048, 2048, torch.float32, 0.5 if args.quick else 2.0)
    finally:
        torch.set_num_threads(threads)
    fits = fit_alpha_beta(bench_collectives(folder / "collectives_bench", args))
    all_reduce = fits["all_reduce"]
    link = {
        "bandwidth_gbps": round(all_reduce["bandwidth_gbps"], 3),
        "latency_us": round(all_reduce["alpha_us"] / 2),
    }
    return {
        "description": "this machine, one thread per rank, gloo over shared memory; measured by "
        f"`python -m benchmarks.at_scale_calibration` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "peak_tflops": {"fp32": round(peak / 1e12, 5), "bf16": round(peak / 1e12, 5)},
        "memory_gb": 24,
        "memory_bandwidth_gbps": round(copy_gbps(), 2),
        "gpus_per_node": 2,
        "intra_node": link,  # what a ring step model would use; the fits below replace it per kind
        "inter_node": link,
        "overlaps_communication": False,
        "fitted": {
            KIND_OF_OP[op]: {
                "bandwidth_gbps": round(fit["bandwidth_gbps"] or 1e6, 3),
                "latency_us": round(fit["alpha_us"]),
            }
            for op, fit in fits.items()
            if op in KIND_OF_OP
        },  # fmt: skip
    }


def predicted_ms(summary: dict, hardware) -> dict:
    """The predictor's step for a finished train_gpt run, from its own config and its counted calls."""
    config, metrics = summary["config"], summary["metrics"]
    model = GPTConfig(**{**GPTConfig().__dict__, **{k: config[k] for k in GPTConfig().__dict__ if k in config},
                         "vocab_size": metrics["corpus"]["vocab_size"]})  # fmt: skip
    layout = Layout(**metrics["layout"])
    work = Workload(model, config["per_rank_batch_size"], config["gradient_accumulation_steps"],
                    config["mixed_precision"])  # fmt: skip
    with torch.device("meta"):
        reference = GPT(model)
    calls = metrics.get("communication", {}).get("counted", {}).get("calls", {})
    prediction = predict_step(reference, layout, SimpleNamespace(**config), work, hardware, calls)
    return {
        "step_ms": 1000 * prediction["step_s"],
        "terms_ms": {k: 1000 * v for k, v in prediction["terms_s"].items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="presets to run, 2 ranks each")
    parser.add_argument(
        "--max_steps", type=int, default=40, help="steps per run (the median step is compared)"
    )
    parser.add_argument(
        "--output_dir", default="runs/at_scale_calibration", help="a new dated folder is made in it"
    )
    parser.add_argument("--timeout_s", type=float, default=1200, help="per run")
    args = parser.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in PRESETS]
    if unknown:
        parser.error(f"--strategies: {unknown} not among {', '.join(PRESETS)}")
    folder = dated_folder(args.output_dir, "at_scale_calibration")
    if folder is None:
        return 2
    profile = measure_profile(folder, args)
    (folder / "this_machine.yaml").write_text(yaml.safe_dump({"this_machine": profile}, sort_keys=False))
    hardware = hardware_from("this_machine", profile)
    run_args = SimpleNamespace(
        quick=args.quick, max_steps=args.max_steps, profile_steps=0, timeout_s=args.timeout_s
    )
    rows = []
    for name in strategies:
        preset = PRESETS[name]
        run = compare_strategies.Run(name, ["--strategy", name], preset.ranks, preset.launch_config)
        print(f"{name} on {run.ranks} ranks ...", flush=True)
        summary = compare_strategies.run_strategy(run, folder / name, run_args)
        if "error" in summary:
            rows.append({"strategy": name, "error": summary["error"]})
            continue
        measured = sum(summary["metrics"]["step_time_ms"].values())
        predicted = predicted_ms(summary, hardware)
        rows.append({"strategy": name, "layout": Layout(**summary["metrics"]["layout"]).describe(),
                     "measured_ms": measured, "predicted_ms": predicted["step_ms"],
                     "ratio": predicted["step_ms"] / measured, "terms_ms": predicted["terms_ms"]})  # fmt: skip
    command = "python -m benchmarks.at_scale_calibration " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    table = markdown(rows, profile, command.strip())
    write_table(folder, "calibration", table, {"profile": profile, "rows": rows}, also=", this_machine.yaml")
    return 0 if all("error" not in r for r in rows) else 1


def markdown(rows: list[dict], profile: dict, command: str) -> str:
    fitted = ", ".join(f"{kind} {f['latency_us']} us + bytes / {f['bandwidth_gbps']} GB/s"
                       for kind, f in profile["fitted"].items())  # fmt: skip
    lines = [
        f"`{command}`",
        "",
        f"this_machine: matmul peak {profile['peak_tflops']['fp32'] * 1000:.1f} GFLOP/s (one thread, float32), "
        f"copy {profile['memory_bandwidth_gbps']} GB/s; gloo on 2 ranks: {fitted}",
        "",
        "| preset | layout | measured step ms | PREDICTED step ms | predicted / measured | predicted terms, ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | – | {r['error']} | – | – | – |")
            continue
        terms = ", ".join(
            f"{k} {v:.1f}" for k, v in r["terms_ms"].items() if v >= 0.05 and k != "data_parallel_total"
        )
        lines.append(f"| {r['strategy']} | {r['layout']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{r['ratio']:.2f} | {terms} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
