"""Which checkpoint a run resumes (--resume_from_checkpoint latest|PATH), and the resumes refused: another
run's settings, data or global batch, or two runs' checkpoints mixed in one folder."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from common.checkpoint.integrity import checkpoint_folders, checkpoint_root, verify_checkpoint
from common.config import UsageError


@dataclass
class Found:
    """What --resume_from_checkpoint resolved to: the checkpoint (None: start fresh), its step.json, and
    the newer checkpoints `latest` passed over because they failed verification (name, why)."""

    path: str | None = None
    meta: dict = field(default_factory=lambda: {"step": 0, "samples_seen": 0})
    rejected: list[tuple[str, str]] = field(default_factory=list)


def newest_verified(output_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest checkpoint folder of output_dir that verifies, [(newer name, why it failed)])."""
    rejected = []
    for name in reversed(checkpoint_folders(output_dir)):
        path = os.path.join(checkpoint_root(output_dir), name)
        _meta, problem = verify_checkpoint(path)
        if problem is None:
            return path, rejected
        rejected.append((name, problem))
    return None, rejected


def find_checkpoint(cfg, output_dir: str) -> Found:
    """--resume_from_checkpoint -> Found, or UsageError. 'latest': the newest checkpoint of output_dir
    that verifies (none at all: start fresh, which is what an elastic restart of a run that had not
    checkpointed yet needs; only failing ones: refused). A path: that checkpoint, refused if it fails,
    naming the newest good one beside it."""
    wanted = getattr(cfg, "resume_from_checkpoint", "")
    if not wanted:
        return Found()
    if wanted == "latest":
        path, rejected = newest_verified(output_dir)
        if path is None and rejected:
            reasons = "; ".join(f"{name}: {why}" for name, why in rejected)
            raise UsageError(
                f"--resume_from_checkpoint latest: no checkpoint in {checkpoint_root(output_dir)} verifies ({reasons}); "
                "nothing to resume: start afresh with --overwrite or another --output_dir"
            )
        if path is None:
            return Found()
        return Found(path, verify_checkpoint(path)[0], rejected)
    path = os.path.abspath(wanted)
    meta, problem = verify_checkpoint(path)
    if problem:
        parent = os.path.dirname(os.path.dirname(path))
        good, _ = (
            newest_verified(parent)
            if os.path.basename(os.path.dirname(path)) == "checkpoints"
            else (None, [])
        )
        hint = (
            f"the newest checkpoint there that verifies is {good}"
            if good
            else "no checkpoint beside it verifies"
        )
        raise UsageError(f"--resume_from_checkpoint {wanted}: cannot be used: {problem}; {hint}")
    return Found(path, meta)


def first_difference(saved: dict, now: dict, where: str = "in the checkpoint") -> str | None:
    """'--lr: 0.1 in the checkpoint, 0.2 now' for the first field of `now` that differs, else None.
    Fields only `saved` has (a flag since declared result-neutral, for instance) are not compared."""
    for name in sorted(now):
        if saved.get(name) != now[name]:
            label = name if name in ("world_size", "global_batch_size") else f"--{name}"  # not flags
            return f"{label}: {saved.get(name)!r} {where}, {now[name]!r} now"
    return None


def refuse_incompatible(cfg, path: str, meta: dict, world_size: int, data_identity: dict) -> None:
    """A resume continues the SAME run: the flags that determine the trajectory (and the world size,
    unless the checkpoint reshards) and the training data must be the checkpoint's. --max_steps may
    grow, never shrink past it (what it does to a learning-rate schedule is in the trajectory)."""
    if cfg.max_steps <= meta["step"]:
        raise UsageError(
            f"--max_steps {cfg.max_steps}: the checkpoint {path} is already at step {meta['step']}; "
            f"pass --max_steps > {meta['step']} to train on"
        )
    saved = meta.get("trajectory")
    if not isinstance(saved, dict):
        raise UsageError(f"--resume_from_checkpoint: {path} records no trajectory; start afresh")
    now = {k: v for k, v in cfg.trajectory(world_size).items() if k != "max_steps"}
    difference = first_difference({k: v for k, v in saved.items() if k != "max_steps"}, now)
    if difference:
        hint = cfg.resume_hint(difference) if hasattr(cfg, "resume_hint") else ""
        raise UsageError(
            f"cannot resume {path}: {difference}{hint}; resume with the checkpoint's settings or start a new --output_dir"
        )
    if hasattr(cfg, "refuse_resume"):
        cfg.refuse_resume(meta, world_size)
    saved_data = meta.get("data", {})
    changed = [
        key
        for key in sorted(set(saved_data) | set(data_identity))
        if saved_data.get(key) != data_identity.get(key)
    ]
    if changed:
        both = "; ".join(
            f"{key} {saved_data.get(key)} in the checkpoint, {data_identity.get(key)} now" for key in changed
        )
        raise UsageError(
            f"cannot resume {path}: the training data is not the checkpoint's ({both}); "
            "resume on the same data, or start a new --output_dir"
        )


def refuse_mixed_lineage(cfg, output_dir: str, found: Found) -> None:
    """One run's checkpoints per folder: a fresh run into a folder that holds checkpoints, or a resume
    from elsewhere (or from an older checkpoint) into a folder holding newer ones, would interleave two
    runs' checkpoints and make `latest` pick the other run's. Refused, unless --overwrite."""
    if cfg.overwrite:
        return
    kept = checkpoint_folders(output_dir)
    if not kept:
        return
    newest = kept[-1]
    if found.path is None:
        raise UsageError(
            f"--output_dir {output_dir} holds checkpoints of an earlier run (newest {newest}): continue it with "
            "--resume_from_checkpoint latest, or start afresh with --overwrite or another --output_dir"
        )
    inside = os.path.dirname(found.path) == checkpoint_root(output_dir)
    newer = [name for name in kept if name > os.path.basename(found.path)]
    rejected = {name for name, _ in found.rejected}
    if not inside or [name for name in newer if name not in rejected]:
        raise UsageError(
            f"--resume_from_checkpoint {found.path} into --output_dir {output_dir}, which holds "
            f"{'other' if not inside else 'newer'} checkpoints (newest {newest}): the two runs' checkpoints would mix; "
            "resume into a new --output_dir"
        )
