"""What a newcomer runs must be true (issue #40), each shown here failing without its fix: the cost model prices
every collective any preset sends (performance --quick crashed on pp's send), compare_strategies and the MFU
table count a layout's every rank (cp's were lost), no float flag of any experiment or tool takes nan or inf,
a sweep's refused trial is one line, and under `accelerate launch` a refusal is the first line, said once.
(The final step checkpointed and the converter's formats: tests/test_faults.py.)"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import os

import pytest

from benchmarks import compare_strategies, mfu, performance
from common.collective_bench import BENCH_OPS
from common.gpt import GPTConfig, build_gpt
from helpers import CPU_DDP, REPO, launch
from strategies import deepspeed
from strategies.args import PRESETS, ParallelArgs
from strategies.layout import Layout, Workload
from strategies.theory import sent_bytes

MODEL = build_gpt(GPTConfig(), 0)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_cost_model_prices_every_collective_every_preset_sends(preset):
    """The registry walked: what each preset's theory sends on its ranks, kind by kind, has a bench op the cost
    model fits (pp's send and recv had none: `performance --quick` ended in KeyError 'send')."""
    work = Workload(GPTConfig(), 4)
    if preset.startswith("deepspeed"):
        kinds = set(deepspeed.sent_bytes(MODEL, Layout(dp_shard=2), int(preset[-1]), work)["by_kind"])
    else:
        args = ParallelArgs(strategy=preset)
        layout = args.resolve_layout(PRESETS[preset].ranks)
        kinds = {
            k
            for rank in range(layout.world_size)
            for k in sent_bytes(MODEL, layout, rank, args, work)["by_kind"]
        }
    assert kinds <= set(performance.BENCH_OP), kinds - set(performance.BENCH_OP)
    assert set(performance.BENCH_OP.values()) <= set(BENCH_OPS)
    fits = {op: {"alpha_us": 100.0, "ns_per_byte": 1.0} for op in BENCH_OPS}
    assert (
        performance.predicted_ms(dict.fromkeys(kinds, 1), dict.fromkeys(kinds, 1000), fits) > 0 or not kinds
    )


def test_a_layout_counts_every_rank_in_the_tables():
    """cp's ranks were reported as '1 x 1' and the MFU table divided by one core's peak although 2 ranks ran."""
    summary = {"metrics": {"layout": Layout(cp=2).degrees(), "bytes_per_rank": [{"params": 1, "grads": 1, "optimizer": 1}],
                           "tokens_per_s": 1000.0, "step_time_ms": {"forward": 1.0}},
               "config": {"strategy": "cp", "per_rank_batch_size": 4, "block_size": 64, "gradient_accumulation_steps": 1},
               "checks": {"distributed": {"passed": True, "detail": ""}}, "passed": True}  # fmt: skip
    row = compare_strategies.row(summary)
    assert (row["ranks"], row["layout"]) == (2, "cp 2")
    (mfu_row,) = mfu.mfu_rows([row], {"square_gemm": 1e9, "model_shapes": 1e9}, 1e6)
    assert mfu_row["cores"] == min(2, os.cpu_count())


def every_config() -> list[tuple[str, type]]:
    """(program, its Config) for every experiment and the sweep tool."""
    configs = []
    for path in sorted(glob.glob(str(REPO / "experiments" / "*.py"))):
        name = os.path.basename(path)[:-3]
        configs.append((name, importlib.import_module(f"experiments.{name}").Config))
    configs.append(("tools.sweep", importlib.import_module("tools.sweep").SweepArgs))
    return configs


@pytest.mark.parametrize(("program", "config"), every_config(), ids=[p for p, _ in every_config()])
def test_no_float_flag_takes_nan_or_inf(program, config, capsys):
    from common.config import parse_config

    floats = [f.name for f in dataclasses.fields(config) if f.type in (float, "float")]
    assert floats, program
    for name in floats:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(SystemExit) as refused:
                parse_config(config, [f"--{name}={value}"])
            said = capsys.readouterr().err
            assert refused.value.code == 2 and f"must be a finite number, got '{value}'" in said, (name, said)
            assert said.strip().count("\n") == 0


def test_a_refused_sweep_trial_is_one_line(tmp_path, capsys):
    import yaml

    from helpers import run_main_in_process
    from tools.sweep import main

    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"program": "experiments/ddp_linear.py", "method": "grid",
                                     "metric": {"name": "final_mse", "goal": "minimize"},
                                     "parameters": {"lr": {"values": [0.1, -1]}}}))  # fmt: skip
    code, stderr = run_main_in_process(main, [str(sweep), "--output_dir", str(tmp_path / "out")], capsys)
    assert code == 2 and stderr.strip().count("\n") == 0, stderr
    assert (
        "a trial may run with lr=-1 on 1 rank(s), which experiments/ddp_linear.py refuses: --lr must be > 0"
        in stderr
    )


@pytest.mark.launch
def test_under_accelerate_launch_the_refusal_is_the_first_line_and_said_once(tmp_path):
    finished = launch("ddp_linear.py", ["--lr", "-1"], tmp_path / "run", config=CPU_DDP)
    lines = finished.stderr.splitlines()
    assert finished.returncode == 1  # the launcher's own code whenever a rank did not exit 0
    assert lines[0] == "ddp_linear.py: error: --lr must be > 0, got -1.0 (see --help)", lines[:3]
    assert sum("--lr must be > 0" in line for line in lines) == 1 and "exitcode: 2" in finished.stderr
