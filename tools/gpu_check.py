"""The first GPU run, in one command: every experiment's GPU path on the GPUs of this machine, one report.

    bash scripts/gpu_check.sh                 # every check that fits the visible GPUs; the report in runs/gpu_check/
    bash scripts/gpu_check.sh --dry_run       # the commands, nothing run
    python -m tools.gpu_check --only train_gpt_tp2 --max_steps 200

What runs (each a real experiment through the launcher a GPU user types, its own checks deciding its verdict):
- one GPU: ddp_linear, collectives (NCCL's 1-rank group), manual_data_parallel, loss_normalization, model_parallel
  (a device map), train_gpt in one process in float32, in bf16 and with a mixture of experts (CUDA's grouped GEMM
  in bf16), and the `gpu` pytest tier;
- two GPUs: the same experiments on 2 ranks through accelerate_configs/multi_gpu_ddp.yaml (NCCL, its bf16), train_gpt
  under dp_replicate, dp_shard (ZeRO-3), ZeRO-2 (a unit a block on GPUs), tp with sequence parallelism, pp, ep, and
  cp (refused in one line before start-up: its attention is the CPU kernel), DeepSpeed ZeRO-2, and fault_tolerance
  over torchft's NCCL group (with a failure survived where a third GPU holds the spare);
- four GPUs: train_gpt under dp_shard 2 x tp 2.
Each train_gpt run is set beside experiments/at_scale.py's run of the same model and layout on fake ranks priced
on --hardware: peak memory measured (torch's max_memory_allocated) against at_scale's estimate, and the step
measured (the median of its watched phases) against at_scale's PREDICTED step: the predictor's first real GPU
points. MFU is 6 x parameters x tokens/s against the profile's peak (the model's FLOPs, attention left out).
The report: <output_dir>/gpu_check.md and gpu_check.json. Exit 0 when every check ended as expected.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI_GPU = os.path.join("accelerate_configs", "multi_gpu_ddp.yaml")
DEEPSPEED = os.path.join("accelerate_configs", "deepspeed_zero2.yaml")
PER_RANK_BATCH_SIZE = 4  # train_gpt's default: at_scale is given the same rows
# train_gpt's --vocab_size default: at_scale is given it for a transformers config (which has no tokenizer there)
VOCABULARY = 2048


@dataclass
class Check:
    name: str
    gpus: int  # the GPUs it needs (and runs on)
    command: list[str]  # run from the repository root, --output_dir appended where `writes_summary`
    expect: str = "passed"  # or "refused": exit 2 with `refusal` in its one line
    refusal: str = ""
    gpt_degrees: dict | None = (
        None  # a train_gpt run's degrees, for at_scale beside it (None: none beside it)
    )
    gpt_flags: list[str] = field(default_factory=list)
    writes_summary: bool = True


def launcher(gpus: int, script: str, config: str = MULTI_GPU) -> list[str]:
    """python for one GPU; accelerate launch with the GPU config (its NCCL, its bf16) for several."""
    program = os.path.join("experiments", script)
    if gpus == 1:
        return [sys.executable, program]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", str(gpus),
            program]  # fmt: skip


def fault_tolerance(name: str, gpus: int, failures: int) -> Check:
    """Two replica groups and a spare a failure, each process on a GPU of its own (the experiment starts them)."""
    return Check(name, gpus, [*launcher(1, "fault_tolerance.py"), "--report_to", "none", "--replica_groups", "2",
                              "--failures", str(failures)])  # fmt: skip


def gpt(name: str, gpus: int, degrees: dict, flags: list[str], steps: int, config: str = MULTI_GPU) -> Check:
    """train_gpt under `degrees`, at_scale beside it (DeepSpeed's engine has no fake-rank run: none beside it)."""
    args = [f"--{dim}={n}" for dim, n in degrees.items()]
    return Check(name, gpus, [*launcher(gpus, "train_gpt.py", config), "--report_to", "none", "--max_steps", str(steps),
                              *args, *flags], gpt_degrees=None if config == DEEPSPEED else degrees,
                 gpt_flags=flags)  # fmt: skip


def experiment(name: str, gpus: int, script: str, *flags: str) -> Check:
    """An experiment with its own defaults (and `flags`), on `gpus` GPUs."""
    return Check(name, gpus, [*launcher(gpus, script), "--report_to", "none", *flags])


# the experiments other than train_gpt, on one GPU and on two, each with its own defaults
PLAIN = ("ddp_linear", "collectives", "manual_data_parallel", "loss_normalization")
PYTEST_GPU_TIER = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "0",
                   "tests/test_gpu.py"]  # fmt: skip


def checks(max_steps: int) -> list[Check]:
    """Every check, the fewest GPUs first."""
    moe = ["--n_experts", "4", "--top_k", "2"]
    hf = ["--hf_config", "llama_tiny"]
    one = [
        *(experiment(name, 1, f"{name}.py") for name in PLAIN),
        experiment("model_parallel", 1, "model_parallel.py", "--device_map", "auto"),
        gpt("train_gpt_float32", 1, {}, ["--mixed_precision", "no"], max_steps),
        gpt("train_gpt_bf16", 1, {}, ["--mixed_precision", "bf16"], max_steps),
        gpt("train_gpt_moe_bf16", 1, {}, [*moe, "--mixed_precision", "bf16"], max_steps),
        gpt("train_gpt_hf_llama_bf16", 1, {}, [*hf, "--mixed_precision", "bf16"], max_steps),
        Check("pytest_gpu_tier", 1, PYTEST_GPU_TIER, writes_summary=False),
    ]
    two = [
        *(experiment(f"{name}_2", 2, f"{name}.py") for name in PLAIN),
        experiment("loss_normalization_fsdp_2", 2, "loss_normalization.py", "--strategy", "fsdp"),
        gpt("train_gpt_ddp", 2, {"dp_replicate": 2}, [], max_steps),
        gpt("train_gpt_fsdp", 2, {"dp_shard": 2}, [], max_steps),
        gpt("train_gpt_zero2", 2, {"dp_shard": 2}, ["--reshard_after_forward", "never"], max_steps),
        gpt("train_gpt_tp2_sp", 2, {"tp": 2}, ["--sequence_parallel"], max_steps),
        gpt("train_gpt_pp2", 2, {"pp": 2}, [], max_steps),
        gpt("train_gpt_ep2", 2, {"ep": 2}, moe, max_steps),
        # a transformers model (docs/your_model.md), under FSDP and by its own tensor-parallel plan
        gpt("train_gpt_hf_fsdp", 2, {"dp_shard": 2}, hf, max_steps),
        gpt("train_gpt_hf_tp2", 2, {"tp": 2}, hf, max_steps),
        Check(
            "train_gpt_cp2",
            2,
            [*launcher(2, "train_gpt.py"), "--report_to", "none", "--cp", "2"],
            expect="refused",
            refusal="--cp 2 on cuda",
        ),
        gpt("deepspeed_zero2", 2, {}, [], max_steps, config=DEEPSPEED),
        fault_tolerance("fault_tolerance_nccl", 2, failures=0),
    ]
    more = [
        fault_tolerance("fault_tolerance_nccl_failure", 3, failures=1),  # the spare takes the third GPU
        gpt("train_gpt_fsdp2_tp2", 4, {"dp_shard": 2, "tp": 2}, [], max_steps),
    ]
    return one + two + more


def visible_gpus() -> tuple[int, str]:
    import torch

    if not torch.accelerator.is_available():
        return 0, "none"
    return torch.accelerator.device_count(), torch.cuda.get_device_name(
        0
    ) if torch.cuda.is_available() else "?"


def profile_for(card: str, asked: str) -> str:
    if asked:
        return asked
    return "a100_80gb" if "A100" in card else "h100_sxm"  # an H100 otherwise: say so in the report


def run_check(check: Check, output_dir: str, timeout_s: float) -> dict:
    from common.processes import TIMED_OUT, run_process_tree

    run_dir = os.path.join(output_dir, check.name)
    command = [*check.command, *(["--output_dir", run_dir, "--overwrite"] if check.writes_summary else [])]
    started = time.monotonic()
    done = run_process_tree(command, timeout_s, cwd=REPO)
    row = {"check": check.name, "gpus": check.gpus, "command": shlex.join(check.command),
           "seconds": round(time.monotonic() - started, 1), "returncode": done.returncode}  # fmt: skip
    if check.expect == "refused":
        refused = done.returncode == 2 and check.refusal in done.stderr
        return {**row, "verdict": "refused as expected" if refused else "NOT REFUSED", "ok": refused}
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if check.writes_summary and os.path.exists(summary_path) else None
    passed = done.returncode == 0 and (summary is None or summary.get("passed", False))
    failed = [n for n, c in (summary or {}).get("checks", {}).items() if not c.get("passed", True)]
    verdict = (
        "passed" if passed else ("TIMED OUT" if done.returncode == TIMED_OUT else f"FAILED {failed or ''}")
    )
    row.update(verdict=verdict, ok=passed)
    if not passed:
        row["stderr_tail"] = done.stderr[-1500:]
    if summary and "step_time_ms" in summary.get("metrics", {}):
        row.update(gpt_figures(summary))
    return row


def gpt_figures(summary: dict) -> dict:
    metrics = summary["metrics"]
    peaks = [held.get("peak_device_bytes") or 0 for held in metrics.get("bytes_per_rank", [])]
    return {"tokens_per_s": metrics.get("tokens_per_s"), "parameters": metrics.get("parameters"),
            "step_ms": sum(metrics["step_time_ms"].values()), "peak_gib": max(peaks, default=0) / 2**30,
            "mixed_precision": summary["config"].get("mixed_precision")}  # fmt: skip


def at_scale_beside(check: Check, row: dict, output_dir: str, hardware: str, timeout_s: float) -> dict:
    """experiments/at_scale.py on the same model and layout (fake ranks, priced on `hardware`)."""
    from common.processes import run_process_tree

    run_dir = os.path.join(output_dir, check.name + ".at_scale")
    degrees = [f"--{dim}={n}" for dim, n in check.gpt_degrees.items()] or ["--world_size", "1"]
    flags = [f for i, f in enumerate(check.gpt_flags)  # precision as it ran (the launch config's, if not given)
             if f != "--mixed_precision" and check.gpt_flags[i - 1 : i] != ["--mixed_precision"]]  # fmt: skip
    # a transformers config is its own model (its vocabulary the tokenizer's, as train_gpt ran it)
    model = ["--vocab_size", str(VOCABULARY)] if "--hf_config" in flags else ["--model", "custom"]
    command = [sys.executable, "experiments/at_scale.py", *model, "--report_to", "none",
               "--per_rank_batch_size", str(PER_RANK_BATCH_SIZE), "--mixed_precision", row["mixed_precision"],
               "--hardware", hardware, *degrees, *flags, "--output_dir", run_dir, "--overwrite"]  # fmt: skip
    done = run_process_tree(command, timeout_s, cwd=REPO)
    path = os.path.join(run_dir, "summary.json")
    if done.returncode != 0 or not os.path.exists(path):
        return {"at_scale": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"}
    metrics = json.load(open(path))["metrics"]
    return {"estimated_peak_gib": max(m["peak_bytes"] for m in metrics["memory"]) / 2**30,
            "predicted_step_ms": 1e3 * metrics["prediction"]["step_s"]}  # fmt: skip


def mfu(row: dict, peak_flops: dict) -> float | None:
    if not row.get("tokens_per_s") or not row.get("parameters"):
        return None
    peak = peak_flops["bf16" if row.get("mixed_precision") == "bf16" else "fp32"]
    return 6 * row["parameters"] * row["tokens_per_s"] / (peak * row["gpus"])


def report(rows: list[dict], card: str, gpus: int, hardware: str, output_dir: str) -> str:
    def figure(value, form):
        return "" if value is None else format(value, form)

    lines = [f"# GPU check: {gpus} x {card}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"MFU: 6 x parameters x tokens/s against {hardware}'s peak; PREDICTED: experiments/at_scale.py on the "
             "same model and layout, fake ranks.", "",
             "| check | GPUs | verdict | tokens/s | MFU | peak GiB measured | peak GiB estimated | step ms measured | "
             "step ms PREDICTED | s |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['check']} | {r['gpus']} | {r['verdict']} | {figure(r.get('tokens_per_s'), ',.0f')} | "
                     f"{figure(r.get('mfu'), '.1%')} | {figure(r.get('peak_gib'), '.3f')} | "
                     f"{figure(r.get('estimated_peak_gib'), '.3f')} | {figure(r.get('step_ms'), '.1f')} | "
                     f"{figure(r.get('predicted_step_ms'), '.1f')} | {r['seconds']} |")  # fmt: skip
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        lines += ["", "Not run (too few GPUs): " + ", ".join(f"{r['check']} ({r['gpus']})" for r in skipped)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(output_dir, "gpu_check.md"), "w") as handle:
        handle.write(text)
    with open(os.path.join(output_dir, "gpu_check.json"), "w") as handle:
        json.dump({"card": card, "gpus": gpus, "hardware": hardware, "rows": rows}, handle, indent=1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry_run", action="store_true", help="print every command (and what each needs), run none"
    )
    parser.add_argument(
        "--output_dir", default=os.path.join(REPO, "runs", "gpu_check"), help="where runs and report go"
    )
    parser.add_argument("--max_steps", type=int, default=100, help="train_gpt's steps in each of its checks")
    parser.add_argument(
        "--only", default="", help="comma-separated check names (default: every check that fits)"
    )
    parser.add_argument(
        "--hardware", default="", help="planning/hardware.yaml profile (default: by the card's name)"
    )
    parser.add_argument(
        "--timeout_s", type=float, default=600, help="each command's limit; its process tree is ended"
    )
    args = parser.parse_args(argv)
    if args.max_steps < 10:
        parser.error(f"--max_steps must be >= 10 (parity steps and a steady state), got {args.max_steps}")
    every = checks(args.max_steps)
    names = [n for n in args.only.replace(" ", "").split(",") if n]
    unknown = sorted(set(names) - {c.name for c in every})
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such check; known: {', '.join(c.name for c in every)}")
    chosen = [c for c in every if not names or c.name in names]
    if args.dry_run:
        for check in chosen:
            suffix = (
                f" --output_dir {shlex.quote(os.path.join(args.output_dir, check.name))}"
                * check.writes_summary
            )
            print(
                f"[{check.gpus} GPU{'s' * (check.gpus > 1)}] {check.name}: {shlex.join(check.command)}{suffix}"
            )
        return 0
    gpus, card = visible_gpus()
    if gpus == 0:
        print("gpu_check: no GPU visible to torch (torch.accelerator.is_available() is False); --dry_run lists the "
              "commands", file=sys.stderr)  # fmt: skip
        return 2
    sys.path.insert(0, REPO)
    from planning.hardware import load_hardware

    hardware = profile_for(card, args.hardware)
    peak_flops = load_hardware(hardware).peak_flops
    os.makedirs(args.output_dir, exist_ok=True)
    rows = []
    for check in chosen:
        if check.gpus > gpus:
            rows.append({"check": check.name, "gpus": check.gpus, "verdict": "not run", "skipped": True,
                         "ok": True, "seconds": 0})  # fmt: skip
            continue
        print(f"gpu_check: {check.name} ({check.gpus} GPU{'s' * (check.gpus > 1)})", flush=True)
        row = run_check(check, args.output_dir, args.timeout_s)
        if "step_ms" in row:
            row["mfu"] = mfu(row, peak_flops)
            if check.gpt_degrees is not None:
                row.update(at_scale_beside(check, row, args.output_dir, hardware, args.timeout_s))
        rows.append(row)
        print(f"gpu_check: {check.name}: {row['verdict']} ({row['seconds']} s)", flush=True)
    print(report(rows, card, gpus, hardware, args.output_dir))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
