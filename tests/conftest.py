"""pytest set-up: the repository root on sys.path (experiments and common import as packages).
Helpers live in tests/helpers.py; tests that start processes are marked `launch` (`pytest -m "not launch"`
is the fast tier)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import os  # noqa: E402

# This machine's image sets PYTHONDONTWRITEBYTECODE=1: every fresh interpreter a test starts (~170 a run) compiled
# the project's modules again (0.3 s of train_gpt's 3.4 s import, measured). The suite caches them as a developer's
# checkout does (__pycache__/ is ignored by git), in its own processes and in those they start.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
    # several workers on this machine's cores: one torch thread each, as Accelerate gives each rank of a
    # CPU launch, instead of every worker taking every core (oversubscribed GEMMs slow down many-fold). Only in
    # a worker: xdist's controller, which imports this file too, needs no torch (2 s before any worker starts)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# The files that take longest, longest first (measured durations, this machine). xdist hands each worker a
# whole file at a time in collection order (--no-loadscope-reorder in pyproject.toml): a long file handed
# out last would run alone at the end while the other worker idles. The others keep their order.
LONGEST_FIRST = (  # measured 2026-12-06 02:46 UTC (pytest --durations=0: each file's tests' seconds summed)
    "test_rehearsal.py",  # ~100 s (2026-12-07, AMD EPYC VM): every layout and experiment under the rehearsal
    "test_resume.py",  # 84 s
    "test_deepspeed.py",  # 80 s
    "test_benchmarks.py",  # one test of ~70 s: never last
    "test_tools_sweep.py",  # 70 s
    "test_reliability.py",  # 69 s
    "test_train_gpt_layouts.py",  # 62 s
    "test_at_scale.py",  # 61 s
    "test_performance.py",  # one test of ~59 s
    "test_train_gpt_checkpoints.py",
    "test_ddp_linear.py",
    "test_checkpoint_integrity.py",
    "test_moe.py",
    "test_fault_tolerance.py",
    "test_train_gpt_tensor_parallel.py",
    "test_train_gpt.py",
    "test_train_gpt_pipeline.py",
    "test_manual_data_parallel.py",
    "test_pipeline_parallel.py",
    "test_model_parallel.py",
    "test_loss_normalization.py",
    "test_one_module.py",
    "test_collectives_bench.py",
    "test_collectives.py",
    "test_plan.py",
    "test_activation_checkpointing.py",
    "test_train_gpt_context_parallel.py",
)


def pytest_runtest_setup(item):
    # the slow tier's processes fork from one server (helpers._start_fork_server)
    if item.get_closest_marker("launch"):
        from helpers import _start_fork_server

        _start_fork_server()


def pytest_collection_finish(session):
    # what the imports and the test modules made lives until the end: out of every collection. Each in-process
    # run's end collects (common/run.shutdown, Accelerate's free_memory), and pytest collects five times at a
    # worker's end: each walked the ~330,000 objects torch and the project import, 0.2-0.4 s, ~40 times a run
    # of the fast tier (measured). The tests' own objects are collected as ever.
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items):
    order = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable within a file
