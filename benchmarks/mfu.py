"""How close does GPT training come to what this machine can compute? The peak, the model's FLOPs, MFU.

    python -m benchmarks.mfu --comparison runs/compare_strategies/<time>/comparison.json
    python -m benchmarks.mfu --quick          # small GEMMs: checks every figure is produced

1. Peak: matmul FLOP/s on ONE thread (each rank runs one: torchrun and accelerate launch set
   OMP_NUM_THREADS=1), for a large square GEMM and for the model's own GEMM shapes (forward: q/k/v/o
   and the MLP on batch x context rows, the head against the vocabulary), float32 and bfloat16.
2. FLOPs per token of train_gpt's default model, by formula (nanoGPT / PaLM: 6N for the matmuls'
   forward + backward, N the parameters that multiply (position embeddings do not), plus 12 x n_layer
   x context x d_model for attention's two matmuls) and counted by torch.utils.flop_counter's
   FlopCounterMode on one forward + backward. In torch 2.13 FlopCounterMode has no formula for the CPU
   attention kernel (aten._scaled_dot_product_flash_attention_for_cpu): it counts the weight matmuls
   (mm, addmm) only, so counted = formula - attention - 6 x (biases + LayerNorms), measured exactly.
3. MFU per strategy, from a compare_strategies JSON: model FLOP/s achieved (tokens/s x FLOPs per token)
   / the peak of the cores the ranks really had (min(ranks, cores) x one thread's peak), against the
   square-GEMM peak and against the model-shape peak; and the same for the median step alone (tokens per
   step / the median forward + backward + optimizer time), the steady state without the loop's warm-up,
   parity snapshot or profiled steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.utils.flop_counter import FlopCounterMode

from common.config import finite_float  # noqa: E402
from common.gpt import PER_RANK_BATCH_SIZE, GPTConfig, build_gpt, lm_loss

# train_gpt's defaults (experiments/train_gpt.py Config): the model and one rank's micro-batch
MODEL = {
    k: v for k, v in dataclasses.asdict(GPTConfig()).items() if k != "tie_weights"
}  # train_gpt's default
PER_RANK_BATCH = PER_RANK_BATCH_SIZE


def gemm_flops_per_s(m: int, k: int, n: int, dtype: torch.dtype, min_time_s: float) -> float:
    """2mkn FLOPs per (m x k) @ (k x n), timed over repetitions for at least min_time_s (median of 5)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    repeats, elapsed = 1, 0.0
    while elapsed < min_time_s / 5:  # grow until one timing is long enough to trust
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        elapsed = time.perf_counter() - started
        repeats *= 2
    repeats //= 2
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        timings.append(time.perf_counter() - started)
    return 2 * m * k * n * repeats / sorted(timings)[2]


def model_gemm_shapes(model: dict, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of one forward's weight matmuls, one entry per matmul."""
    d, vocab, layers = model["d_model"], model["vocab_size"], model["n_layer"]
    per_block = [(tokens, d, d)] * 4 + [(tokens, d, 4 * d), (tokens, 4 * d, d)]
    return per_block * layers + [(tokens, d, vocab)]


def model_shape_peak(model: dict, tokens: int, dtype: torch.dtype, min_time_s: float) -> float:
    """FLOP/s over the model's own GEMMs: their total FLOPs / their total time (each shape timed once)."""
    shapes = model_gemm_shapes(model, tokens)
    distinct = {shape: gemm_flops_per_s(*shape, dtype, min_time_s) for shape in set(shapes)}
    flops = sum(2 * m * k * n for m, k, n in shapes)
    return flops / sum(2 * m * k * n / distinct[(m, k, n)] for m, k, n in shapes)


def flops_per_token_formula(model: dict) -> dict:
    """nanoGPT's estimate_mfu / PaLM appendix B: 6N + 12 L T d per token (forward + backward)."""
    gpt = build_gpt(GPTConfig(**model), 0)
    n = sum(p.numel() for p in {id(p): p for p in gpt.parameters()}.values()) - gpt.pos_emb.weight.numel()
    attention = 12 * model["n_layer"] * model["block_size"] * model["d_model"]
    return {
        "parameters_that_multiply": n,
        "matmuls": 6 * n,
        "attention": attention,
        "total": 6 * n + attention,
    }


def flops_per_token_counted(model: dict, batch: int) -> float:
    """FlopCounterMode's count of one forward + backward, per token."""
    gpt = build_gpt(GPTConfig(**model), 0)
    x = torch.randint(0, model["vocab_size"], (batch, model["block_size"]))
    with FlopCounterMode(display=False) as counter:
        lm_loss(gpt(x), x).backward()
    return counter.get_total_flops() / x.numel()


def measure(square: int, min_time_s: float) -> dict:
    """The one-thread peaks (float32 and bf16; square GEMM and the model's shapes) and FLOPs per token. One
    thread is one rank's share; the process's own thread count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(square, min_time_s)
    finally:
        torch.set_num_threads(threads)


def _measure(square: int, min_time_s: float) -> dict:
    tokens = PER_RANK_BATCH * MODEL["block_size"]
    peaks = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        # bf16 GEMMs run ~280x slower than float32 on this CPU (no bf16 matmul units; measured 0.3
        # GFLOP/s at 2048): a 2048 bf16 square alone took minutes, so bf16 is timed at 256
        size = square if dtype == torch.float32 else min(square, 256)
        peaks[name] = {
            "square_gemm": gemm_flops_per_s(size, size, size, dtype, min_time_s),
            "model_shapes": model_shape_peak(MODEL, tokens, dtype, min_time_s),
        }
    formula = flops_per_token_formula(MODEL)
    counted = flops_per_token_counted(MODEL, PER_RANK_BATCH)
    return {
        "threads": 1,
        "cores": os.cpu_count(),
        "square": square,
        "peak_flops_per_s_one_thread": peaks,
        "flops_per_token": {
            "formula": formula,
            "counted": counted,
            "counted_over_formula": counted / formula["total"],
        },
    }


def describe(figures: dict) -> str:
    peaks, square = figures["peak_flops_per_s_one_thread"], figures["square"]
    formula, counted = figures["flops_per_token"]["formula"], figures["flops_per_token"]["counted"]
    return (f"peak, one thread: square {square}: {peaks['float32']['square_gemm'] / 1e9:.1f} GFLOP/s float32, "
            f"square {min(square, 256)}: {peaks['bfloat16']['square_gemm'] / 1e9:.1f} bfloat16; the model's GEMM shapes: "
            f"{peaks['float32']['model_shapes'] / 1e9:.1f} / {peaks['bfloat16']['model_shapes'] / 1e9:.1f}\n"
            f"FLOPs per token: formula {formula['total']:,} (6N {formula['matmuls']:,} + attention "
            f"{formula['attention']:,}), counted {counted:,.0f} ({counted / formula['total']:.3f} x formula)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--comparison", default="", help="a compare_strategies comparison.json: MFU per strategy"
    )
    parser.add_argument("--square", type=int, default=2048, help="size of the square GEMM for the peak")
    parser.add_argument(
        "--min_time_s", type=finite_float, default=1.0, help="timing per GEMM shape (5 repeats)"
    )
    parser.add_argument("--quick", action="store_true", help="a 256 square GEMM, short timings")
    parser.add_argument("--output", default="", help="write the figures as JSON here (must not exist)")
    args = parser.parse_args(argv)
    if args.output and os.path.exists(args.output):
        parser.error(f"--output {args.output!r} exists; choose a new path")
    if args.comparison and not os.path.isfile(args.comparison):
        parser.error(f"--comparison {args.comparison!r} is not a file")
    square, min_time_s = (256, 0.05) if args.quick else (args.square, args.min_time_s)
    figures = measure(square, min_time_s)
    print(describe(figures))
    if args.comparison:
        peak, flops_per_token = (
            figures["peak_flops_per_s_one_thread"]["float32"],
            figures["flops_per_token"]["formula"]["total"],
        )
        figures["mfu"] = mfu_rows(json.load(open(args.comparison)), peak, flops_per_token)
        print(mfu_table(figures["mfu"]))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(figures, handle, indent=2)
    return 0


def mfu_rows(comparison_rows: list[dict], peak: dict, flops_per_token: float) -> list[dict]:
    """MFU of each compare_strategies row: model FLOP/s achieved / (cores the ranks had x one thread's
    peak), against the square-GEMM peak and against the model-shape peak."""
    rows = []
    for row in comparison_rows:
        if "error" in row:
            continue
        ranks = row["ranks"]
        cores = min(ranks, os.cpu_count())
        achieved = row["tokens_per_s"] * flops_per_token
        # the steady state: the median step's phases (no warm-up, evaluation snapshot or profiled steps)
        median_step_s = sum(row.get("step_time_ms", {}).values()) / 1e3
        in_step = (
            row["tokens_per_step"] * flops_per_token / median_step_s if "tokens_per_step" in row else 0.0
        )
        rows.append({"strategy": row["strategy"], "ranks": ranks, "cores": cores, "tokens_per_s": row["tokens_per_s"],
                     "model_flops_per_s": achieved, "mfu_square": achieved / (cores * peak["square_gemm"]),
                     "mfu_model_shapes": achieved / (cores * peak["model_shapes"]),
                     "mfu_median_step_model_shapes": in_step / (cores * peak["model_shapes"])})  # fmt: skip
    return rows


def mfu_table(rows: list[dict]) -> str:
    lines = [
        "| strategy | ranks | tokens/s | model GFLOP/s | MFU vs square-GEMM peak | MFU vs model-shape peak "
        "| median step's MFU vs model-shape peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['ranks']} on {r['cores']} cores | {r['tokens_per_s']:,.0f} "
                     f"| {r['model_flops_per_s'] / 1e9:.2f} | {r['mfu_square']:.1%} | {r['mfu_model_shapes']:.1%} "
                     f"| {r['mfu_median_step_model_shapes']:.1%} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
