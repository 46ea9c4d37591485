"""The step-time predictor (planning/cost_model.py) against steps this machine really runs: train 9 layouts, record
the ops each layout's ranks run (fake ranks: the real code on fake tensors), time those ops here, predict each
step from its recorded ops and its collectives, compare.

    python -m benchmarks.at_scale_calibration                # 9 layouts x 5 rounds, the op model: ~15 min
    python -m benchmarks.at_scale_calibration --quick        # a tiny GPT, 12 steps, 1 round: checks the figures are made
    python -m benchmarks.at_scale_calibration --no_layouts_of_4 --layouts dp_shard=4,tp=2:cp=2 \
        --model_flags "--n_layer 6 --d_model 192 --n_head 6"    # held out: layouts and a shape it was not fitted on

1. Each layout's run: train_gpt through `accelerate launch`, one thread per rank: ddp, zero2, fsdp, tp, pp, cp on
   2 ranks, dp_shard x tp, tp x pp, pp x dp_shard on 4; its median step (forward + backward + optimizer) and the
   collectives it counted (calls per kind). The layouts run round-robin, --rounds times (5): this VM's speed drifts
   (the same one-process step took 7.6 ms of forward in one run and 15 ms in the next, minutes apart; a layout's
   step 17-39 % apart between two calibrations, measured), so each layout's step is the median of its rounds,
   and the table shows their range. Five, not three: with nothing else running, a whole round here still ran
   up to 15 % slow or 18 % fast against the others (the VM's phases last minutes; its steal time stayed under
   0.1 %), and three rounds' median put ddp at 0.86 in one run of four and 0.93-0.96 in the other three.
2. The profile, measured after each round's runs, nothing else running, each figure the median of the rounds'
   (a figure measured once moved by up to 2x between measurements minutes apart: tp's redistribute 207-470 us,
   gloo's all-reduce latency 894-1,628 us): one thread's matmul peak and copy bandwidth;
   gloo's collectives on 2 ranks as a step issues them (each after some compute: back to back they are up to 4x
   faster here), their mean time fitted per kind as latency + bytes / bandwidth, and again on 4 ranks in pairs
   (the 4-rank layouts' case: 2 ranks a core), each call with a new partner (and a pipeline's send and receive)
   and each with its last call's; and the op model
   (benchmarks/op_costs.py): every op the layouts' fake ranks recorded, timed at its own shapes in two processes
   at once (two ranks on two cores), what a one-process step costs beyond its ops (per op, forward and backward;
   per optimizer step), a redistribute's Python, a DTensor op's (forward, backward, and per DTensor an optimizer
   step takes), FSDP's hooks per unshard and reduce-scatter, cp's attention per functional collective it calls,
   and what two processes sharing a core cost.
3. The prediction of each step: predict_step on the run's layout, workload and flags, its recorded ops priced by
   the op model, its counted collectives by the fit; a layout of more ranks than cores has its compute slowed
   by ranks / cores and by what sharing a core costs beyond that, its pipeline's sends in the cores' work, and a
   rank waiting in a pipeline's bubble lends its core to another stage's rank. Nothing of a run's measured time
   enters its prediction.
4. Other work on the machine: the share of the cores processes other than the calibration and its launches used
   during each run (/proc/stat, less their CPU time); the table shows each layout's most over its rounds and warns when
   a run, or the profile's measurement, shared the cores with over 5 % of other work: such a timing reads slow
   (calibrations run while other work ran here spread a 4-rank layout's rounds by up to a third; alone, by up to
   11 %). It warns too when a layout's rounds are over 1.5x apart with no other work to blame: the VM's own slow,
   erratic phases (one run here: ddp's rounds 25-61 ms), which the profile follows less than the runs.
Writes <output_dir>/<UTC time>/: calibration.md (the table docs/at_scale.md shows), calibration.json (rows
{layout, ranks, measured_step_s, predicted_step_s}), this_machine.yaml and this_machine_ops.json (the profile
planning/hardware.yaml keeps, pasted by hand, with this command), this_machine_rounds.json (each round's
profile), and every run's folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import yaml

from benchmarks import compare_strategies, kernel_costs, mfu, op_costs, overhead_costs
from benchmarks.workers import (
    benchmark_parser,
    command_line,
    cpu_clock,
    dated_folder,
    others_share,
    write_table,
)
from common.gpt import GPT, GPTConfig
from planning.cost_model import predict_step
from planning.fake_ranks import run_ranks
from planning.hardware import hardware_from
from strategies.args import PRESETS
from strategies.layout import Layout, Workload
from strategies.theory import stage_theories

STRATEGIES = ("ddp", "zero2", "fsdp", "tp", "pp", "cp")
LAYOUTS_OF_4 = ({"dp_shard": 2, "tp": 2}, {"tp": 2, "pp": 2}, {"pp": 2, "dp_shard": 2})
CORES = os.cpu_count() or 1


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


def load_run(summary: dict):
    """A finished train_gpt run's own config (train_gpt's Config), layout and workload (the corpus's vocabulary)."""
    from experiments.train_gpt import Config

    config, metrics = summary["config"], summary["metrics"]
    names = {f.name for f in dataclasses.fields(Config)}
    cfg = Config(**{k: v for k, v in config.items() if k in names})
    model = GPTConfig(**{**GPTConfig().__dict__, **{k: config[k] for k in GPTConfig().__dict__ if k in config},
                         "vocab_size": metrics["corpus"]["vocab_size"]})  # fmt: skip
    work = Workload(
        model, config["per_rank_batch_size"], config["gradient_accumulation_steps"], config["mixed_precision"]
    )
    return cfg, Layout(**metrics["layout"]), work


def trace(summary: dict) -> list[dict]:
    """The first rank of each pipeline stage of the run's layout, run on fake ranks: the ops it records."""
    cfg, layout, work = load_run(summary)
    return run_ranks(cfg, layout, work, sorted({layout.rank_at(pp=s) for s in range(layout.pp)}), False)


def measure_profile(traced: list[dict], work: Workload, args) -> tuple[dict, dict]:
    """this_machine's profile, measured now (the module docstring, step 2), and its table of timed ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what each rank gets
    try:
        peak = mfu.gemm_flops_per_s(2048, 2048, 2048, torch.float32, 0.5 if args.quick else 2.0)
    finally:
        torch.set_num_threads(threads)
    spec = {**kernel_costs.shapes_of(traced), "budget_s": 0.05 if args.quick else 0.2,
            "model_shape": {k: getattr(work.model, k) for k in GPTConfig().__dict__}, "rows": work.rows}  # fmt: skip
    fitted, ops, fitted_shared = op_costs.measure_this_machine(spec)
    link = {"bandwidth_gbps": fitted["all_reduce"]["bandwidth_gbps"],
            "latency_us": round(fitted["all_reduce"]["latency_us"] / 2)}  # fmt: skip
    measured_ops = ops.pop("measured_ops")
    profile = {
        "description": "this machine, one thread per rank, gloo over shared memory; measured by "
        f"`python -m benchmarks.at_scale_calibration` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "peak_tflops": {"fp32": round(peak / 1e12, 5), "bf16": round(peak / 1e12, 5)},
        "memory_gb": 24,
        "memory_bandwidth_gbps": round(copy_gbps(), 2),
        "gpus_per_node": 2,
        "cores": CORES,
        "intra_node": link,  # what a ring step model would use; the fits below replace it per kind
        "inter_node": link,
        "overlaps_communication": False,
        "fitted": fitted,
        "fitted_shared": fitted_shared.get("switching"),
        "fitted_shared_same_group": fitted_shared.get("same_group"),
        "fitted_shared_groups": {4: fitted_shared["group_of_4"]} if fitted_shared.get("group_of_4") else None,
        "ops": {**ops, "measured_ops": "this_machine_ops.json"},
    }
    return profile, measured_ops


def median_of(measured: list):
    """Several rounds' measurements of one profile (or op table) as one: each number their median (a number
    every round measured alike, a shape or a size, as it is); lists of points matched by position."""
    first = measured[0]
    if isinstance(first, dict):
        return {
            key: median_of([m[key] for m in measured]) for key in first if all(key in m for m in measured)
        }
    if isinstance(first, list) and first and isinstance(first[0], dict):
        return [median_of([m[i] for m in measured]) for i in range(min(len(m) for m in measured))]
    if isinstance(first, (int, float)) and not isinstance(first, bool) and any(m != first for m in measured):
        return round(statistics.median(measured), 5)
    return first


def predicted_ms(summary: dict, traced: list[dict], hardware) -> dict:
    """The predictor's step for a finished train_gpt run: its recorded ops and its counted calls."""
    cfg, layout, work = load_run(summary)
    with torch.device("meta"):
        reference = GPT(work.model)
    calls = summary["metrics"].get("communication", {}).get("counted", {}).get("calls", {})
    prediction = predict_step(
        stage_theories(reference, layout, cfg, work), layout, cfg, work, hardware, calls, traced
    )
    return {
        "step_ms": 1000 * prediction["step_s"],
        "terms_ms": {k: 1000 * v for k, v in prediction["terms_s"].items()},
    }


def runs_of(strategies: list[str], with_layouts_of_4: bool, layouts: list, model_flags: list[str]) -> list:
    """The presets, the three 4-rank layouts, and any others (--layouts), each with the model flags given."""
    runs = [compare_strategies.Run(name, ["--strategy", name], PRESETS[name].ranks, PRESETS[name].launch_config)
            for name in strategies]  # fmt: skip
    runs += [compare_strategies.layout_run(Layout(**degrees), degrees)
             for degrees in (LAYOUTS_OF_4 if with_layouts_of_4 else ())]  # fmt: skip
    return [dataclasses.replace(run, flags=[*run.flags, *model_flags]) for run in [*runs, *layouts]]


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="presets to run, 2 ranks each")
    parser.add_argument("--no_layouts_of_4", action="store_true", help="leave out the three 4-rank layouts")
    parser.add_argument("--layouts", default="", help="more layouts to run (a held-out check: the predictor was not "
                        "fitted on them), as compare_strategies takes them: dp_shard=4,tp=2:cp=2 (comma between "
                        "layouts, ':' between degrees)")  # fmt: skip
    parser.add_argument("--model_flags", default="", help="train_gpt's model flags for every run, one string (a "
                        "held-out shape: '--n_layer 6 --d_model 192 --n_head 6'); after --quick's own")  # fmt: skip
    parser.add_argument(
        "--max_steps", type=int, default=40, help="steps per run (the median step is compared)"
    )
    parser.add_argument(
        "--output_dir", default="runs/at_scale_calibration", help="a new dated folder is made in it"
    )
    parser.add_argument("--timeout_s", type=float, default=1200, help="per run")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs of each layout, round-robin (this VM's speed drifts by tens of percent within "
                             "minutes: the median is compared and the spread shown); default 5, 1 with --quick")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in PRESETS]
    if unknown:
        parser.error(f"--strategies: {unknown} not among {', '.join(PRESETS)}")
    folder = dated_folder(args.output_dir, "at_scale_calibration")
    if folder is None:
        return 2
    # (the model flags are in each run's own flags: runs_of)
    run_args = SimpleNamespace(
        quick=args.quick, max_steps=args.max_steps, profile_steps=0, timeout_s=args.timeout_s, model_flags=[]
    )
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    model_flags = compare_strategies.model_flags(
        args.model_flags, args.quick, "at_scale_calibration --model_flags"
    )
    layouts = compare_strategies.layout_runs(args.layouts, parser.error)
    runs, finished, rows = runs_of(strategies, not args.no_layouts_of_4, layouts, model_flags), [], []
    steps_s: dict[str, list[float]] = {run.label: [] for run in runs}  # each round's median step
    # the share of the cores other processes used during each round's run (a disturbed timing reads slow)
    others: dict[str, list[float | None]] = {run.label: [] for run in runs}
    traced, profiles, profile_others = [], [], []
    for round_ in range(args.rounds):
        for run in runs:
            if round_ and not steps_s[run.label]:
                continue  # it failed in the first round
            print(f"round {round_ + 1}/{args.rounds}: {run.label} on {run.ranks} ranks ...", flush=True)
            name = run.label.replace(" ", "_") + (f"_round{round_ + 1}" if round_ else "")
            before = cpu_clock()
            summary = compare_strategies.run_strategy(run, folder / name, run_args)
            others[run.label].append(others_share(before, cpu_clock()))
            if "error" in summary:
                rows.append({"layout": run.label, "error": summary["error"]})
                continue
            steps_s[run.label].append(sum(summary["metrics"]["step_time_ms"].values()) / 1000)
            if not round_:
                finished.append((run, summary))
        if not round_:
            print("recording each layout's ops on fake ranks ...", flush=True)
            traced = [trace(summary) for _, summary in finished]
            work = load_run(finished[0][1])[2] if finished else Workload(GPTConfig(), 1, 1, "no")
        print(f"round {round_ + 1}/{args.rounds}: measuring this machine: its matmul peak, gloo, the recorded ops ...",
              flush=True)  # fmt: skip
        before = cpu_clock()
        profiles.append(measure_profile([r for ranks in traced for r in ranks], work, args))
        profile_others.append(others_share(before, cpu_clock()))
    profile, measured_ops = median_of([p for p, _ in profiles]), median_of([ops for _, ops in profiles])
    profile["description"] += f"; each figure the median of {len(profiles)} rounds"
    # the step beyond its ops fitted from the rounds' median points (each figure's own median need not go through
    # the points of any round); each round's profile kept beside it
    profile["ops"]["eager_gaps"] = overhead_costs.gaps_of(profile["ops"]["eager_gaps"].pop("points"))
    (folder / "this_machine_rounds.json").write_text(json.dumps([p for p, _ in profiles], indent=1))
    (folder / "this_machine.yaml").write_text(yaml.safe_dump({"this_machine": profile}, sort_keys=False))
    (folder / "this_machine_ops.json").write_text(json.dumps(measured_ops, indent=0))
    hardware = hardware_from(
        "this_machine", {**profile, "ops": {**profile["ops"], "measured_ops": measured_ops}}
    )
    for (run, summary), ranks in zip(finished, traced, strict=False):
        measured = statistics.median(steps_s[run.label])
        predicted = predicted_ms(summary, ranks, hardware)
        layout = Layout(**summary["metrics"]["layout"])
        rows.append({"layout": run.label, "described": layout.describe(), "ranks": layout.world_size,
                     "measured_step_s": measured, "measured_rounds_s": steps_s[run.label],
                     "others_share_rounds": others[run.label], "predicted_step_s": predicted["step_ms"] / 1000,
                     "ratio": predicted["step_ms"] / 1000 / measured, "terms_ms": predicted["terms_ms"]})  # fmt: skip
    command = command_line("benchmarks.at_scale_calibration", argv)
    table = markdown(rows, profile, command.strip(), profile_others)
    write_table(folder, "calibration", table, rows,
                also=", this_machine.yaml, this_machine_ops.json, this_machine_rounds.json")  # fmt: skip
    return 0 if all("error" not in r for r in rows) else 1


BUSY = 0.05  # a run during which other processes used more of the cores than this is flagged
UNSTEADY = 1.5  # a layout whose slowest round took more than this times its fastest is flagged


def percent(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.0f} %"


def markdown(rows: list[dict], profile: dict, command: str, profile_others: list | None = None) -> str:
    fit = lambda fits: ", ".join(f"{kind} {f['latency_us']} us + bytes / {f['bandwidth_gbps']} GB/s"  # noqa: E731
                                 for kind, f in fits.items())  # fmt: skip
    fitted = fit(profile["fitted"])
    if profile.get("fitted_shared"):
        fitted += f"; on 4 ranks (pairs, the 2 cores shared), a new partner: {fit(profile['fitted_shared'])}"
    if profile.get("fitted_shared_same_group"):
        fitted += f"; the last call's partner: {fit(profile['fitted_shared_same_group'])}"
    for size, fits in (profile.get("fitted_shared_groups") or {}).items():
        fitted += f"; over all {size} ranks: {fit(fits)}"
    ops = profile["ops"]
    gaps, dtensor = ops["eager_gaps"], ops["dtensor_gaps"]
    lines = [
        f"`{command}`",
        "",
        f"this_machine: matmul peak {profile['peak_tflops']['fp32'] * 1000:.1f} GFLOP/s (one thread, float32), "
        f"copy {profile['memory_bandwidth_gbps']} GB/s; gloo on 2 ranks after compute: {fitted}; per op "
        f"dispatched {ops['op_overhead_us']} us; a DTensor op beyond its local op: {dtensor['forward_us_per_op']} us "
        f"forward, {dtensor['backward_us_per_op']} backward, {dtensor['step_us_per_tensor']} us a DTensor an optimizer "
        f"step takes; a redistribute "
        f"{ops.get('redistribute_overhead_us', 0)} us beyond its collective, FSDP's hooks "
        f"{ops.get('fsdp_overhead_us', 0)} us an unshard or reduce-scatter, cp's attention "
        f"{ops.get('functional_collective_overhead_us', 0)} us a functional collective; a step beyond "
        f"its ops: {gaps['forward_us_per_op']} us an op and {gaps.get('forward_us_per_mb', 0)} us a MB its ops move "
        f"forward, {gaps['backward_us_per_op']} and {gaps.get('backward_us_per_mb', 0)} backward, {gaps['step_us']} "
        f"us an optimizer step; two processes on one core: a step {ops.get('shared_core_ratio', 2.0)}x one alone's",
        "",
        "| layout | ranks | measured step ms (median of rounds; range) | cores other processes used (most of "
        "rounds) | PREDICTED step ms | predicted / measured | predicted terms, ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | – | {r['error']} | – | – | – | – |")
            continue
        terms = ", ".join(
            f"{k} {v:.1f}" for k, v in r["terms_ms"].items() if v >= 0.05 and k != "data_parallel_total"
        )
        spread = r.get("measured_rounds_s") or [r["measured_step_s"]]
        shares = [x for x in r.get("others_share_rounds", []) if x is not None]
        lines.append(f"| {r['layout']} | {r['ranks']} | {1000 * r['measured_step_s']:.1f} "
                     f"({1000 * min(spread):.0f}-{1000 * max(spread):.0f}) | {percent(max(shares, default=None))} | "
                     f"{1000 * r['predicted_step_s']:.1f} | {r['ratio']:.2f} | {terms} |")  # fmt: skip
    done = [r for r in rows if "ratio" in r]
    if done:
        order = lambda key: ", ".join(r["layout"] for r in sorted(done, key=lambda r: r[key]))  # noqa: E731
        ratios = [r["ratio"] for r in done]
        within = sum(0.9 <= x <= 1.1 for x in ratios)
        lines += ["", f"predicted / measured: {min(ratios):.2f}-{max(ratios):.2f} ({within} of {len(ratios)} within "
                  f"0.9-1.1); order by measured step: {order('measured_step_s')}; by predicted: "
                  f"{order('predicted_step_s')}"]  # fmt: skip
    busy = [r["layout"] for r in done if any((x or 0) > BUSY for x in r.get("others_share_rounds", []))]
    measured = [x for x in profile_others or [] if x is not None]
    if busy or any(x > BUSY for x in measured):
        lines += ["", f"WARNING: other processes used over {percent(BUSY)} of the cores while "
                  + (f"{', '.join(busy)} ran" if busy else "the profile was measured")
                  + f" (the profile's rounds: {', '.join(percent(x) for x in measured)}): a timing taken beside "
                  "other work reads slow; run it again with nothing else running"]  # fmt: skip
    # the VM's own phases (no other process: the column says so) can slow a whole round; rounds of one layout this
    # far apart (alone here: up to 1.3x; in a slow, erratic phase 1.6-2.4x) make a median that no profile matches
    unsteady = [r["layout"] for r in done if len(r.get("measured_rounds_s") or []) > 1
                and max(r["measured_rounds_s"]) > UNSTEADY * min(r["measured_rounds_s"])]  # fmt: skip
    if unsteady:
        lines += ["", f"WARNING: the rounds of {', '.join(unsteady)} are over {UNSTEADY}x apart: this machine's speed "
                  "moved while it ran, more than its profile follows; run it again"]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
