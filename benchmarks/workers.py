"""What the benchmark scripts share: start a worker under torchrun and read back its JSON figures.

Every distributed benchmark is one script with two roles: the driver (what you run) starts
`torchrun --nproc_per_node N <script> --worker ...`, the workers measure side by side in one run and
rank 0 writes its figures to a JSON file that the driver returns. Threads: 1 per rank, as torchrun sets.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dated_folder(output_dir: str, program: str):
    """A new <output_dir>/<UTC time>/ for one run of a benchmark (never an existing one), or None after
    saying why on stderr."""
    import datetime
    from pathlib import Path

    folder = Path(output_dir).resolve() / datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    try:
        folder.mkdir(parents=True, exist_ok=False)
    except OSError as error:
        print(f"{program}: cannot make --output_dir {folder}: {error.strerror}", file=sys.stderr)
        return None
    return folder


def accelerate_launch(script: str, flags: list[str], num_processes: int = 2, config: str = "") -> list[str]:
    """`accelerate launch` of a repo script with an accelerate config (default the 2-rank CPU one; its
    --num_processes overridden)."""
    config = os.path.join(REPO, config or os.path.join("accelerate_configs", "cpu_ddp.yaml"))
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
            "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
            os.path.join(REPO, script), *flags]  # fmt: skip


def run_one_thread_per_rank(command: list[str], log_path: str, timeout_s: float):
    """Run a launch (common/processes.run_process_tree) with one thread per rank, the one-process run
    included (torch would take every core), as torchrun and accelerate launch set it for several ranks:
    throughput per rank compares, and MFU has one peak. The console goes to `log_path`."""
    from common.processes import run_process_tree

    done = run_process_tree(command, timeout_s, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(log_path, "w") as handle:
        handle.write(done.stdout + done.stderr)
    return done


def cpu_clock() -> tuple[float, float, float] | None:
    """Now, for others_share: (CPU seconds every process on this machine has used since boot, /proc/stat's
    user + nice + system + irq + softirq; CPU seconds this process and its finished children used; wall
    seconds). None where there is no /proc/stat."""
    import resource
    import time

    try:
        with open("/proc/stat") as handle:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, handle.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    own = sum(usage.ru_utime + usage.ru_stime
              for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))  # fmt: skip
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), own, time.monotonic()


def others_share(before, after) -> float | None:
    """The share of the machine's cores that processes other than this one and its children (a launch and its
    ranks, once finished) used between two cpu_clock()s: a timing taken while something else ran on the cores
    reads slow (here, calibrations run while other work ran spread a 4-rank layout's rounds by up to a third, and
    by up to 11 % with nothing else running)."""
    if before is None or after is None:
        return None
    machine, own, wall = (a - b for a, b in zip(after, before, strict=True))
    return max(0.0, machine - own) / max(wall * (os.cpu_count() or 1), 1e-9)


def run_for_summary(command: list[str], run_dir, timeout_s: float) -> dict:
    """One experiment launch (run_one_thread_per_rank, its console in <run_dir>.log): the summary.json it
    wrote in run_dir, or {"error": what went wrong}."""
    import json
    from pathlib import Path

    from common.processes import TIMED_OUT

    done = run_one_thread_per_rank(command, f"{run_dir}.log", timeout_s)
    summary = Path(run_dir) / "summary.json"
    if done.returncode == TIMED_OUT or not summary.exists():
        reason = "timed out" if done.returncode == TIMED_OUT else f"exit {done.returncode}, no summary"
        return {"error": f"{reason}: see {run_dir}.log"}
    return json.loads(summary.read_text())


def checks_verdict(summary: dict) -> str:
    """'all passed', or 'FAILED: ' and the checks that failed."""
    failed = [name for name, check in summary["checks"].items() if check["passed"] is False]
    return "all passed" if not failed else "FAILED: " + ", ".join(failed)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(script: str, nproc: int, args: list[str], timeout_s: float = 900) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        result_path = os.path.join(folder, "result.json")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            os.path.join(REPO, "benchmarks", script),
            "--worker",
            "--result",
            result_path,
            *args,
        ]
        # TMPDIR: torchrun's own torchelastic_* folder goes in here too, and is removed with it
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "TMPDIR": folder}
        from common.processes import run_process_tree

        # a timeout ends every rank, not only torchrun
        done = run_process_tree(command, timeout_s, env=env, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"{script} workers failed ({done.returncode}):\n{done.stderr[-3000:]}")
        with open(result_path) as handle:
            return json.load(handle)


def benchmark_parser(doc: str, has_workers: bool = False) -> argparse.ArgumentParser:
    """Every benchmark's command line: --quick, plus the hidden --worker / --result that `spawn` passes."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="seconds, not minutes: checks the figures are well-formed"
    )
    if has_workers:
        parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    return parser


def run_worker(worker, args) -> None:
    """A worker process's whole life: measure (`worker` returns its Accelerator), then the same shutdown
    as every run (common/run.py): wait for every rank, free the prepared models, destroy the group.
    Ending on Accelerate's end_training() instead aborted a rank ("terminate called without an active
    exception") in the suite."""
    from common.run import shutdown

    shutdown(worker(args))


def scratch_folder(args) -> str:
    """A worker's scratch space: the folder of its --result file, which `spawn` deletes afterwards."""
    return os.path.dirname(os.path.abspath(args.result)) if args.result else tempfile.mkdtemp()


def command_line(module: str, argv: list[str] | None) -> str:
    """The command a benchmark's table names, runnable as printed: a flag's value with spaces quoted (a table
    printed `--model_flags --n_layer 4 ...`, which its parser refuses)."""
    import shlex

    return f"python -m {module} {shlex.join(argv if argv is not None else sys.argv[1:])}".strip()


def write_table(folder, name: str, table: str, payload, also: str = "") -> None:
    """A benchmark's table: <folder>/<name>.md (the markdown the docs take) and <name>.json (its figures), the
    table printed, then what was written (`also`: the other files it wrote, as ", a.png")."""
    (folder / f"{name}.md").write_text(table)
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=2))
    print(table)
    print(f"written: {folder}/{name}.md, {name}.json{also}")


def write_result(path: str, payload: dict) -> None:
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
