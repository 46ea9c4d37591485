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


def test_accelerated_optimizer_zero_grad_still_behaves_after_the_lookups_are_cached(tmp_path):
    """runtime.remove_per_step_lookups replaces AcceleratedOptimizer.zero_grad (its signature check asked
    once): set_to_none still defaults to True, False still zeroes in place, and an optimizer whose
    zero_grad takes no set_to_none still refuses one."""
    import torch
    from accelerate.state import AcceleratorState

    from common.config import RunArgs
    from common.runtime import make_accelerator

    AcceleratorState._reset_state(True)
    try:
        accelerator = make_accelerator(RunArgs(), str(tmp_path))
        model = accelerator.prepare(torch.nn.Linear(3, 1))
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        for set_to_none, expected in ((None, None), (False, 0.0)):
            model(torch.ones(2, 3)).sum().backward()
            if set_to_none is None:
                optimizer.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=set_to_none)
            grad = model.weight.grad
            assert grad is None if expected is None else torch.equal(grad, torch.zeros_like(model.weight))

        class NoSetToNone(torch.optim.SGD):
            def zero_grad(self):
                super().zero_grad()

        plain = accelerator.prepare(NoSetToNone(model.parameters(), lr=0.1))
        plain.zero_grad()
        with pytest.raises(ValueError, match="set_to_none"):
            plain.zero_grad(set_to_none=True)
    finally:
        AcceleratorState._reset_state(True)
