"""pytest set-up: the repository root on sys.path (experiments and common import as packages).
Helpers live in tests/helpers.py; tests that start processes are marked `launch` (`pytest -m "not launch"`
is the fast tier)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
