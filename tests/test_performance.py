"""benchmarks/performance.py, the one command of the performance figures, for real in --quick mode (tp
profiled on 2 ranks, one round of the ddp overhead comparison; its launches' ranks forked, helpers.fork_the_launches);
its cost-model arithmetic on known numbers. Also the tp run itself: every check passed, bytes held and sent as the
theory says (tp's correct run in this suite)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.performance import fit_alpha_beta, main, predicted_ms
from helpers import GPT_DISTRIBUTED_CHECKS, fork_the_launches, parse_launch


def test_the_fit_recovers_a_known_latency_and_bandwidth():
    rows = [{"op": "all_reduce", "bytes": s, "time_us": 50 + s / 2e3} for s in (1024, 65536, 2**20, 2**24)]
    fit = fit_alpha_beta(rows)["all_reduce"]  # 50 µs + bytes / (2 GB/s)
    assert fit["alpha_us"] == pytest.approx(50) and fit["bandwidth_gbps"] == pytest.approx(2)
    assert fit["worst_relative_error"] < 1e-9
    calls, sizes = {"all_reduce": 3}, {"all_reduce": 2 * 10**6}
    assert predicted_ms(calls, sizes, fit_alpha_beta(rows)) == pytest.approx(3 * 0.05 + 1.0)


def test_neither_term_is_fitted_negative():
    rows = [{"op": "all_gather_into_tensor", "bytes": s, "time_us": t} for s, t in ((1000, 1.0), (2000, 3.0))]
    fit = fit_alpha_beta(rows)["all_gather_into_tensor"]  # a line through them would cross 0 below 500 bytes
    assert fit["alpha_us"] == 0 and fit["bandwidth_gbps"] > 0
    rows = [{"op": "all_reduce", "bytes": s, "time_us": t} for s, t in ((1000, 3.0), (2000, 1.0))]
    fit = fit_alpha_beta(rows)["all_reduce"]  # times falling with size: noise, no bandwidth term
    assert fit["ns_per_byte"] == 0 and fit["bandwidth_gbps"] is None and 1.0 < fit["alpha_us"] < 3.0


@pytest.mark.launch
def test_one_command_writes_peak_mfu_breakdown_cost_model_overhead_and_traces(tmp_path, capsys, monkeypatch):
    forked = fork_the_launches(monkeypatch)
    args = ["--quick", "--strategies", "tp", "--overhead_strategies", "ddp", "--overhead_rounds", "1"]
    assert main([*args, "--output_dir", str(tmp_path)]) == 0
    # the collectives bench, tp's run and train_gpt's ddp (accelerate launch), bare PyTorch twice (torchrun)
    scripts = [Path(parse_launch(command)[0]).name for command in forked]
    assert sorted(scripts) == sorted(
        ["collectives_bench.py", "train_gpt.py", "bare_gpt.py", "bare_gpt.py", "train_gpt.py"]
    ), scripts
    (folder,) = tmp_path.iterdir()
    report = json.loads((folder / "performance.json").read_text())
    assert report["peak"]["peak_flops_per_s_one_thread"]["float32"]["square_gemm"] > 1e8
    assert [r["strategy"] for r in report["mfu"]] == ["tp"] and 0 < report["mfu"][0]["mfu_model_shapes"] < 1
    fits = report["cost_model"]["fits"]
    # every op a preset's step sends, a pipeline's sends and receives included
    assert set(fits) == {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                         "all_to_all_single", "send_recv"}  # fmt: skip
    assert all(f["alpha_us"] >= 0 and f["ns_per_byte"] >= 0 for f in fits.values())
    tp = report["cost_model"]["strategies"]["tp"]
    assert tp["calls"] == {"all_reduce": 10, "all_gather": 1} and tp["predicted_ms"] > 0
    # the traces hold the same collectives the counter saw (10 + 1), plus clipping's norm all-reduce
    traced = tp["traced"]
    assert traced["calls_per_step"] == 12 and 0 <= traced["waiting_ms"] < traced["spans_ms"]
    assert traced["waiting_ms"] + traced["after_arrival_ms"] == pytest.approx(traced["spans_ms"])
    assert 0 < report["mfu"][0]["mfu_median_step_model_shapes"] < 1
    b = report["breakdown"]["tp"]
    parts = b["compute_ms"] + b["communication_ms"] - b["overlapped_ms"] + b["idle_ms"]
    assert parts == pytest.approx(b["step_ms"], rel=1e-6) and b["communication_ms"] > 0
    ddp = report["overhead"]["ddp"]
    assert all(len(values) == 1 and values[0] > 0 for values in ddp["runs"].values()) and ddp["ratio"] > 0
    table = (folder / "performance.md").read_text()
    assert "| tp |" in table and "| ddp |" in table and "noise floor" in table
    assert (folder / "timelines.png").read_bytes()[:4] == b"\x89PNG"

    # compare_strategies' table, plot and rows, and tp's run with its traces
    (strategies,) = (folder / "strategies").iterdir()
    assert (strategies / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert (
        sum(line.startswith("| tp |") for line in (strategies / "comparison.md").read_text().splitlines())
        == 1
    )
    profile = strategies / "tp" / "profile"
    assert {p.name for p in profile.iterdir()} == {"rank0.json", "rank1.json", "timeline.png"}
    summary = json.loads((strategies / "tp" / "summary.json").read_text())
    assert summary["passed"] and set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    metrics = summary["metrics"]
    assert {dim: n for dim, n in metrics["layout"].items() if n > 1} == {"tp": 2}
    held, full = metrics["bytes_per_rank"], 4 * metrics["parameters"]
    # matrices and the vocabulary split in two, LayerNorms, position embedding and row-parallel biases not
    assert all(full // 2 < h["params"] == held[0]["params"] < full * 0.6 for h in held)
    counted = metrics["communication"]["counted"]
    activations = 4 * 32 * 32 * 4  # per-rank batch 4 x context 32 x d_model 32, float32
    assert counted["calls"] == {"all_reduce": 4 * 2 + 2, "all_gather": 1}  # n_layer 2
    assert counted["bytes"] == {"all_reduce": 10 * activations, "all_gather": 4 * 32 * 512 * 4}  # the logits


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "ddp,zero4"], "unknown strategies ['zero4']"),
        (["--overhead_strategies", "tp"], "unknown strategies ['tp']"),
        (["--profile_steps", "99"], "--profile_steps in 1..--max_steps - 16"),
    ],
)
def test_bad_input_is_refused_before_any_run(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
