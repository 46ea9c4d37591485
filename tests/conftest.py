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
