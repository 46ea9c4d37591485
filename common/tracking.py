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
import netrc
import os
import platform
from urllib.parse import urlparse

from tqdm.auto import tqdm

from common.config import UsageError


def write_json_atomic(path: str, payload: dict) -> None:
    """Write to a temporary name, then rename: a reader never sees half a file."""
    temporary_path = f"{path}.tmp{os.getpid()}"
    with open(temporary_path, "w") as handle:
        json.dump(payload, handle, indent=2, default=str)
        handle.write("\n")
    os.replace(temporary_path, path)


def wandb_has_credentials() -> bool:
    """True when W&B could log in without asking: WANDB_API_KEY, or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_trackers(report_to: str, output_dir: str) -> tuple[list[str], dict, dict]:
    """--report_to -> (log_with for Accelerator, init_kwargs for init_trackers, notes for summary.json).

    Called on every rank before the Accelerator exists, so a missing tracker is exit 2, not a crash.
    """
    from accelerate.tracking import get_available_trackers

    names = [t.strip() for t in report_to.split(",") if t.strip() and t.strip() != "none"]
    available = sorted(str(t.value) if hasattr(t, "value") else str(t) for t in get_available_trackers())
    if names == ["all"]:
        names = available
    for name in names:
        if name not in available:
            raise UsageError(f"--report_to {name}: that tracker is not installed (installed: {', '.join(available) or 'none'}); pip install {name} or pass --report_to none")
    init_kwargs: dict = {}
    notes: dict = {}
    if "wandb" in names:
        if not os.environ.get("WANDB_MODE") and not wandb_has_credentials():
            os.environ["WANDB_MODE"] = "offline"  # no key: log locally, `wandb sync` later
        notes["wandb"] = {"mode": os.environ.get("WANDB_MODE", "online")}
        os.makedirs(output_dir, exist_ok=True)
        init_kwargs["wandb"] = {"dir": output_dir}
    return names, init_kwargs, notes


class RunRecorder:
    """config.json / metrics.jsonl / summary.json plus the trackers, all on the main process."""

    def __init__(self, accelerator, experiment: str, cfg, output_dir: str, init_kwargs: dict, tracker_notes: dict,
                 resume_step: int | None = None):
        self.accelerator = accelerator
        self.experiment = experiment
        self.cfg = cfg
        self.output_dir = output_dir
        self.is_main = accelerator.is_main_process
        self.tracker_notes = tracker_notes
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
                accelerator.init_trackers(cfg.project, config=dataclasses.asdict(cfg), init_kwargs={**init_kwargs})
            except Exception as error:  # a tracker that cannot start must not cost the run
                self._drop_trackers("init", error)
        if "wandb" in tracker_notes and self.trackers_alive:
            run = accelerator.get_tracker("wandb", unwrap=True)
            tracker_notes["wandb"]["run_dir"] = os.path.dirname(run.dir)
            if tracker_notes["wandb"]["mode"] == "offline":
                self.print(f"W&B offline (no API key): run saved in {os.path.dirname(run.dir)}; upload it later with `wandb sync {os.path.dirname(run.dir)}`")

    def print(self, line: str) -> None:
        if self.is_main:
            tqdm.write(line)

    def _drop_trackers(self, where: str, error: Exception) -> None:
        self.trackers_alive = False
        self.print(f"warning: tracker failed at {where} ({type(error).__name__}: {error}); continuing with local metrics.jsonl only")
        self.tracker_notes["failed"] = f"{where}: {type(error).__name__}: {error}"

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        """One record: metrics.jsonl first (always), then the trackers, then the console line."""
        if not self.is_main:
            return
        record = {"step": step, **metrics}
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        if self.trackers_alive:
            try:
                self.accelerator.log(metrics, step=step)
            except Exception as error:
                self._drop_trackers(f"step {step}", error)
        if console:
            self.print(format_console_line(step, metrics))

    def log_tracker_only(self, payload: dict, step: int | None = None) -> None:
        """Tables and images: trackers only (they have no place in a jsonl record)."""
        if self.is_main and self.trackers_alive:
            try:
                self.accelerator.log(payload, step=step)
            except Exception as error:
                self._drop_trackers("table/image log", error)

    def log_wandb_table_and_image(self, name: str, rows: list[dict], image_path: str | None) -> None:
        """A W&B Table of `rows` and the PNG at `image_path`, when W&B is one of the trackers."""
        if not (self.is_main and self.trackers_alive and "wandb" in self.tracker_notes and rows):
            return
        import wandb

        payload = {f"{name}_table": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}
        if image_path:
            payload[f"{name}_plot"] = wandb.Image(image_path)
        self.log_tracker_only(payload)

    def finish(self, metrics: dict, checks: dict) -> int:
        """Write summary.json, close the trackers, return the exit code (0 passed, 1 a check failed).

        `checks` may be known on the main process only (single-process references run there), so the
        verdict is broadcast: every rank returns the same code.
        """
        from accelerate.utils import broadcast_object_list

        passed = all(c["passed"] for c in checks.values()) if checks else False
        if self.is_main:
            summary = {
                "experiment": self.experiment,
                "config": dataclasses.asdict(self.cfg),
                "world_size": self.accelerator.num_processes,
                "distributed_type": self.accelerator.distributed_type.value,
                "metrics": metrics,
                "checks": checks,
                "passed": passed,
                "trackers": self.tracker_notes,
                "versions": _versions(),
            }
            self._metrics_file.close()
            write_json_atomic(os.path.join(self.output_dir, "summary.json"), summary)
            for name, check in checks.items():
                self.print(f"check {name:<36} {'PASS' if check['passed'] else 'FAIL'}  {check['detail']}")
            self.print(f"{self.experiment}: {'PASSED' if passed else 'FAILED'} -> {os.path.join(self.output_dir, 'summary.json')}")
        verdict = [passed]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(verdict, from_process=0)
        self.close()
        return 0 if verdict[0] else 1

    def close(self) -> None:
        """Accelerate's end_training, in an order that lets gloo shut down cleanly.

        We saw `terminate called without an active exception` (SIGABRT) on the non-main rank in about
        1 of 15 two-rank runs when it tore its process group down while rank 0 was still closing W&B,
        and while DDP-wrapped models still held the group. So: trackers first, then every rank waits
        for the others, drops Accelerate's references to prepared models, and destroys the group."""
        for tracker in self.accelerator.trackers if self.trackers_alive else []:
            try:
                tracker.finish()
            except Exception as error:
                self._drop_trackers("finish", error)
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()
        self.accelerator.free_memory()
        self.accelerator.state.destroy_process_group()


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
        if key == "samples_per_s":
            parts.append(f"samples/s {value:>10,.0f}")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.6f}")
        else:
            parts.append(f"{key} {value}")
    return " | ".join(parts)


def _versions() -> dict:
    import accelerate
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "accelerate": accelerate.__version__, "cpus": os.cpu_count()}
