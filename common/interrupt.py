"""Ctrl-C while a program is still importing (torch takes seconds) says one line and exits 130, as a Ctrl-C
during the run does (common/config.run_cli), instead of an import's traceback. Installed only when a file runs
as a program (`if __name__ == "__main__"` at its top, before its heavy imports): importing an experiment leaves
the process's excepthook as it was."""

from __future__ import annotations

import os
import sys


def one_line_on_ctrl_c(program: str) -> None:
    """An excepthook that says a KeyboardInterrupt in one line (the main process only; the interpreter still
    exits 130, as for any Ctrl-C) and hands every other exception to the hook it replaces."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if issubclass(kind, KeyboardInterrupt):
            if os.environ.get("RANK", "0") == "0":
                print(f"{program}: interrupted (Ctrl-C) while starting; nothing was written", file=sys.stderr)
            return
        previous(kind, value, traceback)

    sys.excepthook = hook
