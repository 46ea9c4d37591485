"""Unit tests of common/tracking.py: tracker resolution, W&B offline fallback, local files that survive a
failing tracker."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.tracking import GeneralTracker

from common.config import RunArgs, UsageError
from common.tracking import (
    RunRecorder,
    TrackerPlan,
    format_console_line,
    resolve_trackers,
    strict_json,
    wandb_has_credentials,
)


@pytest.fixture
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_none_means_no_tracker(tmp_path):
    assert resolve_trackers("none", str(tmp_path)).log_with == []


def test_uninstalled_tracker_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="--report_to mlflow: that tracker is not installed"):
        resolve_trackers("mlflow", str(tmp_path))


def test_wandb_without_credentials_goes_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert not wandb_has_credentials()
    plan = resolve_trackers("wandb,tensorboard", str(tmp_path))
    assert plan.log_with == ["wandb", "tensorboard"]
    assert plan.notes["wandb"]["mode"] == "offline"
    assert plan.init_kwargs["wandb"] == {"dir": str(tmp_path), "mode": "offline"}
    assert "WANDB_MODE" not in os.environ  # this run's settings, not the process's environment


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "wandb_run_id").write_text("abc123")
    assert resolve_trackers("wandb", str(tmp_path), continuing=True).init_kwargs["wandb"] == {
        "dir": str(tmp_path),
        "mode": "offline",
        "id": "abc123",
        "resume": "allow",
    }
    assert (
        "id" not in resolve_trackers("wandb", str(tmp_path), continuing=False).init_kwargs["wandb"]
    )  # a fresh run: a new W&B run
    monkeypatch.setenv("WANDB_RUN_ID", "sweep-trial-7")  # a sweep agent's id wins
    assert "id" not in resolve_trackers("wandb", str(tmp_path), continuing=True).init_kwargs["wandb"]


def test_non_finite_numbers_become_null_and_are_named():
    text = strict_json({"loss": float("nan"), "rows": [1.0, float("inf")], "ok": 2.0})
    assert json.loads(text) == {
        "loss": None,
        "rows": [1.0, None],
        "ok": 2.0,
        "non_finite": {"null_means": "the value was NaN or infinite", "fields": ["loss", "rows[1]"]},
    }
    assert ": NaN" not in text and "Infinity" not in text  # no bare tokens


def test_credentials_are_found_in_env_or_netrc(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_has_credentials()
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_has_credentials()


def test_explicit_wandb_mode_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_trackers("wandb", str(tmp_path)).notes["wandb"]["mode"] == "disabled"


def test_console_line_has_step_loss_and_throughput():
    line = format_console_line(50, {"loss": 0.0123456, "samples_per_s": 12345.6})
    assert line == "step     50 | loss 0.012346 | samples/s     12,346"


class ExplodingTracker(GeneralTracker):
    """A tracker that fails on its second log call, as a W&B outage mid-run would."""

    name = "exploding"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self):
        super().__init__()
        self.calls = 0

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.calls += 1
        if self.calls >= 2:
            raise ConnectionError("tracker server went away")


@dataclass
class TinyArgs(RunArgs):
    pass


def test_failing_tracker_never_costs_local_metrics(tmp_path, fresh_accelerate_state):
    tracker = ExplodingTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    recorder = RunRecorder(
        accelerator, "demo", TinyArgs(output_dir=str(tmp_path)), str(tmp_path), TrackerPlan(["exploding"])
    )
    for step in (1, 2, 3):
        recorder.log(step, {"loss": 1.0 / step})
    code = recorder.finish({"final": 1}, {"ok": {"passed": True, "detail": "fine"}})
    recorder.close_trackers()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0 and summary["passed"] is True
    assert "tracker server went away" in summary["trackers"]["failed"]
    assert tracker.calls == 2  # dropped after the failure, not retried every step
    assert json.loads((tmp_path / "config.json").read_text())["output_dir"] == str(tmp_path)


def test_a_failed_check_means_exit_1(tmp_path, fresh_accelerate_state):
    accelerator = Accelerator(cpu=True)
    recorder = RunRecorder(accelerator, "demo", TinyArgs(), str(tmp_path), TrackerPlan([]))
    code = recorder.finish(
        {}, {"good": {"passed": True, "detail": ""}, "bad": {"passed": False, "detail": "off by 1"}}
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 1 and summary["passed"] is False and summary["checks"]["bad"]["detail"] == "off by 1"
    assert set(summary) >= {
        "experiment",
        "config",
        "world_size",
        "distributed_type",
        "metrics",
        "checks",
        "passed",
    }
