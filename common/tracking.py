"""Rank-safe results: trackers through Accelerate, plus local files that never depend on a tracker.

On the main process only:
- `config.json` (resolved config) at start, `metrics.jsonl` (one JSON record per log interval, flushed
  as it goes), `summary.json` at the end (the experiment contract), all under --output_dir;
- the trackers named by --report_to, through `Accelerator(log_with=...)`. W&B without an API key runs
  offline under --output_dir (sync it later with `wandb sync`), instead of prompting or hanging.
A tracker that raises mid-run is reported once and dropped; the local files go on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import netrc
import os
import platform
from dataclasses import dataclass, field
from urllib.parse import urlparse

from tqdm.auto import tqdm

from common.config import UsageError


def json_safe(value, path: str = "", non_finite: list | None = None):
    """`value` with every NaN / inf float replaced by None (strict JSON has no NaN: most parsers reject
    Python's bare `NaN` token), and the dotted paths of what was replaced appended to `non_finite`."""
    if isinstance(value, float) and not math.isfinite(value):
        if non_finite is not None:
            non_finite.append(path)
        return None
    if isinstance(value, dict):
        return {k: json_safe(v, f"{path}.{k}" if path else str(k), non_finite) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, f"{path}[{i}]", non_finite) for i, v in enumerate(value)]
    return value


def strict_json(payload: dict, **dump_kwargs) -> str:
    """json.dumps that never writes NaN: non-finite numbers become null, listed under `non_finite`."""
    non_finite: list = []
    safe = json_safe(payload, non_finite=non_finite)
    if non_finite:
        safe["non_finite"] = {"null_means": "the value was NaN or infinite", "fields": non_finite}
    return json.dumps(safe, allow_nan=False, default=str, **dump_kwargs)


def write_json_atomic(path: str, payload: dict) -> None:
    """Write to a temporary name, then rename: a reader never sees half a file."""
    temporary_path = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary_path, "w") as handle:
            handle.write(strict_json(payload, indent=2) + "\n")
        os.replace(temporary_path, path)
    except OSError as error:
        try:  # a full disk leaves no half-written temporary beside the results
            os.remove(temporary_path)
        except OSError:
            pass
        raise_write_error(path, error)


def raise_write_error(path: str, error: OSError):
    """A failed write (disk full, folder gone) as one line naming the file."""
    reason = "disk full" if error.errno == 28 else (error.strerror or str(error))
    raise UsageError(f"could not write {path}: {reason}") from None


def wandb_has_credentials() -> bool:
    """True when W&B could log in without asking: WANDB_API_KEY, or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


@dataclass
class TrackerPlan:
    """What --report_to resolved to: `log_with` for Accelerator, `init_kwargs` for init_trackers,
    `notes` for summary.json (W&B mode, run folder, a tracker that failed)."""

    log_with: list[str]
    init_kwargs: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)


WANDB_ID_FILE = "wandb_run_id"  # in --output_dir: the W&B run a resumed run continues
FAILED_TAG = "checks_failed"  # the W&B tag of a run whose own checks failed


def resolve_trackers(report_to: str, output_dir: str, continuing: bool = False) -> TrackerPlan:
    """--report_to -> TrackerPlan. Called on every rank before the Accelerator exists, so a missing
    tracker is exit 2, not a crash. `continuing` (a resumed run): W&B continues the run recorded in
    <output_dir>/wandb_run_id (same id, resume="allow") instead of starting one with half a history.
    """
    from accelerate.tracking import get_available_trackers

    names = [t.strip() for t in report_to.split(",") if t.strip() and t.strip() != "none"]
    available = sorted(str(t.value) if hasattr(t, "value") else str(t) for t in get_available_trackers())
    if names == ["all"]:
        names = available
    for name in names:
        if name not in available:
            raise UsageError(
                f"--report_to {name}: that tracker is not installed (installed: "
                f"{', '.join(available) or 'none'}); pip install {name} or pass --report_to none"
            )
    plan = TrackerPlan(names)
    if "wandb" in names:
        # WANDB_MODE is always respected; without it and without a key, this run's wandb.init goes offline
        # (log locally, `wandb sync` later) through its own settings, not the process's environment
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_credentials() else "offline")
        plan.notes["wandb"] = {"mode": mode}
        plan.init_kwargs["wandb"] = {"dir": output_dir, "mode": mode}
        id_file = os.path.join(output_dir, WANDB_ID_FILE)
        if (
            continuing and os.path.exists(id_file) and not os.environ.get("WANDB_RUN_ID")
        ):  # a sweep agent's id wins
            with open(id_file) as handle:
                plan.init_kwargs["wandb"].update(id=handle.read().strip(), resume="allow")
    return plan


class RunRecorder:
    """config.json / metrics.jsonl / summary.json plus the trackers, all on the main process."""

    def __init__(
        self,
        accelerator,
        experiment: str,
        cfg,
        output_dir: str,
        trackers: TrackerPlan,
        resume_step: int | None = None,
        data_identity: dict | None = None,
    ):
        self.accelerator = accelerator
        self.data_identity = data_identity or {}
        self.experiment = experiment
        self.cfg = cfg
        self.output_dir = output_dir
        self.is_main = accelerator.is_main_process
        self.tracker_notes = trackers.notes
        tracker_notes, init_kwargs = trackers.notes, trackers.init_kwargs
        self.trackers_alive = bool(accelerator.log_with)
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self._metrics_file = None
        if not self.is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        write_json_atomic(os.path.join(output_dir, "config.json"), dataclasses.asdict(cfg))
        kept = []
        if resume_step is not None and os.path.exists(self.metrics_path):
            # A resumed run keeps what happened up to its checkpoint and drops what the killed run logged
            # after it, so metrics.jsonl holds every step exactly once.
            with open(self.metrics_path) as handle:
                kept = [line for line in handle if _step_of(line) <= resume_step]
        self._metrics_file = open(self.metrics_path, "w")  # noqa: SIM115 - kept open for the whole run
        self._metrics_file.writelines(kept)
        self._metrics_file.flush()
        if self.trackers_alive:
            try:
                accelerator.init_trackers(
                    cfg.project, config=dataclasses.asdict(cfg), init_kwargs={**init_kwargs}
                )
            except Exception as error:  # a tracker that cannot start must not cost the run
                self._drop_trackers("init", error)
        if "wandb" in tracker_notes and self.trackers_alive:
            run = accelerator.get_tracker("wandb", unwrap=True)
            tracker_notes["wandb"].update(run_dir=os.path.dirname(run.dir), run_id=run.id)
            with open(os.path.join(output_dir, WANDB_ID_FILE), "w") as handle:
                handle.write(run.id)
            if tracker_notes["wandb"]["mode"] == "offline":
                self.print(
                    f"W&B offline (no API key): run saved in {os.path.dirname(run.dir)}; "
                    f"upload it later with `wandb sync {os.path.dirname(run.dir)}`"
                )

    def print(self, line: str) -> None:
        if self.is_main:
            tqdm.write(line)

    def _drop_trackers(self, where: str, error: Exception) -> None:
        self.trackers_alive = False
        self.print(
            f"warning: tracker failed at {where} ({type(error).__name__}: "
            f"{error}); continuing with local metrics.jsonl only"
        )
        self.tracker_notes["failed"] = f"{where}: {type(error).__name__}: {error}"

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        """One record: metrics.jsonl first (always), then the trackers, then the console line."""
        if not self.is_main:
            return
        record = {"step": step, **metrics}
        try:
            self._metrics_file.write(strict_json(record) + "\n")
            self._metrics_file.flush()
        except OSError as error:
            raise_write_error(self.metrics_path, error)
        if self.trackers_alive:
            try:
                self.accelerator.log(metrics, step=step)
            except Exception as error:
                self._drop_trackers(f"step {step}", error)
        if console:
            self.print(format_console_line(step, metrics))

    def log_table(self, name: str, rows: list[dict], image_path: str | None = None) -> None:
        """A table of results (not a time series): one metrics.jsonl record per row, tagged with the
        table's name, and one W&B Table (plus the PNG at `image_path`) logged without a step, so the
        W&B step axis stays the training step."""
        if not (self.is_main and rows):
            return
        try:
            self._metrics_file.writelines(strict_json({"table": name, **row}) + "\n" for row in rows)
            self._metrics_file.flush()
        except OSError as error:
            raise_write_error(self.metrics_path, error)
        if not (self.trackers_alive and "wandb" in self.tracker_notes):
            return
        try:
            import wandb

            payload = {
                f"{name}_table": wandb.Table(
                    columns=list(rows[0]),
                    data=[[str(v) if isinstance(v, dict) else v for v in r.values()] for r in rows],
                )
            }
            if image_path:
                payload[f"{name}_plot"] = wandb.Image(image_path)
            self.accelerator.get_tracker("wandb", unwrap=True).log(payload, commit=False)
        except Exception as error:
            self._drop_trackers(f"{name} table", error)

    def finish(self, metrics: dict, checks: dict, completed: bool = True) -> int:
        """Write summary.json (and the verdicts into W&B's summary); return the exit code (0 passed, 1 a check failed).
        `completed`: the run ran to its end (false: it ended early on a check that makes the rest meaningless);
        a run that crashed writes no summary.json at all. Tools that rank runs (tools/sweep.py) read it.

        `checks` may be known on the main process only (single-process references run there), so the
        verdict is broadcast: every rank returns the same code.
        """
        from accelerate.utils import broadcast_object_list

        # a skipped check (passed None: the run could not make it) neither passes nor fails the run
        passed = all(c["passed"] is not False for c in checks.values()) if checks else False
        if self.is_main:
            summary = {
                "experiment": self.experiment,
                "config": dataclasses.asdict(self.cfg),
                # what determines the result (a finished run re-run with the same trajectory is a no-op)
                "trajectory": self.cfg.trajectory(self.accelerator.num_processes),
                "world_size": self.accelerator.num_processes,
                "distributed_type": self.accelerator.distributed_type.value,
                "data": self.data_identity,
                "metrics": metrics,
                "checks": checks,
                "passed": passed,
                "completed": completed,
                "trackers": self.tracker_notes,
                "versions": _versions(),
            }
            try:
                self._metrics_file.close()
            except OSError as error:
                raise_write_error(self.metrics_path, error)
            write_json_atomic(os.path.join(self.output_dir, "summary.json"), summary)
            self._record_verdict_in_trackers(checks, passed)
            for name, check in checks.items():
                self.print(f"check {name:<36} {verdict_word(check)}  {check['detail']}")
            self.print(
                f"{self.experiment}: "
                f"{'PASSED' if passed else 'FAILED'} -> {os.path.join(self.output_dir, 'summary.json')}"
            )
        verdict = [passed]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(verdict, from_process=0)
        return 0 if verdict[0] else 1

    def _record_verdict_in_trackers(self, checks: dict, passed: bool) -> None:
        """PASS/FAIL per check into the W&B run's summary, where the runs table shows it; a run with a failed check
        is tagged `checks_failed` (a sweep never ranks it: tools/sweep.py), so W&B's runs table can filter it out."""
        if not (self.trackers_alive and "wandb" in self.tracker_notes):
            return
        try:
            run = self.accelerator.get_tracker("wandb", unwrap=True)
            if not passed:
                run.tags = (*(run.tags or ()), FAILED_TAG)
            run.summary.update(
                {
                    "passed": passed,
                    **{f"check/{name}": verdict_word(c) for name, c in checks.items()},
                }
            )
        except Exception as error:
            self._drop_trackers("summary", error)

    def close_trackers(self) -> None:
        """Finish every tracker once (main process; the others have none)."""
        for tracker in self.accelerator.trackers if self.trackers_alive else []:
            try:
                tracker.finish()
            except Exception as error:
                self._drop_trackers("finish", error)
        self.trackers_alive = False


def verdict_word(check: dict) -> str:
    return "SKIP" if check.get("skipped") else "PASS" if check["passed"] else "FAIL"


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; a line cut short by a kill counts as never written."""
    try:
        return json.loads(line).get("step", 0) if line.endswith("\n") else float("inf")
    except json.JSONDecodeError:
        return float("inf")


def format_console_line(step: int, metrics: dict) -> str:
    """`step | loss | samples/s` and any other figures, aligned."""
    parts = [f"step {step:>6}"]
    for key, value in metrics.items():
        if key.endswith("_per_s"):  # samples_per_s -> samples/s
            parts.append(f"{key[: -len('_per_s')]}/s {value:>10,.0f}")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.6f}")
        else:
            parts.append(f"{key} {value}")
    return " | ".join(parts)


def _versions() -> dict:
    import accelerate
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "cpus": os.cpu_count(),
    }
