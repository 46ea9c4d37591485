"""Unit tests of common/config.py: flags from dataclass fields, one-line errors, exit 2."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from common.config import TrainArgs, UsageError, build_parser, flag, parse_config, require
from helpers import REPO


@dataclass
class DemoConfig(TrainArgs):
    lr: float = flag(0.1, "learning rate")
    mode: str = flag("a", "a mode", choices=("a", "b"))

    def validate(self) -> None:
        super().validate()
        require(self.lr > 0, f"--lr must be > 0, got {self.lr}")


def parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        parse_config(DemoConfig, argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"expected exactly one line, got {err!r}"
    return err


def test_defaults_and_types():
    cfg = parse_config(DemoConfig, ["--lr", "0.5", "--max_steps", "7", "--overwrite"])
    assert cfg.lr == 0.5 and cfg.max_steps == 7 and cfg.overwrite is True
    assert cfg.seed == 0 and cfg.report_to == "wandb" and cfg.mode == "a"


def test_bool_accepts_explicit_values():
    assert parse_config(DemoConfig, ["--overwrite", "false"]).overwrite is False
    assert parse_config(DemoConfig, ["--overwrite", "yes"]).overwrite is True


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
        (["--lr", "abc"], "invalid float value: 'abc'"),
        (["--lr", "-1"], "--lr must be > 0, got -1.0"),
        (["--max_steps", "0"], "--max_steps must be > 0, got 0"),
        (["--max_steps", "2.5"], "invalid int value: '2.5'"),
        (["--mode", "c"], "invalid choice: 'c'"),
        (["--report_to", "wandbb"], "unknown tracker 'wandbb'"),
        (["--overwrite", "maybe"], "invalid boolean value: 'maybe'"),
        (["--l", "0.1"], "unrecognized arguments: --l"),  # no silent prefix matching
        # an empty folder would silently mean the default one, runs/<experiment> inside the repository
        (["--output_dir", ""], "argument --output_dir: '' is empty: give a path, or leave the flag out"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, expected, capsys):
    assert expected in parse_error(argv, capsys)


def test_help_explains_every_flag():
    text = build_parser(DemoConfig).format_help()
    for name in (
        "--output_dir",
        "--seed",
        "--report_to",
        "--max_steps",
        "--lr",
        "--mode",
        "--dist_timeout_s",
    ):
        assert name in text
    assert "learning rate" in text and "(default: 0.1)" in text


def test_require_raises_usage_error():
    with pytest.raises(UsageError, match="boom"):
        require(False, "boom")
    require(True, "never raised")


def test_accelerate_runs_as_shipped(tmp_path):
    """No experiment or common module patches Accelerate: after make_accelerator (and a prepared
    optimizer's step), Accelerate's functions are the ones its modules define."""
    import accelerate.optimizer
    import torch
    from accelerate.state import AcceleratorState

    from common.config import RunArgs
    from common.runtime import make_accelerator

    shipped_zero_grad, shipped_lookup = (
        accelerate.optimizer.AcceleratedOptimizer.zero_grad,
        accelerate.optimizer.is_lomo_available,
    )
    AcceleratorState._reset_state(True)
    try:
        accelerator = make_accelerator(RunArgs(), str(tmp_path))
        model = accelerator.prepare(torch.nn.Linear(3, 1))
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    finally:
        AcceleratorState._reset_state(True)
    assert accelerate.optimizer.AcceleratedOptimizer.zero_grad is shipped_zero_grad
    assert accelerate.optimizer.is_lomo_available is shipped_lookup and not hasattr(
        shipped_lookup, "cache_info"
    )
    assert shipped_zero_grad.__module__ == "accelerate.optimizer"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--dist_timeout_s", "inf"], "--dist_timeout_s: must be a finite number, got 'inf'"),
        (["--dist_timeout_s", "1e300"], "--dist_timeout_s must be > 0 and <= 604800"),
        (["--dist_timeout_s", "nan"], "--dist_timeout_s: must be a finite number, got 'nan'"),
        (["--seed", "99999999999999999999999"], "--seed must be between 0 and 2147483647"),
        (["--seed", "-1"], "--seed must be between 0 and 2147483647, got -1"),
        (["--report_to", "all,wandb"], "'all' already means every installed tracker; pass it alone"),
    ],
)
def test_values_that_used_to_end_in_a_traceback(argv, expected, capsys):
    assert expected in parse_error(argv, capsys)


def test_help_shows_each_default_once():
    @dataclass
    class WithDefaultInHelp(TrainArgs):
        size: int = flag(0, "size of things (default: as large as fits)")

    text = " ".join(build_parser(WithDefaultInHelp).format_help().split())
    assert text.endswith("size of things (default: as large as fits)")  # no second "(default: 0)" after it
    assert "(default: 300)" in text  # --max_steps still shows its default


@pytest.mark.launch
def test_a_ctrl_c_leaves_no_warning_of_a_collective_it_left_in_flight(tmp_path):
    """An interrupted cp or tp step leaves a functional collective unwaited; torch warns of it when the process's
    static destructors run, after our one line or, from a rank that exits first, before it. run_cli ends an
    interrupted program without that teardown: exit 130, our line alone."""
    script = tmp_path / "interrupted.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from torch.distributed import _functional_collectives as funcol\n"
        "from common.config import run_cli\n"
        "def main():\n"
        "    dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "    in_flight = funcol.all_reduce(torch.ones(4), 'sum', dist.group.WORLD)  # never waited: Ctrl-C came\n"
        "    raise KeyboardInterrupt\n"
        "run_cli(main)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and done.stderr.strip() == "interrupted.py: interrupted (Ctrl-C)", (
        done.stderr
    )


@pytest.mark.launch
def test_a_reader_that_stops_reading_ends_the_program_without_a_traceback(tmp_path):
    """`python -m tools.plan ... | head`: head closes the pipe after its lines, and the next print fails with
    BrokenPipeError. run_cli ends the program there, exit 1, its stderr empty (no traceback, and none from the
    interpreter's flush at exit)."""
    script = tmp_path / "talkative.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from common.config import run_cli\n"
        "def main():\n"
        "    for line in range(1_000_000):\n"
        "        print(f'line {line}')\n"
        "    return 0\n"
        "run_cli(main)\n"
    )
    writer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout.readline() == b"line 0\n"
    writer.stdout.close()  # as head does, having read what it wanted
    assert writer.wait(timeout=120) == 1
    assert writer.stderr.read() == b""
