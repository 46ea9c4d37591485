"""Unit tests of common/config.py: flags from dataclass fields, one-line errors, exit 2."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.config import TrainArgs, UsageError, build_parser, flag, parse_config, require


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
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, expected, capsys):
    assert expected in parse_error(argv, capsys)


def test_help_explains_every_flag():
    text = build_parser(DemoConfig).format_help()
    for name in ("--output_dir", "--seed", "--report_to", "--max_steps", "--lr", "--mode", "--dist_timeout_s"):
        assert name in text
    assert "learning rate" in text and "(default: 0.1)" in text


def test_require_raises_usage_error():
    with pytest.raises(UsageError, match="boom"):
        require(False, "boom")
    require(True, "never raised")
