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

import json
import math
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
from tools.sweep_leaderboard import write_leaderboard
from tools.sweep_run import run_sweep
from tools.sweep_validate import validate_sweep


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
