"""Run a W&B sweep YAML with no W&B server: `python -m tools.sweep sweep_configs/ddp_linear_lr.yaml --count 4`.

What `wandb sweep` + `wandb agent` do online, done locally with W&B's own pieces:
- the search is W&B's open-source sweep engine (`sweeps` on PyPI, what the W&B server runs):
  grid, random and bayes propose the next trial from the finished ones;
- each trial is the very command the agent would run: the YAML's `command:` with ${env},
  ${interpreter}, ${program}, ${args}... expanded by wandb's own `create_sweep_command(_args)`, and the
  agent's environment (WANDB_SWEEP_ID, WANDB_RUN_ID, WANDB_SWEEP_PARAM_PATH) plus WANDB_MODE=offline,
  so every trial's W&B run stays syncable later with `wandb sync`;
- every trial's summary.json is collected into a leaderboard: console table, leaderboard.csv and
  leaderboard.png (the metric against each swept parameter), best trial named.
Before any trial runs, the sweep is validated: YAML and W&B schema, every parameter a flag of the
program, every trial the search can propose (all its values together, with the command's own flags, at the
world size its launcher starts: grid combinations, both ends of a range) accepted by the program's own flag
checks, the metric one the program declares in its Config's `sweep_metrics`, the command's words one per
item. A trial is ranked only if its summary.json says it ran to its end and passed every check it made (the search is told
the others failed, not scored). Problems are one line, exit 2. A trial that runs past
--trial_timeout_s is ended with every process of its launch (torchrun's ranks live in sessions of
their own), before it is reported failed, so nothing writes into its folder afterwards.
The search is seeded (--seed): the same sweep proposes the same values again.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib.util
import io
import itertools
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import yaml

from common.config import (
    MAX_SEED,
    UsageError,
    flag,
    given_path,
    parse_config,
    require,
    require_positive,
    run_cli,
)
from common.processes import TIMED_OUT, run_process_tree


@dataclass
class SweepArgs:
    """`python -m tools.sweep FILE [flags]`: the sweep runner's command line (same parser as the experiments)."""

    sweep_file: str = flag("", "a W&B sweep YAML (e.g. sweep_configs/ddp_linear_lr.yaml)", positional=True)
    count: int = flag(4, "most trials to run (grid stops earlier when exhausted)")
    output_dir: str = flag(
        "", "folder for trials and leaderboard (default runs/sweeps/local-<name>-<time>)", parse=given_path
    )
    trial_timeout_s: float = flag(
        1800.0, "end a trial (every process of its launch) that runs longer than this"
    )
    seed: int = flag(
        0, "seed of the search (random and bayes proposals): the same seed proposes the same values"
    )

    def validate(self) -> None:
        require_positive(self, "count")
        require(
            0 < self.trial_timeout_s < math.inf,
            f"--trial_timeout_s must be > 0 and finite, got {self.trial_timeout_s}",
        )
        require(0 <= self.seed <= MAX_SEED, f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")


def import_sweeps():
    """W&B's sweep engine; sweeps 0.2.0 warns at import about pydantic-v1 config names (harmless)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sweeps
    return sweeps


DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]  # wandb agent's default
ARG_MACROS = (
    "${args}",
    "${args_no_equals}",
    "${args_no_hyphens}",
    "${args_json}",
    "${args_json_file}",
    "${args_no_boolean_flags}",
)


# Flags a sweep may not set: the runner owns where each trial writes, and every trial is a new run.
RUNNER_FLAGS = {
    "output_dir": "each trial writes into its own folder of the sweep (<sweep folder>/<run id>)",
    "overwrite": "every trial writes into a new folder, so nothing is there to overwrite; a swept "
    "--overwrite could only make trials replace each other's results",
    "resume_from_checkpoint": "every trial is a new run",
}


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error (PyYAML keeps the last
    one silently: a sweep would run with a value its author did not see)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


@dataclass
class Sweep:
    path: str
    config: dict  # the YAML, as W&B reads it
    program: str
    flags: list[str]
    metric: str
    goal: str
    command: list[str]


def load_program(program: str):
    """The experiment module behind `program:` (its Config dataclass, whose `sweep_metrics` says what a
    sweep may optimise)."""
    if not os.path.isfile(program):
        raise UsageError(f"program {program!r} not found (run from the repository root)")
    spec = importlib.util.spec_from_file_location(f"sweep_program_{os.path.basename(program)[:-3]}", program)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    if not hasattr(module, "Config"):
        raise UsageError(f"program {program!r} has no Config dataclass, so its flags are unknown")
    return module


def validate_sweep(path: str) -> Sweep:
    """The sweep file -> Sweep, or UsageError naming the first problem."""
    sweeps = import_sweeps()

    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.load(handle, Loader=UniqueKeyLoader)
    except FileNotFoundError:
        raise UsageError(f"sweep file {path!r} not found") from None
    except IsADirectoryError:
        raise UsageError(f"sweep file {path!r} is a folder") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"sweep file {path!r} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
                         f"offset {error.start})") from None  # fmt: skip
    except OSError as error:
        raise UsageError(f"sweep file {path!r} cannot be read ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        raise UsageError(f"sweep file {path!r} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(config, dict):
        raise UsageError(
            f"sweep file {path!r} must be a YAML mapping with program, method, metric, parameters"
        )
    for key in ("program", "method", "metric", "parameters"):
        if key not in config:
            raise UsageError(f"sweep file {path!r} has no {key!r}")
    # the shapes W&B's schema check itself would trip over, each said in W&B's words
    if not isinstance(config["parameters"], dict) or not config["parameters"]:
        raise UsageError(f"sweep file {path!r}: parameters must be a mapping of flag names to their specs "
                         f"(lr: {{values: [0.01, 0.1]}}), got {config['parameters']!r}")  # fmt: skip
    for name, spec in config["parameters"].items():
        if not isinstance(spec, dict):
            raise UsageError(f"sweep file {path!r}: parameter {name!r} must be a mapping such as {{value: {spec!r}}} "
                             f"or {{values: [...]}}, got the bare {spec!r}")  # fmt: skip
    if not isinstance(config["metric"], dict):
        raise UsageError(
            f"sweep file {path!r}: metric must be a mapping with name and goal, got {config['metric']!r}"
        )
    if not (isinstance(config["program"], str) and config["program"].endswith(".py")):
        raise UsageError(f"sweep file {path!r}: program {config['program']!r} is not a Python file (the experiments "
                         "are experiments/*.py)")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sweeps 0.2.0 warns about pydantic v1 config names
        violations = sweeps.schema_violations_from_proposed_config(config)
    if violations:
        raise UsageError(f"sweep file {path!r} breaks W&B's sweep schema: {violations[0]}")
    module = load_program(config["program"])
    flags = [f.name for f in dataclasses.fields(module.Config)]
    for name in config["parameters"]:
        if name not in flags:
            raise UsageError(
                f"sweep file {path!r}: parameter {name!r} is not a flag of {config['program']}; "
                f"its flags: {', '.join(flags)}"
            )
        if name in RUNNER_FLAGS:
            raise UsageError(f"sweep file {path!r}: parameter {name!r} cannot be swept: {RUNNER_FLAGS[name]}")
    metric = config["metric"].get("name") if isinstance(config["metric"], dict) else None
    logged = list(module.Config.sweep_metrics)
    if metric not in logged:
        raise UsageError(
            f"sweep file {path!r}: metric {metric!r} is never logged by {config['program']}; "
            f"it logs: {', '.join(logged) or 'nothing sweepable'}"
        )
    command = config.get("command", DEFAULT_COMMAND)
    if not isinstance(command, list) or not all(isinstance(c, str | int | float) for c in command):
        raise UsageError(f"sweep file {path!r}: command must be a list of words")
    for word in map(str, command):
        if " " in word:
            raise UsageError(
                f"sweep file {path!r}: command item {word!r} holds several words; give each its own item "
                "(the agent runs it without a shell: FileNotFoundError)"
            )
    if not any(str(c) in ARG_MACROS for c in command):
        raise UsageError(
            f"sweep file {path!r}: command never passes ${{args}}: "
            "hyper-parameters would reach only rank 0's wandb.config"
        )
    program_at = next(
        (i for i, c in enumerate(map(str, command)) if c in ("${program}", config["program"])), -1
    )
    for word in map(str, command[program_at + 1 :]):  # the program's own flags, where ${args} goes too
        name = word[2:].split("=")[0] if word.startswith("--") else None
        if name in config["parameters"]:
            raise UsageError(
                f"sweep file {path!r}: command sets --{name} itself, which the sweep also sets through ${{args}}: "
                "the last one on the command line wins, so the leaderboard would show a value the trial never used"
            )
        if name in RUNNER_FLAGS:
            raise UsageError(f"sweep file {path!r}: command sets --{name}: {RUNNER_FLAGS[name]}")
    fixed = [
        str(c) for c in command[program_at + 1 :] if not str(c).startswith("${")
    ]  # the program's own flags
    refuse_trials(path, module.Config, config, fixed, command)
    return Sweep(
        path,
        config,
        config["program"],
        flags,
        metric,
        config["metric"].get("goal", "minimize"),
        [str(c) for c in command],
    )


def proposable_values(spec: dict) -> list:
    """What the search may propose for one parameter: every listed value, and both ends of a range."""
    if "value" in spec:
        return [spec["value"]]
    if "values" in spec:
        return list(spec["values"])
    if spec.get("distribution") in ("log_uniform", "q_log_uniform", "inv_log_uniform"):
        return []  # min and max are exponents there (e^min .. e^max), not values the program sees
    return [spec[end] for end in ("min", "max") if end in spec]


MOST_TRIALS_CHECKED = 512  # a grid larger than this is checked on each value's corners, as a range is
# a sweep over these means to change the batch; over anything else, its trials must train one global batch
BATCH_FLAGS = ("per_rank_batch_size", "gradient_accumulation_steps")


def refuse_trials(path: str, config_cls, config: dict, fixed: list[str], command: list) -> None:
    """Every trial the search may propose, checked as it will run: all its values together, the flags the
    command itself passes, at the world size its launcher starts (a value fine alone can be refused beside
    another: --max_steps 12 with the default --parity_steps 15; a preset needing 2 ranks is fine under a
    2-rank launch). The program's own parser and checks decide; their refusal is said in one line."""
    names = list(config["parameters"])
    choices = [proposable_values(config["parameters"][name]) or [None] for name in names]
    trials = itertools.product(*choices)
    if math.prod(len(c) for c in choices) > MOST_TRIALS_CHECKED:
        trials = itertools.product(*([c[0], c[-1]] for c in choices))
    world_size = launched_ranks([str(c) for c in command])
    global_batches: dict[
        tuple, dict[str, int]
    ] = {}  # batch flags' values -> {a trial's values: global batch}
    for trial in trials:
        values = {name: value for name, value in zip(names, trial, strict=True) if value is not None}
        argv = [f"--{name}={value}" for name, value in values.items()] + fixed + ["--report_to", "none"]
        if "expected_world_size" not in values and not any(
            w.startswith("--expected_world_size") for w in fixed
        ):
            argv += ["--expected_world_size", str(world_size)]
        said = io.StringIO()
        shown = ", ".join(f"{name}={value}" for name, value in values.items())
        try:
            with contextlib.redirect_stderr(said):
                parsed = parse_config(config_cls, argv)
        except SystemExit:
            reason = said.getvalue().strip().split("error: ", 1)[-1].removesuffix(" (see --help)")
            raise UsageError(f"sweep file {path!r}: a trial may run with {shown} on {world_size} rank(s), which "
                             f"{config['program']} refuses: {reason}") from None  # fmt: skip
        if hasattr(parsed, "global_batch_size"):
            # trials that set the batch flags alike must train one global batch: a degree that changes the
            # data-parallel ranks changes it silently (tp 2 on 2 ranks halves it), and the bigger batch "wins"
            batch = tuple(values.get(name) for name in BATCH_FLAGS)
            global_batches.setdefault(batch, {})[shown] = parsed.global_batch_size()
    for trials in global_batches.values():
        if len(set(trials.values())) > 1:
            figures = "; ".join(f"{shown or 'the defaults'}: {size}" for shown, size in trials.items())
            raise UsageError(f"sweep file {path!r}: its trials would train different global batches ({figures} "
                             f"samples a step on {world_size} rank(s)), so the leaderboard would rank unlike runs: "
                             "keep the data-parallel degree fixed, or sweep --per_rank_batch_size / "
                             "--gradient_accumulation_steps with the degree so the global batch stays the same")  # fmt: skip


def launched_ranks(command: list[str]) -> int:
    """The ranks a trial's launcher starts: torchrun's --nproc_per_node, accelerate launch's --num_processes or
    its --config_file's num_processes; a plain interpreter one."""

    def after(*names):
        for index, word in enumerate(command):
            for name in names:
                if word == name and index + 1 < len(command):
                    return command[index + 1]
                if word.startswith(name + "="):
                    return word.split("=", 1)[1]
        return None

    ranks = after("--nproc_per_node", "--nproc-per-node", "--num_processes")
    if ranks is None and (config_file := after("--config_file")):
        try:
            with open(config_file, encoding="utf-8") as handle:
                ranks = (yaml.safe_load(handle) or {}).get("num_processes")
        except (OSError, yaml.YAMLError):
            ranks = None
    try:
        return max(1, int(ranks)) if ranks is not None else 1
    except ValueError:
        return 1


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


def write_leaderboard(sweep: Sweep, rows: list[dict], output_dir: str) -> dict | None:
    sign = 1 if sweep.goal == "minimize" else -1
    # ranked trials (ran to their end, passed every check) by their metric; the others after them, never ranked
    ranked = sorted(rows, key=lambda r: (not r["ranked"], sign * (r[sweep.metric] or 0)))
    columns = list(dict.fromkeys(k for r in ranked for k in r))
    with open(os.path.join(output_dir, "leaderboard.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(ranked)
    shown = [c for c in columns if c != "dir"]
    widths = {c: max(len(c), *(len(format_cell(r.get(c))) for r in ranked)) for c in shown}
    print("  ".join(c.ljust(widths[c]) for c in shown))
    for row in ranked:
        print("  ".join(format_cell(row.get(c)).ljust(widths[c]) for c in shown))
    best = next((r for r in ranked if r["ranked"]), None)
    swept = [p for p in sweep.config["parameters"] if len({repr(r.get(p)) for r in rows}) > 1]
    plot_leaderboard(sweep, rows, swept, output_dir)
    if best:
        print(
            f"best: {best['trial']} {sweep.metric}={best[sweep.metric]:.6g} with "
            + " ".join(f"{p}={best[p]}" for p in sweep.config["parameters"])
        )
    else:
        print(
            f"sweep: no trial ran to its end and passed every check, so there is no best ({len(rows)} not ranked)"
        )
    print(
        f"leaderboard: {os.path.join(output_dir, 'leaderboard.csv')}, {os.path.join(output_dir, 'leaderboard.png')}"
    )
    print(f"W&B runs (offline): upload with `wandb sync {output_dir}/*/wandb/offline-run-*`")
    return best


def format_cell(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def plot_leaderboard(sweep: Sweep, rows: list[dict], swept: list[str], output_dir: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to leave behind

    shown = swept or list(sweep.config["parameters"])[:1]
    figure = Figure(figsize=(4.5 * max(len(shown), 1), 3.5))
    axes = figure.subplots(1, max(len(shown), 1), squeeze=False)
    for axis, param in zip(axes[0], shown, strict=False):
        xs = []
        for ranked, style in ((True, {"marker": "o", "label": "ranked"}),
                              (False, {"marker": "x", "color": "tab:red", "label": "not ranked (a check failed)"})):  # fmt: skip
            points = [(r[param], r[sweep.metric]) for r in rows if r["ranked"] == ranked
                      and r[sweep.metric] is not None and isinstance(r.get(param), int | float)]  # fmt: skip
            if points:
                axis.scatter(*zip(*points, strict=True), **style)
                xs += [p[0] for p in points]
        if xs and min(xs) > 0 and max(xs) / min(xs) > 10:
            axis.set_xscale("log")
        if any(not r["ranked"] and r[sweep.metric] is not None for r in rows):
            axis.legend(fontsize="small")
        axis.set(xlabel=param, ylabel=sweep.metric)
    figure.suptitle(f"{os.path.basename(sweep.path)}: {sweep.metric} ({sweep.goal}) per trial")
    figure.tight_layout()
    figure.savefig(os.path.join(output_dir, "leaderboard.png"), dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_config(SweepArgs, argv, description=__doc__.split("\n")[0], prog="python -m tools.sweep")
    sweep = validate_sweep(args.sweep_file)
    name = os.path.splitext(os.path.basename(args.sweep_file))[0]
    output_dir = os.path.abspath(
        args.output_dir or os.path.join("runs", "sweeps", f"local-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"--output_dir {output_dir} exists and is not a directory")
    if os.path.exists(os.path.join(output_dir, "leaderboard.csv")):
        raise UsageError(f"--output_dir {output_dir} already holds a finished sweep; choose another")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"--output_dir {output_dir}: cannot write there ({error.strerror or error})"
        ) from None
    rows = run_sweep(sweep, args.count, output_dir, args.trial_timeout_s, args.seed)
    best = write_leaderboard(sweep, rows, output_dir)
    with open(os.path.join(output_dir, "sweep.json"), "w") as handle:
        json.dump(
            {
                "sweep_file": sweep.path,
                "seed": args.seed,
                "config": sweep.config,
                "trials": rows,
                "best": best,
            },
            handle,
            indent=2,
            default=str,
        )
    return 0 if best is not None and not math.isnan(best[sweep.metric]) else 1  # no verified trial: exit 1


if __name__ == "__main__":
    run_cli(main)
