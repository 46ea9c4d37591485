"""A sweep's trials run as W&B's agent runs them (tools/sweep.py): the search proposes, the command is expanded by
wandb's own helpers, the trial runs with the agent's environment (offline), and its outcome is read from its
summary.json: ranked only if it ran to its end and passed every check."""

from __future__ import annotations

import json
import os
import random
import sys
import time
import warnings

from common.processes import TIMED_OUT, run_process_tree
from tools.sweep_validate import Sweep, import_sweeps


def seeded(seed: int, propose):
    """propose() with Python's and numpy's global generators seeded (the sweep engine draws from them),
    and both restored after: the same sweep proposes the same values, and the process's generators are
    left as they were."""
    import numpy

    saved = random.getstate(), numpy.random.get_state()
    random.seed(seed)
    numpy.random.seed(seed)
    try:
        return propose()
    finally:
        random.setstate(saved[0])
        numpy.random.set_state(saved[1])


def expand_command(sweep: Sweep, values: dict, args_json_path: str) -> list[str]:
    """The agent's expansion of `command:` (wandb/wandb_agent.py `_command_run`), with wandb's helpers."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

    sweep_vars = create_sweep_command_args({"args": {k: {"value": v} for k, v in values.items()}})
    sweep_vars.update(
        interpreter=[sys.executable],
        program=[sweep.program],
        args_json_file=[args_json_path],
        env=["/usr/bin/env"],
    )
    command = []
    for word in create_sweep_command(list(sweep.command)):
        if word.startswith("${") and word.endswith("}"):
            command += sweep_vars.get(word[2:-1]) or []
        else:
            command.append(word)
    return command


def read_outcome(trial_dir: str, metric: str) -> tuple[float | None, str | None, list[str]]:
    """(the metric, why it is not ranked or None, the names of its failed checks). Ranked: a trial that ran to its
    end (its summary.json says `completed`) and passed every check it made; its metric is the final figure, or
    the last value logged to metrics.jsonl. A run that crashed, was killed or ended early is never ranked, nor is
    one whose own checks say its result is wrong (a metric it logged is kept for the table, never for the best)."""
    try:
        with open(os.path.join(trial_dir, "summary.json")) as handle:
            summary = json.load(handle)
    except FileNotFoundError:
        return None, "no summary.json: it crashed or was ended before its end (see trial.log)", []
    except (OSError, json.JSONDecodeError) as error:
        return None, f"its summary.json is unreadable ({type(error).__name__})", []
    failed = [name for name, check in summary.get("checks", {}).items() if check.get("passed") is False]
    if not summary.get("completed", False):
        return None, "it ended early (summary.json: completed false; see its checks)", failed
    value = summary.get("metrics", {}).get(metric)
    if not isinstance(value, int | float):
        value = None
        try:
            with open(os.path.join(trial_dir, "metrics.jsonl")) as handle:
                for line in handle:
                    value = json.loads(line).get(metric, value)
        except (OSError, json.JSONDecodeError):
            pass
    value = float(value) if isinstance(value, int | float) else None
    if failed:
        return value, f"checks failed: {', '.join(failed)}", failed
    if value is None:
        return None, f"it ran to its end but never logged {metric!r}", []
    return value, None, []


def run_sweep(sweep: Sweep, count: int, output_dir: str, trial_timeout_s: float, seed: int = 0) -> list[dict]:
    from wandb.sdk.lib import config_util

    sweeps = import_sweeps()

    sweep_id = os.path.basename(output_dir)
    runs, rows = [], []
    for trial in range(1, count + 1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            proposal = seeded(seed * 1000 + trial, lambda: sweeps.next_run(sweep.config, runs))
        if proposal is None:
            print(f"sweep: the {sweep.config['method']} search is exhausted after {trial - 1} trials")
            break
        values = {
            k: (float(v["value"]) if hasattr(v["value"], "dtype") else v["value"])
            for k, v in proposal.config.items()
        }
        run_id = f"{sweep_id}-trial{trial:03d}"  # W&B run ids must not collide across sweeps
        trial_dir = os.path.join(output_dir, run_id)
        os.makedirs(trial_dir, exist_ok=True)
        # As the agent does: one parameter file per run beside the others. The experiments' default
        # --output_dir under a sweep is <folder of that file>/<WANDB_RUN_ID>, i.e. trial_dir.
        param_path = os.path.join(output_dir, f"sweep-config-{run_id}.yaml")
        config_util.save_config_file_from_dict(param_path, {k: {"value": v} for k, v in values.items()})
        command = expand_command(sweep, values, os.path.join(trial_dir, "sweep-args.json"))
        env = {
            **os.environ,
            "WANDB_MODE": "offline",
            "WANDB_SWEEP_ID": sweep_id,
            "WANDB_RUN_ID": run_id,
            "WANDB_SWEEP_PARAM_PATH": param_path,
            "WANDB_PROJECT": os.environ.get("WANDB_PROJECT", sweep.config.get("project", "dist-experiments")),
        }
        print(f"sweep: trial {trial}/{count} {run_id}: {' '.join(command)}", flush=True)
        started = time.perf_counter()
        with open(os.path.join(trial_dir, "trial.log"), "w") as log:
            # Ends every process of the launch on a timeout (or Ctrl-C), and returns only once they are gone.
            exit_code = run_process_tree(
                command, trial_timeout_s, capture=False, env=env, stdout=log, stderr=log
            ).returncode
        exit_code = "timeout" if exit_code == TIMED_OUT else exit_code
        value, why, failed_checks = (
            read_outcome(trial_dir, sweep.metric) if exit_code != "timeout" else (None, "timed out", [])
        )
        # Only a trial that ran to its end and passed every check is a result. Anything else is a failure, and
        # the search is told so (W&B's engine then proposes around it, not from its figure): a crash (under
        # `accelerate launch` it exits 1, like a failed check: summary.json tells them apart), a timeout, or a run
        # whose own checks say its result is wrong (an lr too small to recover the truth, a layout that failed
        # parity): its metric is not the metric of a correct run.
        state = sweeps.RunState.finished if why is None else sweeps.RunState.failed
        proposal.state = state
        proposal.summary_metrics = {sweep.metric: value} if why is None else {}
        runs.append(proposal)
        rows.append(
            {
                "trial": run_id,
                "state": state.value,
                "ranked": why is None,
                "exit_code": exit_code,
                sweep.metric: value,
                "failed_checks": " ".join(failed_checks),
                "not_ranked_because": why or "",
                **values,
                "seconds": round(time.perf_counter() - started, 1),
                "dir": trial_dir,
            }
        )
        said = f"{sweep.metric}={value}" if why is None else f"not ranked: {why}"
        print(f"sweep: {run_id} {state.value} (exit {exit_code}) {said}", flush=True)
    return rows
