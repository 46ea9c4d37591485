"""benchmarks/compare_strategies.py for real: it launches train_gpt per strategy and writes one table,
one PNG and the rows as JSON in a new folder, with the counted communication equal to the theory."""

from __future__ import annotations

import json

import pytest

from benchmarks.compare_strategies import main


@pytest.mark.launch
def test_two_strategies_make_one_table_and_plot(tmp_path, capsys):
    assert main(["--quick", "--strategies", "none,tp", "--output_dir", str(tmp_path)]) == 0
    (folder,) = tmp_path.iterdir()  # one dated folder per invocation
    rows = json.loads((folder / "comparison.json").read_text())
    assert [r["strategy"] for r in rows] == ["none", "tp"]
    assert all(r["checks"] == "all passed" for r in rows)
    tp = rows[1]
    assert tp["ranks"] == "1 x 2" and tp["comm_counted"] == tp["comm_theory"] and tp["wire_bytes"] > 0
    assert rows[0]["comm_counted"] == {} and tp["bytes"]["params"] < rows[0]["bytes"]["params"]
    table = (folder / "comparison.md").read_text().splitlines()
    assert sum(line.startswith("| none |") or line.startswith("| tp |") for line in table) == 2
    assert (folder / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert (folder / "tp.log").exists() and (folder / "tp" / "summary.json").exists()


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
