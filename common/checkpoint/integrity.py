"""A checkpoint verified before use: digests of tensors and files, step.json sealed by its own digest, every
recorded file there with its size and sha256."""

from __future__ import annotations

import hashlib
import json
import os

from common.checkpoint.flags import CHECKPOINT_NAME, FORMAT, STEP_FILE, WEIGHTS_FILE, CheckpointUnreadable


# ------------------------------------------------------------------------------------------ digests
def digest_named_values(items) -> str:
    """sha256 over (name, value) pairs in the order given: a tensor's raw bytes, anything else its repr."""
    import torch

    digest = hashlib.sha256()
    for name, value in items:
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def full_state_digest(model_state: dict, optimizer_state: dict) -> str:
    """sha256 of a full (model, optimizer) state keyed by parameter name: names and bytes of every
    parameter and every optimizer tensor (exp_avg, exp_avg_sq, step), learning rates excluded (a
    function of the step, set before each update). Independent of how the state was split."""
    states = optimizer_state.get("state", {})
    return digest_named_values(
        [(name, model_state[name]) for name in sorted(model_state)]
        + [
            (f"optimizer.{name}.{key}", value)
            for name in sorted(states)
            for key, value in sorted(states[name].items())
        ]
    )


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise CheckpointUnreadable(path, error) from None
    return digest.hexdigest()


def _size(path: str) -> int | None:
    """The file's size; None if there is no such file; CheckpointUnreadable if it cannot be looked at."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointUnreadable(path, error) from None


def files_manifest(folder: str) -> dict:
    """{relative path: {"bytes", "sha256"}} of every file under `folder` but step.json."""
    manifest = {}
    for parent, _folders, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, folder)
            if relative != STEP_FILE:
                manifest[relative] = {"bytes": os.path.getsize(path), "sha256": file_sha256(path)}
    return dict(sorted(manifest.items()))


def seal(meta: dict) -> dict:
    """`meta` plus "digest": the sha256 of its canonical JSON (what verify_checkpoint recomputes)."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return {**body, "digest": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


# -------------------------------------------------------------------------------- finding, verifying
def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def checkpoint_folders(output_dir: str) -> list[str]:
    """Names of the step_XXXXXXXX folders (complete or not, verified or not), oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    try:
        return sorted(name for name in os.listdir(root) if CHECKPOINT_NAME.match(name))
    except OSError as error:
        raise CheckpointUnreadable(root, error) from None


def _whole_number(meta: dict, key: str, least: int) -> str | None:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        return f"{STEP_FILE}: {key!r} must be a whole number >= {least}, got {value!r}"
    return None


def read_sealed(folder: str, name: str = STEP_FILE) -> tuple[dict | None, str | None]:
    """(the JSON record `name` in folder, None) if it is readable, ours and unchanged since it was
    sealed; else (None, what is wrong)."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            meta = json.load(handle)
    except FileNotFoundError:
        if name == STEP_FILE and os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
            return None, ("a weights-only folder (tools.convert_checkpoint from-safetensors wrote it: no optimizer "
                          "state, no step, no data position), which no run resumes; to train from these weights, "
                          "start a new run with --init_from FILE.safetensors (to-safetensors writes one from it)")  # fmt: skip
        return None, f"no {name}: not a checkpoint folder, or one whose writing never finished"
    except IsADirectoryError:
        return None, folder_in_place_of(name)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"{name} is not the JSON that was written ({type(error).__name__})"
    except OSError as error:  # a permission or an I/O error: the checkpoint may be whole
        raise CheckpointUnreadable(os.path.join(folder, name), error) from None
    if not isinstance(meta, dict):
        return None, f"{name} is not a JSON object"
    if meta.get("format") != FORMAT:
        return (
            None,
            f"{name} has format {meta.get('format')!r}, not {FORMAT} (written by an older version, unverifiable)",
        )
    if seal(meta)["digest"] != meta.get("digest"):
        return None, f"{name} was changed after it was written (its digest does not match)"
    return meta, None


def folder_in_place_of(name: str) -> str:
    """One fault, one message: a folder where a checkpoint's file was written (its size or its read would
    otherwise say 4,096 bytes in one place and a read error in another)."""
    return f"{name} is a folder where a file was written"


def verify_files(folder: str, files) -> str | None:
    """None if every file recorded is there with its size and sha256, else what is wrong."""
    if not isinstance(files, dict) or not files:
        return "no files recorded"
    for relative, record in files.items():
        path = os.path.join(folder, relative)
        if os.path.isdir(path):
            return folder_in_place_of(relative)
        size = _size(path)
        if not isinstance(record, dict) or size is None:
            return f"{relative} is missing"
        if size != record.get("bytes"):
            return f"{relative} has {size:,} bytes, {record.get('bytes')!r} were written"
        try:
            if file_sha256(path) != record.get("sha256"):
                return f"{relative} differs from what was written (sha256 mismatch)"
        except FileNotFoundError:
            return f"{relative} is missing"
    return None


def verify_checkpoint(path: str) -> tuple[dict | None, str | None]:
    """(step.json, None) when every recorded fact holds, else (None, what is wrong, in a few words).
    Reads every byte of the checkpoint: a bit flipped anywhere, a file missing, truncated or added
    to the record, or step.json edited, each fails here, before anything is loaded."""
    if not os.path.isdir(path):
        return None, "not a folder"
    try:
        os.listdir(path)
    except OSError as error:
        raise CheckpointUnreadable(path, error) from None
    meta, problem = read_sealed(path)
    if problem:
        return None, problem
    for key, least in (("step", 1), ("samples_seen", 0), ("world_size", 1)):
        if problem := _whole_number(meta, key, least):
            return None, problem
    for key in ("trajectory", "layout", "data"):
        if not isinstance(meta.get(key), dict):
            return None, f"{STEP_FILE}: {key!r} must be an object, got {meta.get(key)!r}"
    match = CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))
    if match and int(match.group(1)) != meta["step"]:
        return None, f"the folder is step {int(match.group(1))} but {STEP_FILE} says step {meta['step']}"
    if problem := verify_files(path, meta.get("files")):
        return None, problem
    return meta, None
