"""benchmarks/compare_strategies.py refuses bad input before any run. (It runs for real, table, PNG, rows
and tp's run, inside tests/test_performance.py, which calls it.)"""

from __future__ import annotations

import pytest

from benchmarks.compare_strategies import main


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
