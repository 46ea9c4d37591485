"""What activation checkpointing trades: bytes autograd keeps for backward against FLOPs recomputed, per mode.

    python -m benchmarks.activation_checkpointing            # train_gpt's default model, one rank's batch
    python -m benchmarks.activation_checkpointing --quick    # a tiny GPT: checks every figure is produced

One process, one thread, the same weights and batch in every mode (none, full, selective:
common/activations.py). Per mode: the bytes one forward keeps (counted: SavedActivations), the FLOPs of a
forward + backward (counted: FlopCounterMode, which in torch 2.13 counts the weight matmuls only, no CPU
attention kernel), the median time of a forward + backward, and the gradients, which must equal none's
exactly: checkpointing changes when a value is computed, not what it is. Theory per block, B rows of T
tokens, width d, h heads, float32:
  kept  none       16 BTd + 4 BT + BhT floats: LayerNorm inputs and outputs (2 + 2), q, k, v (3), attention's
                   output (1, the output projection's input too), the MLP's input and GELU's input and
                   output (4 + 4), LayerNorm statistics (4 BT), attention's log-sum-exp (BhT)
        full       BTd: the block's input, kept to run the block again
        selective  11 BTd + BhT: the input, every matmul's output (q, k, v, o: 4; MLP: 4 + 1), attention's
  recomputed FLOPs  full: 16 BTd^2 per block, every matmul but the MLP's last (the recompute stops once
                   backward has what it needs); selective: 0.
The rest of the model (embeddings, final LayerNorm, the logits) keeps the same bytes in every mode: the
check is on the difference from none, which must be n_layer x the per-block difference, to the byte.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.utils.flop_counter import FlopCounterMode

from common.activations import SavedActivations
from common.gpt import PER_RANK_BATCH_SIZE, GPTConfig, build_gpt, lm_loss
from strategies import activation_checkpointing
from strategies.activation_checkpointing import MODES

QUICK = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, d_model=32)


def kept_per_block(mode: str, rows: int, cfg: GPTConfig) -> int:
    """Bytes one block keeps for backward, by theory (the module docstring)."""
    tokens, d = rows * cfg.block_size, cfg.d_model
    floats = {
        "none": 16 * tokens * d + 4 * tokens + tokens * cfg.n_head,
        "full": tokens * d,
        "selective": 11 * tokens * d + tokens * cfg.n_head,
    }[mode]
    return 4 * floats


def recomputed_flops(mode: str, rows: int, cfg: GPTConfig) -> int:
    """Matmul FLOPs the backward adds by recomputing, by theory."""
    return cfg.n_layer * 16 * rows * cfg.block_size * cfg.d_model**2 if mode == "full" else 0


def measure(mode: str, cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor, repeats: int) -> dict:
    model = build_gpt(cfg, 0)
    activation_checkpointing.apply(model, mode)
    with FlopCounterMode(display=False) as flops:
        with SavedActivations() as saved:
            loss = lm_loss(model(x), y)
        loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    seconds = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        lm_loss(model(x), y).backward()
        seconds.append(time.perf_counter() - started)
    return {
        "mode": mode,
        "kept_bytes": saved.bytes,
        "flops": flops.get_total_flops(),
        "step_ms": 1e3 * statistics.median(seconds),
        "loss": loss.item(),
        "gradients": gradients,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=PER_RANK_BATCH_SIZE, help="blocks of context per batch")
    parser.add_argument("--repeats", type=int, default=20, help="timed forward + backward passes per mode")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 3 timed passes")
    parser.add_argument("--output", default="", help="write the figures as JSON here (must not exist)")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.repeats < 1:
        parser.error(f"--rows and --repeats must be >= 1, got {args.rows}, {args.repeats}")
    if args.output and os.path.exists(args.output):
        parser.error(f"--output {args.output} exists: not overwritten")
    cfg, repeats = (QUICK, 3) if args.quick else (GPTConfig(), args.repeats)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's thread, as train_gpt's ranks run
    try:
        generator = torch.Generator().manual_seed(0)
        x, y = (
            torch.randint(0, cfg.vocab_size, (args.rows, cfg.block_size), generator=generator) for _ in "xy"
        )
        results = {mode: measure(mode, cfg, x, y, repeats) for mode in MODES}
    finally:
        torch.set_num_threads(threads)
    none = results["none"]
    rows = []
    for mode, r in results.items():
        kept_theory = none["kept_bytes"] + cfg.n_layer * (
            kept_per_block(mode, args.rows, cfg) - kept_per_block("none", args.rows, cfg)
        )
        flops_theory = none["flops"] + recomputed_flops(mode, args.rows, cfg)
        same = all(torch.equal(g, none["gradients"][name]) for name, g in r["gradients"].items())
        rows.append({
            "mode": mode, "kept_bytes": r["kept_bytes"], "kept_bytes_theory": kept_theory,
            "flops": r["flops"], "flops_theory": flops_theory, "step_ms": r["step_ms"],
            "gradients_equal_none": same, "loss": r["loss"],
        })  # fmt: skip
    print(markdown(rows, cfg, args.rows))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"model": vars(cfg), "rows_per_batch": args.rows, "modes": rows}, handle, indent=2)
    exact = all(r["kept_bytes"] == r["kept_bytes_theory"] and r["flops"] == r["flops_theory"] for r in rows)
    return 0 if exact and all(r["gradients_equal_none"] for r in rows) else 1


def markdown(rows: list[dict], cfg: GPTConfig, batch_rows: int) -> str:
    none = rows[0]
    lines = [
        f"GPT {cfg.n_layer} x {cfg.d_model}, batch {batch_rows} x {cfg.block_size} tokens, one thread",
        "",
        "| mode | bytes kept for backward (theory) | of none | matmul FLOPs per step (theory) | of none "
        "| fwd + bwd ms | gradients = none's |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['kept_bytes']:,} ({r['kept_bytes_theory']:,}) | {r['kept_bytes'] / none['kept_bytes']:.2f} "
            f"| {r['flops']:,} ({r['flops_theory']:,}) | {r['flops'] / none['flops']:.2f} | {r['step_ms']:.1f} "
            f"| {'bitwise' if r['gradients_equal_none'] else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
