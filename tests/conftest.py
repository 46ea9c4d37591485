"""pytest set-up: the repository root on sys.path (experiments and common import as packages).
Helpers live in tests/helpers.py; tests that start processes are marked `launch` (`pytest -m "not launch"`
is the fast tier)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import os  # noqa: E402

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
    # several workers on this machine's cores: one torch thread each, as Accelerate gives each rank of a
    # CPU launch, instead of every worker taking every core (oversubscribed GEMMs slow down many-fold)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# The files that take longest, longest first (measured durations, this machine). xdist hands each worker a
# whole file at a time in collection order (--no-loadscope-reorder in pyproject.toml): a long file handed
# out last would run alone at the end while the other worker idles. The others keep their order.
LONGEST_FIRST = (  # measured 2026-12-05 (pytest --durations=120: each file's tests' seconds summed)
    "test_train_gpt_layouts.py",
    "test_deepspeed.py",
    "test_benchmarks.py",  # one test of ~57 s: never last
    "test_tools_sweep.py",
    "test_train_gpt_pipeline.py",
    "test_resume.py",
    "test_train_gpt_checkpoints.py",
    "test_performance.py",  # one test of ~38 s
    "test_train_gpt_tensor_parallel.py",
    "test_fault_tolerance.py",
    "test_checkpoint_integrity.py",
    "test_ddp_linear.py",
    "test_reliability.py",
    "test_at_scale.py",
    "test_moe.py",
    "test_train_gpt.py",
    "test_manual_data_parallel.py",
    "test_pipeline_parallel.py",
    "test_loss_normalization.py",
    "test_train_gpt_context_parallel.py",
    "test_activation_checkpointing.py",
    "test_one_module.py",
    "test_faults.py",
    "test_model_parallel.py",
    "test_collectives_bench.py",
)


def pytest_collection_modifyitems(items):
    order = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable within a file
