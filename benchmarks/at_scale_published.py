"""experiments/at_scale.py beside published figures: ZeRO's model states, Korthikanti et al.'s activations, the
Llama 3 and Megatron-LM layouts at their real world sizes. Every figure of ours is an at_scale run's (fake
tensors, the real sharding code: measured bytes; a predicted step), each run passing its memory and
communication checks.

    python -m benchmarks.at_scale_published              # 12-23 minutes here; the tables of docs/at_scale.md
    python -m benchmarks.at_scale_published --quick      # the small tables only (ZeRO, activations): ~2 minutes

Writes <output_dir>/<UTC time>/published.md and published.json, and every at_scale run's folder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workers import benchmark_parser, command_line, dated_folder, write_table
from common.processes import run_process_tree
from planning.cost_model import model_flops_per_token
from planning.published import MODELS, PUBLISHED_RUNS, ZERO_FIGURE_1

REPO = Path(__file__).resolve().parent.parent
GB = 1e9  # the papers' gigabytes
# ZeRO's 7.5B model: Megatron-LM's 7.5B shape (Narayanan et al. 2021, Table 1: 36 layers, width 4,096, 32 heads)
ZERO_MODEL = (
    "--model custom --n_layer 36 --d_model 4096 --n_head 32 --vocab_size 51200 --block_size 2048".split()
)
GPT3_LAYER = "--model gpt3_175b --per_rank_batch_size 1".split()  # Korthikanti et al.'s Table 2: s 2048, b 1


def run(folder: Path, name: str, args: list[str]) -> dict:
    """One at_scale run; its summary (it must pass its checks: a figure from a failed run is no figure)."""
    command = [sys.executable, str(REPO / "experiments" / "at_scale.py"), "--report_to", "none", "--output_dir",
               str(folder / name), *args]  # fmt: skip
    print(" ".join(command[1:]), flush=True)
    done = run_process_tree(command, 1800, cwd=REPO)
    (folder / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode == 2:  # a layout this project refuses (one line): a row that says so
        return {"refused": done.stderr.strip().splitlines()[-1].split("error: ", 1)[-1]}
    summary_path = folder / name / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"passed": False}
    if done.returncode != 0 or not summary["passed"]:
        raise SystemExit(f"at_scale_published: {name} did not pass its checks: see {folder / name}")
    return summary


def zero_table(folder: Path) -> list[str]:
    """Model states per GPU (parameters, gradients, AdamW's state) at rest, and with FSDP's gathered copy."""
    paper = ZERO_FIGURE_1["gb_per_gpu"]
    rows = [
        ("baseline (DDP)", "baseline", ["--dp_replicate", "64"]),
        ("P_os+g (ZeRO-2): dp_shard 64, --reshard_after_forward never", "os_g",
         ["--dp_shard", "64", "--reshard_after_forward", "never"]),
        ("P_os+g+p (ZeRO-3): dp_shard 64", "os_g_p", ["--dp_shard", "64"]),
    ]  # fmt: skip
    lines = ["| ZeRO's stage | ZeRO Fig. 1, GB per GPU | ours at rest, GB | ours while the step runs (+ FSDP's gathered "
             "bf16 copy), GB | ours / ZeRO's |", "|---|---|---|---|---|"]  # fmt: skip
    lines.insert(2, f"| P_os (ZeRO-1) | {paper['os']} | – | – | not run: FSDP2 always shards the parameters with the "
                 "optimizer state (ZeRO-1 is DeepSpeed's, which a fake process group cannot run) |")  # fmt: skip
    for label, key, degrees in rows:
        summary = run(folder, f"zero_{key}", [*ZERO_MODEL, "--world_size", "64", "--per_rank_batch_size", "1",
                                              *degrees])  # fmt: skip
        held = summary["metrics"]["ranks"][0]["held"]
        at_rest = (held["params"] + held["grads"] + held["optimizer"]) / GB
        running = at_rest + max(0, held["params_gathered"] - held["params"]) / GB
        lines.append(f"| {label} | {paper[key]} | {at_rest:.2f} | {running:.2f} | "
                     f"{(running if key == 'os_g' else at_rest) / paper[key]:.2f} |")  # fmt: skip
    return lines


def activation_table(folder: Path) -> list[str]:
    """Korthikanti et al. 2022, Table 2, per layer, GPT-3 175B (s 2048, b 1, h 12288, a 96), t = 8: theirs by
    formula (16-bit activations, 1-byte dropout masks, the s x s attention scores kept), ours measured: the
    activations of an at_scale run with two blocks minus one with one block (FSDP's bf16 policy on, as
    Megatron's activations are all 16-bit)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    rows = [
        ("no parallelism", sbh * (34 + 5 * a * s / h), ["--world_size", "2", "--dp_shard", "2"]),
        ("tensor parallelism", sbh * (10 + 24 / t + 5 * a * s / (h * t)), ["--world_size", "16", "--dp_shard", "2",
                                                                          "--tp", "8"]),
        ("tensor + sequence parallelism", sbh / t * (34 + 5 * a * s / h), ["--world_size", "16", "--dp_shard", "2",
                                                                           "--tp", "8", "--sequence_parallel"]),
        ("tensor parallelism + selective recompute", sbh * (10 + 24 / t), ["--world_size", "16", "--dp_shard", "2",
                                                                           "--tp", "8", "--activation_checkpointing",
                                                                           "selective"]),
        ("tensor + sequence parallelism + selective recompute", sbh * 34 / t,
         ["--world_size", "16", "--dp_shard", "2", "--tp", "8", "--sequence_parallel", "--activation_checkpointing",
          "selective"]),
    ]  # fmt: skip
    lines = [
        "| per layer | Korthikanti et al. Table 2, GB | ours measured, GB | ours / theirs |",
        "|---|---|---|---|",
    ]
    for label, theirs, degrees in rows:
        kept = [run(folder, f"act_{len(lines)}_{n}", [*GPT3_LAYER, "--n_layer", str(n), *degrees])["metrics"]["ranks"][0]
                ["activations_per_microbatch"] for n in (1, 2)]  # fmt: skip
        ours = kept[1] - kept[0]
        lines.append(f"| {label} | {theirs / GB:.2f} | {ours / GB:.2f} | {ours / theirs:.2f} |")
    return lines


def layout_table(folder: Path, runs: list) -> list[str]:
    """Each published layout at its world size: measured peak per GPU against 80 GiB, and the predicted step's
    TFLOP/s in the paper's own count of FLOPs beside the paper's."""
    lines = ["| run | layout | checkpointing | measured peak GiB (stage 0 / last) | fits 80 GiB | PREDICTED TFLOP/s per GPU "
             "(recorded ops, eager) | closed form, eager (its compute / the recorded ops') | closed form, fused kernels "
             "(the run's attention kernel) "
             "| published | predicted / published (fused) | largest predicted terms (recorded ops), s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for published in runs:
        degrees = [x for d, n in published.degrees.items() for x in (f"--{d}", str(n))]
        for checkpointing in ("full",) if published.recompute_counted else ("none", "full"):
            summary = run(folder, f"{published.name}_{checkpointing}", [
                "--model", published.model, "--world_size", str(published.world_size), *degrees,
                "--block_size", str(published.block_size), "--per_rank_batch_size", str(published.per_rank_batch_size),
                "--hardware", published.hardware, "--activation_checkpointing", checkpointing,
                "--attention", published.attention])  # fmt: skip
            layout_text = " x ".join(f"{d} {n}" for d, n in published.degrees.items())
            if "refused" in summary:
                lines.append(f"| {published.source} | {layout_text} | {checkpointing} | refused: "
                             f"{summary['refused']} | | | | | | | |")  # fmt: skip
                continue
            metrics = summary["metrics"]
            memory = metrics["memory"]
            prediction = metrics["prediction"]
            shape = MODELS[published.model].shape
            cfg = type(shape)(**{**shape.__dict__, "block_size": published.block_size})
            flops = model_flops_per_token(cfg, published.recompute_counted) * prediction["global_tokens"]
            tflops = flops / prediction["step_s"] / published.world_size / 1e12
            closed = metrics["prediction_closed_form"]
            eager = flops / closed["step_s"] / published.world_size / 1e12
            agreement = closed["terms_s"]["compute"] / prediction["terms_s"]["compute"]
            fused = flops / metrics["prediction_fused"]["step_s"] / published.world_size / 1e12
            terms = sorted(((v, k) for k, v in prediction["terms_s"].items() if k != "data_parallel_total"),
                           reverse=True)[:3]  # fmt: skip
            lines.append(
                f"| {published.source} | {layout_text} | "
                f"{checkpointing} | {memory[0]['peak_bytes'] / 2**30:.1f} / {memory[-1]['peak_bytes'] / 2**30:.1f} | "
                f"{'yes' if metrics['fits'] else 'no'} | {tflops:.0f} | {eager:.0f} ({agreement:.3f}) | {fused:.0f} "
                f"({published.attention}) | "
                f"{published.tflops_per_gpu:.0f} | {fused / published.tflops_per_gpu:.2f} | "
                f"{', '.join(f'{k} {v:.2f}' for v, k in terms)} |"
            )
    return lines


# Llama 3's 405B runs as the paper describes them (section 3.3.2): an interleaved pipeline schedule whose first and
# last stages hold one block fewer, FSDP that does not reshard after forward (our pipeline's FSDP default), tensor
# parallelism with sequence parallelism
AS_RAN = ("llama3_405b_8192", "llama3_405b_16384")


def as_ran_table() -> list[str]:
    """Llama 3's rows 1 and 2 with the interleaved schedule (ours: two stages a rank), the first and the last stage
    one block lighter (126 blocks on 32 stages: 3, 4, ..., 4, 3) and sequence parallelism,
    priced by tools.plan (the fake ranks run one stage a rank only, so at_scale cannot measure these); without
    activation checkpointing and with selective (sequence parallelism with full checkpointing is not built)."""
    import torch

    from common.gpt import GPT
    from planning.hardware import load_hardware
    from tools.plan import PlanArgs, evaluate

    lines = ["| run | layout | checkpointing | estimated peak GiB | fits 80 GiB | PREDICTED TFLOP/s per GPU (fused) | published "
             "| predicted / published | step s |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for published in (r for r in PUBLISHED_RUNS if r.name in AS_RAN):
        shape = MODELS[published.model].shape
        cfg = type(shape)(**{**shape.__dict__, "block_size": published.block_size})
        dp = published.world_size // (published.degrees["pp"] * published.degrees["tp"])
        args = PlanArgs(model=published.model, gpus=published.world_size, hardware=published.hardware,
                        global_batch=published.per_rank_batch_size * dp, attention=published.attention,
                        pp_fewer_blocks_at_ends=1)  # fmt: skip
        with torch.device("meta"):
            reference = GPT(cfg)
        for checkpointing in ("none", "selective"):
            row = evaluate(reference, cfg, published.degrees, checkpointing, args, load_hardware(published.hardware),
                           "interleaved_1f1b", sequence_parallel=True)  # fmt: skip
            # in the paper's own count of FLOPs (the planner's counts the causal half of the attention)
            tflops = (model_flops_per_token(cfg, published.recompute_counted) * row["tokens_per_s"]
                      / published.world_size / 1e12)  # fmt: skip
            lines.append(f"| {published.source} | {row['layout']} | {checkpointing} | {row['peak_bytes'] / 2**30:.1f} | "
                         f"{'yes' if row['fits'] else 'no'} | {tflops:.0f} | {published.tflops_per_gpu:.0f} | "
                         f"{tflops / published.tflops_per_gpu:.2f} | {row['step_s']:.2f} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--output_dir", default="runs/at_scale_published", help="a new dated folder is made in it"
    )
    args = parser.parse_args(argv)
    folder = dated_folder(args.output_dir, "at_scale_published")
    if folder is None:
        return 2
    sections = {"ZeRO, Figure 1: 7.5B parameters on 64 GPUs, model states per GPU": zero_table(folder),
                "Korthikanti et al. 2022, Table 2: activations per layer, GPT-3 175B": activation_table(folder)}  # fmt: skip
    if not args.quick:
        sections["Published layouts at their world size"] = layout_table(folder, PUBLISHED_RUNS)
        sections[
            "Llama 3 as it ran: the interleaved schedule and sequence parallelism (priced by tools.plan)"
        ] = as_ran_table()
    command = command_line("benchmarks.at_scale_published", argv)
    text = f"`{command.strip()}`\n\n" + "\n\n".join(f"**{title}**\n\n" + "\n".join(lines)
                                                  for title, lines in sections.items()) + "\n"  # fmt: skip
    write_table(folder, "published", text, sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
