"""Benchmark 5: how long from `accelerate launch` to the first training step, and where does it go?

- import cost per package, in a fresh interpreter, in the order an experiment imports them (torch,
  then accelerate, datasets, wandb on top: each figure is that package's own share), median of runs;
- end to end: wall time from starting `accelerate launch` (2 CPU ranks) to ddp_linear's first
  training step (the experiment records the wall-clock time of its first step in summary.json);
- whether wandb is imported at all when it is not the tracker (it must not be).

    python benchmarks/startup.py [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workers import REPO, benchmark_parser, free_port, median

IMPORT_CHAIN = ("torch", "accelerate", "datasets", "wandb")
TIME_IMPORTS = (
    "import importlib, json, time\n"
    "seconds = {}\n"
    f"for name in {IMPORT_CHAIN!r}:\n"
    "    started = time.perf_counter(); importlib.import_module(name); seconds[name] = time.perf_counter() - started\n"
    "print(json.dumps(seconds))\n"
)


def import_seconds() -> dict:
    """Each package's own import cost, imported in a fresh interpreter in the order an experiment does."""
    done = subprocess.run([sys.executable, "-c", TIME_IMPORTS], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> dict:
    repeats = 1 if quick else 3
    samples = [import_seconds() for _ in range(repeats)]
    imports = {name: median([sample[name] for sample in samples]) for name in IMPORT_CHAIN}
    wandb_loaded = (
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; sys.argv = ['x', '--help']\n"
                "import runpy\ntry:\n    runpy.run_path('experiments/ddp_linear.py', run_name='not_main')\nfinally:\n"
                "    print('wandb' in sys.modules)",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        .stdout.strip()
        .splitlines()[-1]
        == "True"
    )
    launches = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            started = time.time()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "accelerate.commands.launch",
                    "--config_file",
                    os.path.join(REPO, "accelerate_configs", "cpu_ddp.yaml"),
                    "--main_process_port",
                    str(free_port()),
                    os.path.join(REPO, "experiments", "ddp_linear.py"),
                    "--output_dir",
                    folder,
                    "--report_to",
                    "none",
                    "--max_steps",
                    "5",
                ],
                capture_output=True,
                cwd=REPO,
            )
            # 5 steps do not recover the truth (exit 1): only the recorded first-step time matters here
            with open(os.path.join(folder, "summary.json")) as handle:
                launches.append(json.load(handle)["metrics"]["first_step_unix_time"] - started)
    result = {
        "imports_s": imports,
        "launch_to_first_step_s": median(launches),
        "wandb_imported_without_wandb_tracker": wandb_loaded,
    }
    print(
        "startup: imports "
        + ", ".join(f"{k} {v:.2f} s" for k, v in imports.items())
        + f"; accelerate launch -> first step (2 ranks) {result['launch_to_first_step_s']:.2f} s; "
        f"wandb imported when not the tracker: {wandb_loaded}"
    )
    return result


def main() -> None:
    parser = benchmark_parser(__doc__)
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
