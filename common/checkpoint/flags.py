"""What a checkpoint is called and holds, and the flags of a run that writes and resumes them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.config import UsageError, flag, require, require_positive
from common.reliability import FaultArgs

CHECKPOINT_PREFIX = "step_"
CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")
STEP_FILE = "step.json"
WEIGHTS_FILE = "weights.json"  # beside state/ in the weights-only folder tools.convert_checkpoint from-safetensors writes
FORMAT = 2  # format 1 (before 2026-12-04) had no file digests: refused, it cannot be verified
REJECTED_FOLDER = (
    "rejected"  # checkpoints/rejected/: newer checkpoints that failed verification, kept for a look
)
STATE_FOLDER = "state"  # inside a DCP checkpoint: one .distcp per rank + .metadata


class CheckpointUnreadable(UsageError):
    """A checkpoint that could not be READ (a permission, an I/O error): not a damaged one. The run stops in one
    line naming what could not be read, and nothing is passed over or moved to rejected/."""

    def __init__(self, what: str, error: OSError):
        super().__init__(
            f"cannot read {what} ({error.strerror or type(error).__name__}): a read error, not a damaged checkpoint; "
            "nothing was passed over or moved. Fix the permissions or the disk, then run again",
            same_on_every_rank=True,
        )


@dataclass
class ResumableArgs(FaultArgs):
    checkpoint_every: int = flag(0, "save a checkpoint every N optimizer steps (0: never)")
    keep_checkpoints: int = flag(2, "how many complete checkpoints to keep (oldest pruned, never the newest)")
    resume_from_checkpoint: str = flag(
        "",
        "'latest' (the newest checkpoint in --output_dir that verifies; none yet = start fresh) or a "
        "checkpoint folder",
    )

    def validate(self) -> None:
        super().validate()
        require(self.checkpoint_every >= 0, f"--checkpoint_every must be >= 0, got {self.checkpoint_every}")
        require_positive(self, "keep_checkpoints")
        require(
            not (self.overwrite and self.resume_from_checkpoint == "latest"),
            "--overwrite starts afresh and --resume_from_checkpoint latest continues: pass one of them",
        )
