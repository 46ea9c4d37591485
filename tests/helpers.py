"""Shared test helpers: run an experiment for real (accelerate launch / torchrun / python) and read its results.
Every launch goes through common/processes.py: a test that times out ends every rank it started."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.processes import TIMED_OUT, kill_tree, process_tree, run_process_tree, take_environment  # noqa: E402  (repo on sys.path)

CPU_DDP = str(REPO / "accelerate_configs" / "cpu_ddp.yaml")
# train_gpt on a ~20k-parameter GPT, 12 steps: seconds per run. Parity over the first 6 steps. 2 % of pydoc topics
# for validation (~3,000 tokens; the default 10 % made the two evaluations ~20 % of a rank's time, py-spy)
GPT_TINY = (
    "--report_to none --max_steps 12 --parity_steps 6 --log_every 6 --d_model 32 --n_layer 2 --n_head 2 "
    "--block_size 32 --vocab_size 512 --val_fraction 0.02 --warmup_steps 2 --sample_tokens 5 --min_loss_drop 0.1"
).split()
# train_gpt's tiny run, without the GPT's shape flags (the config sets the shape)
HF_TINY = ("--report_to none --max_steps 12 --parity_steps 6 --log_every 6 --block_size 32 --vocab_size 512 "
           "--val_fraction 0.02 --warmup_steps 2 --sample_tokens 5 --min_loss_drop 0.1").split()  # fmt: skip
GPT_DISTRIBUTED_CHECKS = {
    "distributed",
    "loss_decreased",
    "memory_per_rank",
    "matches_single_process",
    "grad_norm_is_global",
    "communication_volume",
}
LAUNCH_TIMEOUT_S = 240  # a 2-rank tiny run takes ~10 s here; this only bounds a hang
FORK_TIMEOUT_S = 120  # forked ranks: the longest forked run here takes ~35 s on the loaded 2 cores


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**overrides: str) -> dict:
    """The test's environment: no W&B credentials or mode from the developer's shell, no accelerate
    default config from ~/.cache, so a test sees what a fresh machine sees."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_"))}
    env.update(overrides)
    return env


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.output_dir / "summary.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.output_dir / "metrics.jsonl").read_text().splitlines()]


def launch(
    script: str,
    args: list[str],
    output_dir: Path,
    *,
    config: str | None = CPU_DDP,
    launcher: str = "accelerate",
    env: dict | None = None,
    timeout: float = LAUNCH_TIMEOUT_S,
    num_processes: int | None = None,
) -> Finished:
    """Run experiments/<script> through a real launcher. launcher: accelerate | torchrun | python."""
    program = str(REPO / "experiments" / script)
    if launcher == "accelerate":
        command = [sys.executable, "-m", "accelerate.commands.launch"]
        if config:
            command += ["--config_file", config, "--main_process_port", str(free_port())]
        if num_processes:
            command += ["--num_processes", str(num_processes)]
        command += [program]
    elif launcher == "torchrun":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(num_processes or 2),
            "--master_port",
            str(free_port()),
            program,
        ]
    else:
        command = [sys.executable, program]
    command += ["--output_dir", str(output_dir), *args]
    if env is None:
        home = output_dir.parent / "home"
        home.mkdir(exist_ok=True)
        env = clean_env(HOME=str(home))
    done = run_process_tree(command, timeout, env=env, cwd=REPO)
    assert done.returncode != TIMED_OUT, (
        f"{script} ran past its {timeout} s timeout (every process ended):\n{done.stderr[-3000:]}"
    )
    return Finished(done.returncode, done.stdout, done.stderr, output_dir)


def fork_launch(
    main,
    args: list[str],
    output_dir: Path,
    num_processes: int = 2,
    env: dict | None = None,
    config: str | None = None,
    output_flag: bool = True,
) -> Finished:
    """`main(argv)` of an experiment (argv: `--output_dir output_dir` unless not output_flag, then args) on
    `num_processes` real gloo ranks, each FORKED from a fork server: a clean process that multiprocessing
    starts once per test process, with torch, Accelerate and the experiments already imported. The ranks
    skip the ~3 s of imports a fresh interpreter costs, get the environment `torchrun` gives (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, one thread each) on top of this process's at the call (less its W&B and
    Accelerate settings, as clean_env) and `env`, and
    train, communicate and check exactly as under `accelerate launch`. For what a fresh process shows
    (exit codes and stderr lines, kills, timeouts, the launcher's own behaviour) use `launch`; every
    experiment keeps at least one `launch` smoke test. The returncode is the ranks' largest exit code;
    stdout and stderr are the ranks' own, rank by rank. config: an accelerate config whose settings the
    ranks see as `accelerate launch --config_file` sets them (launch_environment reads them from the
    launcher itself).

    Why a fork server and not a fork of this process (Accelerate's notebook_launcher): this process runs
    threads (xdist's execnet, tqdm's monitor), and a rank forked while one of them held a lock deadlocked
    on it: ranks hung in 4 of ~8 full-suite runs (a deepcopy's garbage collection, Accelerate's
    gc.collect(), ddp_linear's first line). The fork server has no thread but its own."""
    import torch
    import torch.multiprocessing as mp

    codes = output_dir.parent / f"{output_dir.name}.exit_codes"
    codes.mkdir(parents=True, exist_ok=True)
    environment = {
        **clean_env(),  # as `launch`: no W&B or Accelerate settings from the developer's shell
        **(launch_environment(config) if config else {}),
        **(env or {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(num_processes),
        "LOCAL_WORLD_SIZE": str(num_processes),
    }
    # as torchrun: one thread per rank unless told otherwise (the test process's own share of the cores if 1 rank)
    environment.setdefault("OMP_NUM_THREADS", "1" if num_processes > 1 else str(torch.get_num_threads()))
    argv = ["--output_dir", str(output_dir), *args] if output_flag else list(args)
    _start_fork_server()
    ranks = mp.start_processes(_rank, args=(main, argv, str(codes), environment), nprocs=num_processes,
                               join=False, start_method="forkserver")  # fmt: skip
    deadline = time.monotonic() + FORK_TIMEOUT_S
    try:
        while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
            assert time.monotonic() < deadline, f"forked ranks ran past {FORK_TIMEOUT_S} s: {output_dir}"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                kill_tree(process.pid)
    returncode = max(int(path.read_text()) for path in codes.glob("rank*.code"))
    stdout, stderr = ("".join(path.read_text(errors="replace") for path in sorted(codes.glob(f"rank*.{name}")))
                      for name in ("stdout", "stderr"))  # fmt: skip
    return Finished(returncode, stdout, stderr, output_dir)


@functools.cache
def _start_fork_server() -> None:
    """Start the fork server every forked process of this test process comes from (fork_launch's ranks, and the
    fault-tolerance groups and at_scale's fake ranks of the experiments a test runs in this process), once, having
    imported what their ranks import (~4 s): torch._dynamo, which every rank imports on its first optimizer
    (torch.optim's _disable_dynamo: 0.5-1 s a rank, measured with -X importtime); DeepSpeed, whose import runs a
    torch.compile (1-2 s a rank); the pipeline (0.6 s a rank); the plots rank 0 draws (matplotlib, 0.7 s); the
    transformers models of the presets (scipy and all: ~3 s a rank). Started before any test of the slow tier
    (conftest.py), so that an experiment's own fork server (the same one: one a process) cannot start first with
    a shorter list. torchft is not here: its Rust runtime must not be forked."""
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "torch._dynamo",
            "torch.distributed.pipelining",
            "accelerate",
            "deepspeed",
            "tokenizers",
            "matplotlib.figure",
            "torch.distributed.checkpoint",  # every run's checks read its state (0.7 s a rank, py-spy)
            "torch.distributed.checkpoint.state_dict",
            "experiments.train_gpt",
            "experiments.ddp_linear",
            "planning.fake_ranks",
            "transformers.models.llama.modeling_llama",
            "transformers.models.qwen2.modeling_qwen2",
            "transformers.models.mistral.modeling_mistral",
            "transformers.models.mixtral.modeling_mixtral",
        ]
    )
    multiprocessing.forkserver.ensure_running()


def fork_the_launches(monkeypatch, *also_in) -> list[list[str]]:
    """From here to the test's end, every `accelerate launch` or `torchrun` command of a repo script that a program
    hands common.processes.run_process_tree (a benchmark's runs, a sweep's trials; `also_in`: modules that imported
    the function by name) runs on forked ranks (fork_launch) instead of a launcher and fresh interpreters: the
    program's own work (what it runs, with which flags, what it reads back and reports) is what the test is about;
    the launchers are tested by the tests of experiments launched for real. The command is read by the launcher's
    own parser, so one the launcher would refuse fails here too. Any other command runs as before. Returns the
    commands forked, in order."""
    import common.processes

    real, forked = common.processes.run_process_tree, []

    def run_process_tree_forking(command, timeout_s, capture=True, **popen_kwargs):
        launch = parse_launch(command)
        if launch is None:
            return real(command, timeout_s, capture, **popen_kwargs)
        forked.append(command)
        script, script_args, ranks, config = launch
        with tempfile.TemporaryDirectory() as folder:
            finished = fork_launch(_script_main, [script, *script_args], Path(folder) / "ranks", num_processes=ranks,
                                   env=popen_kwargs.get("env"), config=config, output_flag=False)  # fmt: skip
        if not capture:  # the caller's own files (a sweep's trial.log)
            for name in ("stdout", "stderr"):
                if (stream := popen_kwargs.get(name)) is not None:
                    stream.write(getattr(finished, name))
                    stream.flush()
        return common.processes.Finished(finished.returncode, finished.stdout, finished.stderr)

    for module in (common.processes, *also_in):
        monkeypatch.setattr(module, "run_process_tree", run_process_tree_forking)
    return forked


def parse_launch(command: list[str]):
    """(script, its args, ranks, accelerate config or None) of a launch of a script in this repository:
    `[/usr/bin/env] accelerate launch ...` or `python -m accelerate.commands.launch ...` (read by Accelerate's own
    parser), `python -m torch.distributed.run ...` (torchrun's); relative paths from this process's directory, where
    the launch would start. None for any other command."""
    words = command[1:] if command[:1] in (["/usr/bin/env"], ["env"]) else list(command)
    if words[:2] == ["accelerate", "launch"]:
        words = ["python", "-m", "accelerate.commands.launch", *words[2:]]
    if len(words) < 3 or words[1] != "-m":
        return None
    if words[2] == "accelerate.commands.launch":
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(words[3:])
        config = str(Path(args.config_file).resolve()) if args.config_file else None
        script, script_args, ranks = args.training_script, args.training_script_args, args.num_processes
        if ranks is None:  # from the config, as the launcher reads it
            import yaml

            ranks = yaml.safe_load(Path(config).read_text())["num_processes"] if config else 1
    elif words[2] == "torch.distributed.run":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(words[3:])
        script, script_args, ranks, config = (
            args.training_script,
            args.training_script_args,
            args.nproc_per_node,
            None,
        )
    else:
        return None
    script = Path(script).resolve()
    if not script.is_relative_to(REPO):
        return None
    return str(script), list(script_args), int(ranks), config


def _script_main(argv: list[str]):
    """A forked rank of `python <argv[0]> <argv[1:]>`: the script's module's main, with its arguments (or, for a
    main that reads sys.argv, with sys.argv set)."""
    import importlib
    import inspect

    script, args = argv[0], argv[1:]
    module = importlib.import_module(".".join(Path(script).resolve().relative_to(REPO).with_suffix("").parts))
    sys.argv = [script, *args]
    return module.main(args) if inspect.signature(module.main).parameters else module.main()


@functools.cache
def launch_environment(config: str) -> dict[str, str]:
    """The ACCELERATE_* variables `accelerate launch --config_file <config>` gives its ranks, read from a
    real launch of a script that only writes them down (once per config and test process)."""
    with tempfile.TemporaryDirectory() as folder:
        dump = Path(folder) / "environment.json"
        script = Path(folder) / "dump.py"
        script.write_text(
            "import json, os, sys\n"
            "if os.environ.get('RANK', '0') == '0':\n"
            "    seen = {k: v for k, v in os.environ.items() if k.startswith('ACCELERATE_')}\n"
            "    open(sys.argv[1], 'w').write(json.dumps(seen))\n"
        )
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
                   "--main_process_port", str(free_port()), str(script), str(dump)]  # fmt: skip
        finished = run_process_tree(command, LAUNCH_TIMEOUT_S, env=clean_env(), cwd=REPO)
        assert dump.exists(), finished
        return json.loads(dump.read_text())


def _rank(index: int, main, argv: list[str], codes: str, environment: dict) -> None:
    """One forked rank: the environment torchrun gives rank `index`, then main(argv); its exit code, stdout
    and stderr written where fork_launch reads them."""
    import gc

    import torch.distributed as dist

    from common.config import UsageError
    from common.rehearsal import RehearsalFailure, rehearse_if_asked

    # the ~330,000 objects the fork server imported never become garbage: out of every collection (each
    # gc.collect() at the run's end walked them all, 0.17 s; several a rank, measured)
    gc.freeze()
    # with its OMP_NUM_THREADS (fork_launch always sets one) applied to torch
    take_environment({**environment, "RANK": str(index), "LOCAL_RANK": str(index)})
    # this fork's output only, both the fds (C++ warnings) and sys.stdout/stderr (pytest may have replaced them)
    sys.stdout = open(os.path.join(codes, f"rank{index}.stdout"), "w", buffering=1)  # noqa: SIM115
    sys.stderr = open(os.path.join(codes, f"rank{index}.stderr"), "w", buffering=1)  # noqa: SIM115
    os.dup2(sys.stdout.fileno(), 1)
    os.dup2(sys.stderr.fileno(), 2)
    try:
        with rehearse_if_asked():  # DIST_REHEARSAL in `env`: as run_cli does for a launched program
            code = main(argv)
    except SystemExit as stop:
        code = stop.code
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        code = 2
    except RehearsalFailure as failure:
        print(f"error: {failure}", file=sys.stderr)
        code = 1
    except Exception:
        # a rank that crashed (another rank's failure cut its collective): its traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    with open(os.path.join(codes, f"rank{index}.code"), "w") as handle:
        handle.write(str(code or 0))


def assert_gpt_passed(finished: Finished, world_size: int) -> dict:
    """train_gpt exited 0 with every check passed on `world_size` ranks; its summary."""
    # a failed check is one line of stdout; the traceback, if any, the end of stderr
    failed = [line for line in finished.stdout.splitlines() if line.startswith("check ") and " FAIL" in line]
    assert finished.returncode == 0, "\n".join(failed) + "\n" + finished.stderr[-3000:]
    summary = finished.summary
    assert summary["passed"] and summary["world_size"] == world_size, summary["checks"]
    return summary


def assert_data_parallel_facts(summary: dict, strategy: str) -> None:
    """What a ddp / zero2 / fsdp run on 2 ranks must show, whichever test launched it: parity with one
    process, the bytes each rank holds, and the bytes one step sends."""
    metrics = summary["metrics"]
    assert metrics["loss_max_abs_diff"] < 1e-5 and metrics["param_max_abs_diff"] < 1e-4
    held, full = metrics["bytes_per_rank"], 4 * metrics["parameters"]
    counted = metrics["communication"]["counted"]["bytes"]
    if strategy == "ddp":  # every rank holds everything; every gradient all-reduced once
        assert all(h["params"] == full and h["optimizer"] > 2 * full for h in held)
        assert counted == {"all_reduce": full}
        return
    # ZeRO: parameters, gradients and optimizer state at rest are halves on 2 ranks
    assert all(h["params"] == h["grads"] == full // 2 for h in held)
    window = held[0]["params_between_forward_and_backward"]
    assert window == full if strategy == "zero2" else full // 2 < window < full  # ZeRO-3 frees the blocks
    # every parameter gathered once (zero2) or the blocks' twice (fsdp); every gradient reduce-scattered
    assert counted["reduce_scatter"] == full
    assert counted["all_gather"] == full if strategy == "zero2" else full < counted["all_gather"] < 2 * full


def run_main_in_process(main, argv: list[str], capsys) -> tuple[int, str]:
    """An experiment's main(argv) in this process, exit code and stderr as `run_cli` gives them: for
    bad-input tests, which need no second process (a subprocess costs ~3 s of `import torch`)."""
    code, _stdout, stderr = _main_in_process(main, argv, capsys)
    return code, stderr


def run_in_process(main, args: list[str], output_dir: Path, capsys) -> Finished:
    """A one-process run (`python experiments/<script>`) without the second interpreter: same main(),
    same output files, ~0.3 s instead of ~3 s of imports. Multi-rank runs always go through a launcher."""
    code, stdout, stderr = _main_in_process(main, ["--output_dir", str(output_dir), *args], capsys)
    return Finished(code, stdout, stderr, output_dir)


def _main_in_process(main, argv: list[str], capsys) -> tuple[int, str, str]:
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    from common.config import UsageError

    # each call starts from a fresh Accelerate state, as a new process would
    AcceleratorState._reset_state(True)
    if capsys is not None:  # None: a module fixture's run, whose output nobody reads
        capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # the parser's exit 2, or a run that ended early (RunEnded)
        code = stop.code
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        code = 2
    finally:
        if dist.is_initialized():  # a run that failed mid-way: what run_cli does at the end of a real process
            dist.destroy_process_group()
        AcceleratorState._reset_state(True)
    if capsys is None:
        return code, "", ""
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def wandb_history(run_dir: str) -> list[dict]:
    """The history records of an offline W&B run, read back without a server (`wandb leet inspect`):
    one dict per logged step, e.g. {"_step": 20, "loss": ..., "bench_plot._type": ...}."""
    import subprocess

    inspected = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", run_dir],
                               capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    records = (json.loads(line) for line in inspected.stdout.splitlines())
    return [record["history"]["item"] for record in records if record.get("type") == "history"]


def start_and_kill_every_process(command: list[str], env: dict, until) -> None:
    """Start a launch, wait for `until()`, then SIGKILL the launcher AND its ranks by pid (torchrun
    starts each rank in a session of its own: killing the launcher's group would leave them running)."""
    victim = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while not until():
        assert victim.poll() is None and time.monotonic() < deadline, "the run ended before the kill point"
        time.sleep(0.02)
    everyone = process_tree(victim.pid)
    assert len(everyone) >= 3, "expected the launcher and at least two ranks"
    kill_tree(victim.pid)
    victim.wait(timeout=30)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everyone), (
        "a process survived the kill"
    )


def tiny_gpt_kept_bytes(mode: str = "none") -> int:
    """What ONE process keeps for backward from one rank's batch of GPT_TINY's model (4 rows of 32 tokens)
    under activation checkpointing `mode`, the rows as train_gpt's ranks get them: their own rows, moved to the
    run's device (a copy of their share of the global batch: under a CPU launch accelerator.device is cpu:0)."""
    import torch

    from common.activations import SavedActivations
    from common.gpt import GPTConfig, build_gpt, lm_loss
    from strategies import activation_checkpointing

    model = build_gpt(GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, d_model=32), 0)
    activation_checkpointing.apply(model, mode)
    x, y = (torch.zeros(4, 32, dtype=torch.long) for _ in "xy")
    with SavedActivations() as saved:
        lm_loss(model(x), y)
    return saved.bytes
