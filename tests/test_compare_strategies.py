"""benchmarks/compare_strategies.py for real: it launches train_gpt per strategy and writes one table,
one PNG and the rows as JSON in a new folder, with the counted communication equal to the theory."""

from __future__ import annotations

import json

import pytest

from benchmarks.compare_strategies import main
from helpers import GPT_DISTRIBUTED_CHECKS


@pytest.mark.launch
def test_one_process_and_tensor_parallel_side_by_side(tmp_path, capsys):
    """One table, one PNG, the rows as JSON, in a new folder; and the tp run itself (2 ranks): every
    check passed, bytes held and sent as the theory says."""
    assert main(["--quick", "--strategies", "none,tp", "--output_dir", str(tmp_path)]) == 0
    (folder,) = tmp_path.iterdir()  # one dated folder per invocation
    rows = json.loads((folder / "comparison.json").read_text())
    assert [r["strategy"] for r in rows] == ["none", "tp"]
    assert all(r["checks"] == "all passed" for r in rows)
    tp = rows[1]
    theory = {kind: size for kind, size in tp["comm_theory"].items() if size}
    assert tp["ranks"] == "1 x 2" and tp["comm_counted"] == theory and tp["wire_bytes"] > 0
    assert rows[0]["comm_counted"] == {} and tp["bytes"]["params"] < rows[0]["bytes"]["params"]
    table = (folder / "comparison.md").read_text().splitlines()
    assert sum(line.startswith("| none |") or line.startswith("| tp |") for line in table) == 2
    assert (folder / "comparison.png").read_bytes()[:4] == b"\x89PNG"

    summary = json.loads((folder / "tp" / "summary.json").read_text())
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    metrics = summary["metrics"]
    assert (metrics["dp_size"], metrics["tp_size"]) == (1, 2)
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
        (["--strategies", "ddp,zero4"], "--strategies: ['zero4'] not among"),
        (["--max_steps", "-1"], "--max_steps"),
    ],
)
def test_bad_input_is_refused_before_any_run(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
