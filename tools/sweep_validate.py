"""A sweep checked before any trial runs (tools/sweep.py): the YAML and W&B's schema, every parameter a flag of
the program, every trial the search may propose accepted by the program's own flag checks at the world size its
launcher starts, one global batch for trials that set the batch flags alike, the metric one the program declares,
the command's words one per item. Every problem is a UsageError of one line."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import itertools
import math
import os
import sys
import warnings
from dataclasses import dataclass

import yaml

from common.config import UsageError, parse_config


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
