"""Start a launcher (accelerate launch, torchrun) and, when it must stop, stop ALL of it.

torchrun starts each rank in a session of its own (measured), so killing the launcher, or even its
process group, leaves the ranks running: they finish the run on their own and keep writing into a
folder the caller already reported as failed. `run_process_tree` ends every descendant by pid on a
timeout or an interrupt, and returns only once they are all gone.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from dataclasses import dataclass

import psutil

TIMED_OUT = -1000  # returncode of a command ended by its timeout (no real exit status is negative that far)


@dataclass
class Finished:
    returncode: int  # TIMED_OUT when the timeout ended it
    stdout: str
    stderr: str


def end_with(launcher_pid: int, every_s: float = 0.2) -> None:
    """End this process when the process `launcher_pid` ends, however it ends (a SIGKILL gives it no chance to end
    its children): the kernel's parent-death signal where the launcher is this process's parent, and a thread that
    looks every `every_s` (a process started by a fork server has the server for a parent, and waits inside a
    library, torchft's quorum retries, would never look). For the processes an experiment starts itself."""
    import ctypes
    import os
    import threading
    import time

    launcher = psutil.Process(launcher_pid)  # its start time too: a pid reused later is not the launcher
    if os.getppid() == launcher_pid:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def launcher_alive() -> bool:
        try:
            return launcher.is_running() and launcher.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch() -> None:
        while launcher_alive():
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGKILL)  # as the launcher ended: no cleanup, nothing left behind

    threading.Thread(target=watch, name="end-with-launcher", daemon=True).start()


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and every descendant (children of children, whatever their session)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int, wait_s: float = 30) -> None:
    """SIGKILL the process and all its descendants, and wait until none is left."""
    victims = process_tree(pid)
    for process in victims:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    _gone, alive = psutil.wait_procs(victims, timeout=wait_s)
    if alive:
        raise RuntimeError(f"processes {[p.pid for p in alive]} survived SIGKILL for {wait_s} s")


def run_process_tree(command: list[str], timeout_s: float, capture: bool = True, **popen_kwargs) -> Finished:
    """subprocess.run, except that a timeout or Ctrl-C kills the whole tree before returning/raising.
    With capture=False the caller passes stdout/stderr itself (e.g. a log file)."""
    if capture:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process = subprocess.Popen(command, start_new_session=True, **popen_kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        return Finished(process.returncode, stdout or "", stderr or "")
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        stdout, stderr = process.communicate()
        return Finished(
            TIMED_OUT, stdout or "", (stderr or "") + f"\n[killed after {timeout_s:.0f} s timeout]\n"
        )
    except BaseException:  # KeyboardInterrupt, or the caller's own failure: no orphans either way
        kill_tree(process.pid)
        raise


def free_port() -> int:
    """A port free on this machine now (for a process group's store)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def take_environment(environment: dict[str, str]) -> None:
    """This process's environment replaced by `environment`: a process forked from a fork server has the server's,
    from when it started (maybe long before), not its launcher's now. Its OMP_NUM_THREADS, if any, applied to torch
    too: torch read the variable when the server imported it."""
    import os

    os.environ.clear()
    os.environ.update(environment)
    if "OMP_NUM_THREADS" in environment:
        import torch

        torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))


def torchrun_rank(main, argv: list[str], rank: int, world: int, port: int, gpus: list[int], log: str,
                  launcher_pid: int, environment: dict[str, str]) -> None:  # fmt: skip
    """A process an experiment starts itself (from a fork server): the environment torchrun gives rank `rank` of
    `world` (none for one process) on top of the launcher's `environment` at the start (a fork server's own is the
    one it started with, maybe long before), its GPUs (`gpus`, CUDA_VISIBLE_DEVICES), its output in `log`, then
    `main(argv)`; its exit code main's (2 for a UsageError). It ends when the launcher does, however that ends, and
    runs under the GPU rehearsal when the run is one."""
    import os
    import sys
    import threading
    import traceback

    import torch

    from common.config import UsageError
    from common.rehearsal import rehearse_if_asked

    end_with(launcher_pid)
    take_environment(environment)
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # a Ctrl-C is the launcher's to handle: it ends every process
    output = open(log, "w", buffering=1)  # noqa: SIM115
    os.dup2(output.fileno(), 1)  # its own output (torchft's HTTP log, c10d's timeouts) in its own file
    os.dup2(output.fileno(), 2)
    sys.stdout = sys.stderr = output
    if gpus:  # a GPU a process (NCCL's rule)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    # tqdm's default lock is a multiprocessing one, registered with the launcher's resource tracker: a rank killed by
    # SIGKILL (a fault injected) never unregisters it, and the launcher warns of "leaked semaphores" at its exit. One
    # process writes these bars: a thread lock is enough
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    code = 1
    try:
        with rehearse_if_asked():
            code = main(argv)
    except UsageError as error:
        print(f"error: {error}")
        code = 2
    except BaseException:
        traceback.print_exc()
    finally:
        output.flush()
        # multiprocessing's exit: its finalizers run, then os._exit (no library thread is waited for)
        sys.exit(code or 0)


class RankGroup:
    """One launch an experiment starts itself: `main(argv)` on `world` processes from `context` (a fork server's),
    each with torchrun's environment for its rank (torchrun_rank), its GPUs of `gpus`, logging to `log`.<rank>.log.
    Its rank 0 speaks for it."""

    def __init__(self, context, main, argv: list[str], world: int, gpus: list[int], log: str):
        import os

        port = free_port()
        self.processes = [context.Process(target=torchrun_rank, args=(main, argv, rank, world, port, gpus,
                                                                      f"{log}.{rank}.log", os.getpid(), dict(os.environ)))
                          for rank in range(world)]  # fmt: skip
        for process in self.processes:
            process.start()

    @property
    def pid(self) -> int:
        return self.processes[0].pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def is_alive(self) -> bool:
        return any(p.is_alive() for p in self.processes)

    def kill(self, timeout_s: float | None = None) -> None:
        """SIGKILL, every process of it (those still alive), each waited for (at most `timeout_s`)."""
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(timeout=timeout_s)
