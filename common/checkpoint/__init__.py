"""Checkpoints that cannot lie: written whole or not at all, verified before use, tied to their data.

A checkpoint is a folder `<output_dir>/checkpoints/step_XXXXXXXX/` holding the training state (written
by a checkpointer, below) and `step.json`, which records:
  step, samples_seen      where the run was (the data position in samples, so a resume at another
                          world size, with another global batch, continues at the same sample);
  trajectory, world_size, every flag that changes what the run computes, the layout it ran under, and
  layout, data            content hashes of its training data (and tokenizer): a resume that differs
                          in any of them is refused, naming the field and both values;
  state_digest            sha256 of the FULL state (every parameter and optimizer tensor, gathered
                          whole, by name): the same at any world size and strategy, so the state
                          right after a load must have the digest it was saved with;
  files                   the sha256 and size of every file of the checkpoint, computed from disk
                          once every rank had written;
  digest                  sha256 of everything above: a step.json edited by hand, or flipped by the
                          disk, is refused like a corrupt shard.
Every one of them is checked BEFORE any training step uses the checkpoint (`verify_checkpoint`): a bad
checkpoint is refused in one line naming it and the newest good one, exit 2, nothing written.
`--resume_from_checkpoint latest` takes the newest checkpoint that verifies and says which newer ones
it passed over, and why.

Writing (`save_checkpoint`, a collective): every rank writes into step_XXXXXXXX.partial, the ranks
agree that every write succeeded, the main process hashes the files, writes step.json and renames the
folder: a half-written checkpoint is never "latest". Any failure (a full disk, a permission, DCP's
CheckpointException on any rank) is one line on every rank, the partial folder removed, the newest
complete checkpoint kept. Pruning (`--keep_checkpoints K`) happens only after the new checkpoint is
complete, so the newest verified one is never deleted.

Two checkpointers with the same save / load / full_state / digest:
- `AccelerateCheckpointer`: Accelerate's save_state / load_state (model, optimizer, every rank's RNG
  state) for a model every rank holds whole (ddp_linear);
- `ShardedCheckpointer`: PyTorch's distributed checkpoint (DCP): `get_state_dict` gives the state in
  this run's layout (DTensor shards under FSDP / TP) keyed by parameter NAME, `dcp.save` has each rank
  write its pieces plus a metadata file, and `dcp.load` reads them into whatever layout the resuming
  run has: saved by fsdp on 2 ranks, resumed by fsdp on 3, by ddp, or by one process (train_gpt).
Both digest the full state the same way (`full_state_digest`).

The package, along its seams: flags.py (names, the resume flags), integrity.py (digests, verification),
finding.py (which checkpoint a run resumes, and the resumes refused), writing.py (saving whole or not at all,
pruning, loading), checkpointers.py (the two checkpointers).
"""

from __future__ import annotations

from common.checkpoint.checkpointers import (
    AccelerateCheckpointer,
    FullState,
    ShardedCheckpointer,
    load_full_optimizer_state,
    one_process_dcp,
)
from common.checkpoint.finding import (
    Found,
    find_checkpoint,
    first_difference,
    newest_verified,
    refuse_incompatible,
    refuse_mixed_lineage,
)
from common.checkpoint.flags import (
    CHECKPOINT_NAME,
    CHECKPOINT_PREFIX,
    FORMAT,
    REJECTED_FOLDER,
    STATE_FOLDER,
    STEP_FILE,
    WEIGHTS_FILE,
    CheckpointUnreadable,
    ResumableArgs,
)
from common.checkpoint.integrity import (
    checkpoint_folders,
    checkpoint_root,
    digest_named_values,
    file_sha256,
    files_manifest,
    folder_in_place_of,
    full_state_digest,
    read_sealed,
    seal,
    verify_checkpoint,
    verify_files,
)
from common.checkpoint.writing import load_checkpoint, save_checkpoint, tidy_checkpoints

__all__ = [
    "CHECKPOINT_PREFIX",
    "CHECKPOINT_NAME",
    "STEP_FILE",
    "WEIGHTS_FILE",
    "FORMAT",
    "REJECTED_FOLDER",
    "STATE_FOLDER",
    "CheckpointUnreadable",
    "ResumableArgs",
    "digest_named_values",
    "full_state_digest",
    "file_sha256",
    "files_manifest",
    "seal",
    "checkpoint_root",
    "checkpoint_folders",
    "read_sealed",
    "folder_in_place_of",
    "verify_files",
    "verify_checkpoint",
    "Found",
    "newest_verified",
    "find_checkpoint",
    "first_difference",
    "refuse_incompatible",
    "refuse_mixed_lineage",
    "save_checkpoint",
    "tidy_checkpoints",
    "load_checkpoint",
    "FullState",
    "AccelerateCheckpointer",
    "one_process_dcp",
    "ShardedCheckpointer",
    "load_full_optimizer_state",
]
