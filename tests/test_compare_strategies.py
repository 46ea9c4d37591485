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
        (["--layouts", "tp=2:pp=2:sp"], "--layouts: 'tp=2:pp=2:sp' is not degrees like dp_shard=2:tp=2"),
    ],
)
def test_bad_input_is_refused_before_any_run(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_plot_labels_every_bar_readably_however_long_its_name(tmp_path, monkeypatch):
    """docs/images/layouts.png once had its x labels overlap into an unreadable strip (long layout names under
    narrow bars). Nine layouts with the longest names the benchmark makes: every bar's label is drawn whole, inside
    the figure, and no two labels (nor a label and a legend) overlap."""
    from matplotlib.figure import Figure

    from benchmarks import compare_strategies

    drawn, savefig = {}, Figure.savefig

    def keep(self, path, **kwargs):  # the figure plot() saved
        savefig(self, path, **kwargs)
        drawn["figure"] = self

    monkeypatch.setattr(Figure, "savefig", keep)
    names = ["none", "dp_shard 2 x tp 2", "pp 2 x dp_shard 2", "dp_shard 2 x cp 2", "pp 2 x tp 2", "cp 2 x tp 2",
             "pp 2 x cp 2", "pp 2 x dp_shard 2 x tp 2", "pp 2 x dp_shard 2 x cp 2 x tp 2"]  # fmt: skip
    rows = [{"strategy": name, "ranks": 2 ** name.count("2"), "tokens_per_s": 1000.0 / (i + 1),
             "bytes": {"params": 4e6 / (i + 1), "grads": 4e6 / (i + 1), "optimizer": 8e6 / (i + 1)},
             "comm_counted": {"all_gather": 1e6, "all_reduce": 2e6, "send": 1e5, "recv": 1e5} if i else {},
             "step_time_ms": {"forward": 10.0 * (i + 1), "backward": 5.0, "optimizer": 1.0}}
            for i, name in enumerate(names)]  # fmt: skip
    compare_strategies.plot(rows, tmp_path / "plot.png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = drawn["figure"]
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    whole = figure.bbox
    boxes = []
    for axis in figure.axes:
        labels = [t for t in axis.get_yticklabels() if t.get_visible() and t.get_text()]
        boxes += [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
        if axis.get_legend():
            boxes.append(("legend", axis.get_legend().get_window_extent(renderer)))
    shown = {text for text, _ in boxes}
    assert {f"{r['strategy']} ({r['ranks']} rank{'s' * (r['ranks'] > 1)})" for r in rows} <= shown
    for text, box in boxes:
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, text
    for index, (text, box) in enumerate(boxes):
        for other, other_box in boxes[index + 1 :]:
            assert not box.overlaps(other_box), (text, other)


def test_a_layout_with_sequence_parallel_runs_train_gpt_with_it():
    from benchmarks.compare_strategies import parse_args

    (run,) = parse_args(["--strategies", "", "--layouts", "tp=2:pp=2:sequence_parallel"]).runs
    assert run.flags == ["--tp", "2", "--pp", "2", "--sequence_parallel"] and run.ranks == 4
    assert run.label == "pp 2 x tp 2 + SP"
