"""Typed experiment configs: a dataclass whose fields are the CLI flags.

Each experiment declares `@dataclass class Config(TrainArgs)` (or `RunArgs` when it does not train)
with defaults in code and a `help` per field; `parse_config(Config)` turns the fields into flags.
Unknown flags, non-numbers and out-of-range values end in ONE line on stderr and exit status 2,
before any process group or output file exists, so bad input never costs a result.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

C = TypeVar("C")

# Trackers `--report_to` accepts, as in Hugging Face Trainer / Accelerate's LoggerType.
KNOWN_TRACKERS = (
    "wandb",
    "tensorboard",
    "comet_ml",
    "mlflow",
    "aim",
    "clearml",
    "dvclive",
    "swanlab",
    "trackio",
)


class UsageError(Exception):
    """Bad input found after parsing (a data file, a device map, an output dir): exit 2, one line.
    `same_on_every_rank`: every rank raised this same error (the ranks agreed on it first), so only the
    main process says it."""

    def __init__(self, message: str, same_on_every_rank: bool = False):
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


def flag(
    default: Any, help: str, choices: Sequence[Any] | None = None, positional: bool = False, parse=None
) -> Any:
    """A dataclass field that is also a CLI flag (`positional`: a bare argument, as a tool's input file; `parse`:
    the text -> value of a flag whose values need more than its type, raising argparse.ArgumentTypeError)."""
    return field(
        default=default, metadata={"help": help, "choices": choices, "positional": positional, "parse": parse}
    )


def given_path(text: str) -> str:
    """A path flag's value when given: not empty (an empty --output_dir would silently mean the default folder,
    inside the repository)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is empty: give a path, or leave the flag out for its default"
        )
    return text


# a week: longer is a typo, and torch's timedelta arithmetic overflows near 1e300
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_SEED = 2**31 - 1  # the data order's generator is seeded with seed * 100_003 + epoch, which must fit int64
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a program ended by Ctrl-C


@dataclass
class RunArgs:
    """Flags every experiment has (the project's contract).

    Two class attributes (not flags) tell the tools about an experiment's Config:
    - `sweep_metrics`: what a W&B sweep may optimise (logged to metrics.jsonl or in summary.json's
      metrics); `tools/sweep.py` refuses any other metric before the first trial;
    - `result_neutral`: flags that do not change what the run computes (where output goes, logging,
      timeouts, fault injection). Every other flag is part of the run's trajectory: a resume whose
      trajectory differs from its checkpoint's is refused, naming the field;
    - `reshardable` and `layout_flags`: a Config whose checkpoints continue at any world size and under
      any of its `layout_flags` (train_gpt's --strategy) leaves those and the world size out of it.
    """

    sweep_metrics: ClassVar[tuple[str, ...]] = ()
    reshardable: ClassVar[bool] = False
    layout_flags: ClassVar[tuple[str, ...]] = ()
    result_neutral: ClassVar[tuple[str, ...]] = (
        "output_dir",
        "report_to",
        "project",
        "overwrite",
        "expected_world_size",
        "dist_timeout_s",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "resume_from_checkpoint",
        "fail_at_step",
        "fail_rank",
        "hang_at_step",
        "hang_rank",
    )

    output_dir: str = flag(
        "",
        "folder for summary.json, metrics.jsonl, config.json and tracker files (default runs/<experiment>)",
        parse=given_path,
    )
    seed: int = flag(0, "seed for data, initial weights and shuffling; the same on every rank")
    report_to: str = flag(
        "wandb",
        "comma-separated trackers (wandb, tensorboard, ..., all, none); wandb goes offline without an API key",
    )
    project: str = flag("dist-experiments", "tracker project name (W&B project)")
    overwrite: bool = flag(False, "allow writing into an --output_dir that already holds a finished run")
    expected_world_size: int = flag(
        0,
        "fail the `distributed` check unless exactly this many ranks run (0: what the launcher set in WORLD_SIZE)",
    )
    dist_timeout_s: float = flag(
        180.0, "timeout in seconds of every collective and of process-group start-up (no silent hangs)"
    )

    def validate(self) -> None:
        """Raise UsageError naming the bad value and what is allowed. Subclasses extend this."""
        trackers = [t.strip() for t in self.report_to.split(",") if t.strip()]
        allowed = (*KNOWN_TRACKERS, "all", "none")
        for tracker in trackers or ["<empty>"]:
            if tracker not in allowed:
                raise UsageError(
                    f"--report_to {self.report_to!r}: unknown tracker {tracker!r}; allowed: {', '.join(allowed)}"
                )
        if "all" in trackers and len(trackers) > 1:
            raise UsageError(
                f"--report_to {self.report_to!r}: 'all' already means every installed tracker; pass it alone"
            )
        require(
            self.expected_world_size >= 0,
            f"--expected_world_size must be >= 0, got {self.expected_world_size}",
        )
        require(
            0 < self.dist_timeout_s <= MAX_TIMEOUT_S and math.isfinite(self.dist_timeout_s),
            f"--dist_timeout_s must be > 0 and <= {MAX_TIMEOUT_S} (a week), got {self.dist_timeout_s}",
        )
        require(0 <= self.seed <= MAX_SEED, f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")

    def trajectory(self, world_size: int) -> dict:
        """What determines what the run computes: every flag but `result_neutral`, and the world size
        (it sets the global batch). Where `reshardable`, a checkpoint continues under any world size and
        `layout_flags` (train_gpt: DCP + a data position in samples); then neither is part of it."""
        if self.reshardable:
            skip = (*self.result_neutral, *self.layout_flags)
            return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        return {
            **{k: v for k, v in dataclasses.asdict(self).items() if k not in self.result_neutral},
            "world_size": world_size,
        }


@dataclass
class TrainArgs(RunArgs):
    """Flags of every experiment that trains."""

    max_steps: int = flag(
        300, "optimizer steps to train (each consumes gradient_accumulation_steps micro-batches per rank)"
    )
    log_every: int = flag(50, "optimizer steps between console lines / metrics.jsonl records")

    def validate(self) -> None:
        super().validate()
        require_positive(self, "max_steps", "log_every")


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def require_positive(cfg, *names: str) -> None:
    """Every named flag must be > 0: `--name must be > 0, got value` for the first that is not."""
    for name in names:
        require(getattr(cfg, name) > 0, f"--{name} must be > 0, got {getattr(cfg, name)}")


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error; we print the error alone, on one line, and exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        # every rank of a launch parses the same flags and refuses them alike: the main process says it, once
        main_process = os.environ.get("RANK", "0") == "0"
        if not main_process and "TORCHELASTIC_RUN_ID" in os.environ:
            wait_for_the_main_process_to_say_it()
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n" if main_process else None)


def wait_for_the_main_process_to_say_it() -> None:
    """A refusal every rank makes alike is said by the main process; under torchrun's agent (accelerate launch's
    too) the other ranks give it time to, before the agent sees one of them exit and terminates every rank: on a
    loaded machine a peer refused first and the main process's line was never said (the agent's came first)."""
    time.sleep(5)


def finite_float(text: str) -> float:
    """A float flag's value: a finite number (nan and inf would pass every `>` check wrongly, or none at all)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean value: {text!r} (allowed: true/false)")


class _DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` after each flag's help, unless the help already says what the default is."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def build_parser(
    config_cls: type, description: str | None = None, prog: str | None = None
) -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=prog,
        description=description,
        allow_abbrev=False,  # --lr must not silently match --lr_warmup
        formatter_class=_DefaultsOnceFormatter,
    )
    for f in dataclasses.fields(config_cls):
        kind = {"int": int, "float": float, "str": str, "bool": bool}[
            f.type if isinstance(f.type, str) else f.type.__name__
        ]
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", "")}
        if f.metadata.get("positional"):
            parser.add_argument(f.name, type=kind, **kwargs)
            continue
        kwargs["dest"] = f.name
        if kind is bool:
            # `--overwrite` alone means true; `--overwrite false` is accepted too (sweeps pass values).
            kwargs.update(nargs="?", const=True, type=_parse_bool, metavar="BOOL")
        else:
            kwargs.update(type=f.metadata.get("parse") or (finite_float if kind is float else kind))
            if f.metadata.get("parse"):
                # argparse would run `parse` on a string default too: left out, the dataclass's default holds
                kwargs["default"] = argparse.SUPPRESS
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_config(
    config_cls: type[C],
    argv: Sequence[str] | None = None,
    description: str | None = None,
    prog: str | None = None,
) -> C:
    """Flags -> validated config; any problem is one line on stderr and exit 2."""
    parser = build_parser(config_cls, description, prog)
    namespace = parser.parse_args(argv)
    cfg = config_cls(**vars(namespace))
    # which flags the command line gave (not a field: config.json records values, not how they came)
    words = {word.split("=")[0] for word in (sys.argv[1:] if argv is None else argv)}
    cfg.given_flags = frozenset(a.dest for a in parser._actions if words & set(a.option_strings))
    try:
        cfg.validate()
    except UsageError as error:
        parser.error(str(error))
    return cfg


def run_cli(main: Callable[[], int]) -> None:
    """`sys.exit(main())`, turning a UsageError raised inside the run into one line and exit 2. With
    DIST_REHEARSAL set, the whole program runs as a GPU would see its tensors (common/rehearsal.py): what would
    crash there is one line here, and exit 1."""
    from common.rehearsal import RehearsalFailure, rehearse_if_asked

    try:
        with rehearse_if_asked():
            code = main()
    except RehearsalFailure as failure:
        print(f"{os.path.basename(sys.argv[0])}: {failure}", file=sys.stderr)
        code = 1
    except UsageError as error:
        if int(os.environ.get("RANK", "0")) == 0 or not error.same_on_every_rank:
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            wait_for_the_main_process_to_say_it()
        code = 2
    except SystemExit as stop:  # the parser's exit 2, or a run that ended early (RunEnded: a Ctrl-C's 130)
        code = stop.code
    except BrokenPipeError:  # its reader closed stdout (`| head`): the lines it read were all it asked for
        # stdout pointed at devnull, so that the interpreter's flush at exit does not fail on the pipe again (the
        # signal module's docs, "Note on SIGPIPE"); exit 1, as they do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    except KeyboardInterrupt:  # Ctrl-C before a run started (a run says where it stopped itself)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{os.path.basename(sys.argv[0])}: interrupted (Ctrl-C)", file=sys.stderr)
        code = INTERRUPTED_EXIT_CODE
    finally:
        # Collect the run's models (DDP holds the process group) while the interpreter is fully alive,
        # and close a group a run that stopped early left open: gloo threads alive at interpreter exit
        # abort the process (`terminate called without an active exception`).
        gc.collect()
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        # What is left lives until exit anyway: frozen objects are skipped by the collections the
        # interpreter runs at shutdown, which took 0.5 s per process with torch + datasets loaded
        # (0.1 s frozen). Results and trackers are closed explicitly by then; atexit handlers still run.
        gc.freeze()
    if code == INTERRUPTED_EXIT_CODE:
        # Ctrl-C: what is ours is closed and said (one line). The interpreter's teardown would add torch's
        # "unwaited collective calls" warning for each functional collective the interrupt left in flight (cp's
        # and tp's all-gathers), printed by the process's static destructors: after our line, or from a rank
        # that exits first, before it. Leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
