"""benchmarks/mfu.py: the FLOPs per token by formula and by FlopCounterMode differ by exactly what the
counter leaves out; the peak is measured; MFU is achieved FLOP/s over the peak of the cores the ranks had."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.mfu import MODEL, PER_RANK_BATCH, flops_per_token_counted, flops_per_token_formula, main
from common.gpt import GPTConfig, build_gpt


def test_counted_flops_are_the_formula_without_attention_and_non_matrix_parameters():
    formula = flops_per_token_formula(MODEL)
    counted = flops_per_token_counted(MODEL, PER_RANK_BATCH)
    gpt = build_gpt(GPTConfig(**MODEL), 0)
    # parameters in the formula's N that multiply nothing: biases and LayerNorms (vectors)
    vectors = sum(p.numel() for name, p in gpt.named_parameters() if p.dim() == 1)
    assert formula["attention"] == 12 * MODEL["n_layer"] * MODEL["block_size"] * MODEL["d_model"]
    assert counted == formula["total"] - formula["attention"] - 6 * vectors  # to the FLOP


@pytest.mark.launch  # times GEMMs for seconds: the slow tier
def test_quick_run_writes_peaks_and_mfu(tmp_path, capsys):
    comparison = tmp_path / "comparison.json"
    rows = [{"strategy": "none", "ranks": 1, "tokens_per_s": 1000.0}, {"strategy": "ddp", "ranks": 2,
            "tokens_per_s": 1500.0}, {"strategy": "tp", "error": "timed out"}]  # fmt: skip
    comparison.write_text(json.dumps(rows))
    output = tmp_path / "mfu.json"
    assert main(["--quick", "--comparison", str(comparison), "--output", str(output)]) == 0
    figures = json.loads(output.read_text())
    peak = figures["peak_flops_per_s_one_thread"]["float32"]["square_gemm"]
    assert peak > 1e8  # any CPU of the last 20 years does 0.1 GFLOP/s on one thread
    flops = figures["flops_per_token"]["formula"]["total"]
    none, ddp = figures["mfu"]  # the failed run is left out
    assert none["mfu_square"] == pytest.approx(1000.0 * flops / peak)
    cores = min(2, os.cpu_count())  # two ranks get two cores where there are two
    assert ddp["cores"] == cores and ddp["mfu_square"] == pytest.approx(1500.0 * flops / (cores * peak))


def test_an_existing_output_is_refused(tmp_path, capsys):
    existing = tmp_path / "mfu.json"
    existing.write_text("keep")
    with pytest.raises(SystemExit) as exit_info:
        main(["--quick", "--output", str(existing)])
    assert exit_info.value.code == 2 and existing.read_text() == "keep"
