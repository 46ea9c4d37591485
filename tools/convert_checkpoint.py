"""Convert a checkpoint of this project to ONE safetensors file of full model weights, for inference
elsewhere, and back. Verified both ways.

    python -m tools.convert_checkpoint to-safetensors runs/train_gpt/checkpoints/step_00000100 model.safetensors
    python -m tools.convert_checkpoint from-safetensors model.safetensors weights_dcp/

to-safetensors first verifies the checkpoint as a resume would (every file against the sha256 recorded
when it was written, common/checkpoint/), then reads it in this one process (no process group; any world
size wrote it), by its format, which it names:
  dcp          train_gpt's (torch.distributed.checkpoint, one file per rank): the shards read into full
               tensors and checked against the checkpoint's own digest of its full state (parameters and
               optimizer) before anything is written;
  deepspeed    train_gpt under a DeepSpeed config (each rank's ZeRO partitions): read through DeepSpeed's
               own `deepspeed.utils.zero_to_fp32` into full float32 weights;
  accelerate   ddp_linear's and the other experiments' (Accelerate's save_state): the model file it wrote.
Which checkpoints resume where: dcp under any train_gpt layout at any world size; deepspeed under the same
ZeRO stage on as many ranks; accelerate in the same experiment on as many ranks. It keeps the model's tensors (the
optimizer's are training state, not weights) and records their sha256 in the file's metadata. A tied
weight (head = token embedding) is stored once under each name, as separate tensors, because
safetensors stores no shared storage.

from-safetensors verifies that sha256 against the tensors it reads, then writes them as a DCP
checkpoint (state/ with keys "model.<name>", as train_gpt writes them; loadable with dcp.load into any
layout) plus weights.json (the files' digests and the weights' digest), which to-safetensors verifies in
turn. Weights only: a training run cannot resume from it (no optimizer state, no step).

Outputs are written under a temporary name and renamed when complete, never over an existing path. Every
problem (a corrupt, truncated or foreign input, a file that is not safetensors, a full disk) is one
line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.checkpoint import (
    FORMAT,
    STATE_FOLDER,
    STEP_FILE,
    WEIGHTS_FILE,
    files_manifest,
    full_state_digest,
    read_sealed,
    seal,
    verify_checkpoint,
    verify_files,
)
from common.config import UsageError
from common.weights import (
    DIGEST_KEY,
    MODEL_KEY,
    model_architecture,
    read_weights,
    recorded_architecture,
    weights_digest,
    write_safetensors,
)


def checkpoint_format(folder: str) -> str | None:
    """dcp, deepspeed or accelerate: what wrote the checkpoint `folder` (None: none of them)."""
    if os.path.isdir(os.path.join(folder, STATE_FOLDER)):
        return "dcp"
    if os.path.isfile(os.path.join(folder, "latest")) or any(
        name.startswith("zero_pp_rank_") for _parent, _dirs, names in os.walk(folder) for name in names
    ):
        return "deepspeed"
    if any(os.path.isfile(os.path.join(folder, name)) for name in ACCELERATE_MODEL_FILES):
        return "accelerate"
    return None


ACCELERATE_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")  # what Accelerate's save_state writes


def read_checkpoint(checkpoint: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(every model tensor of a verified checkpoint (a checkpoint folder, or its state/ folder), full size; the
    flags it was trained with, as its step.json records them ({} for a weights-only folder))."""
    folder = os.path.abspath(checkpoint)
    if os.path.basename(folder) == STATE_FOLDER:
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        fail(f"{checkpoint!r} is not a folder")
    training = os.path.exists(os.path.join(folder, STEP_FILE))
    try:
        if training:
            meta, problem = verify_checkpoint(folder)
        elif os.path.exists(os.path.join(folder, WEIGHTS_FILE)):
            meta, problem = read_sealed(folder, WEIGHTS_FILE)
            problem = problem or verify_files(folder, meta.get("files"))
        else:
            fail(f"{checkpoint!r} is not a checkpoint of this project (no {STEP_FILE} or {WEIGHTS_FILE})")
    except UsageError as error:  # a read error (a permission, the disk): not the checkpoint's fault
        fail(str(error))
    if problem:
        fail(f"{checkpoint!r} cannot be used: {problem}")
    trained_with = (meta or {}).get("trajectory") or (meta or {}).get("model_flags") or {}
    kind = checkpoint_format(folder)
    print(
        f"convert_checkpoint: {checkpoint}: {kind or 'an unknown'} checkpoint, every file verified",
        flush=True,
    )
    if kind == "deepspeed":
        return read_deepspeed(folder, checkpoint), trained_with
    if kind == "accelerate":
        return read_accelerate(folder, checkpoint), trained_with
    if kind is None:
        fail(f"{checkpoint!r}: its files are none of dcp (state/), deepspeed (zero_pp_rank_*) or accelerate "
             f"({', '.join(ACCELERATE_MODEL_FILES)})")  # fmt: skip
    state = read_dcp(os.path.join(folder, STATE_FOLDER), checkpoint)
    model = {name: tensor.contiguous().clone() for name, tensor in state["model"].items()}
    if training:
        found, expected = (
            full_state_digest(state["model"], state.get("optimizer", {})),
            meta.get("state_digest"),
        )
    else:
        found, expected = weights_digest(model), meta.get("model_digest")
    if found != expected:
        fail(
            f"{checkpoint!r}: its tensors do not match the digest it was written with "
            f"({found[:16]}... != {str(expected)[:16]}...)"
        )
    return model, trained_with


def read_deepspeed(folder: str, checkpoint: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's ZeRO partitions -> full float32 weights, by DeepSpeed's own zero_to_fp32 (each rank's
    partitions of the flat groups put back together, tied weights under each name)."""
    import contextlib
    import io

    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        fail(
            f"{checkpoint!r} is a DeepSpeed checkpoint and reading it needs deepspeed (pip install -r requirements.txt)"
        )
    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 narrates every group it reads
        try:
            state = get_fp32_state_dict_from_zero_checkpoint(folder)
        except (Exception, SystemExit) as error:
            fail(f"{checkpoint!r}: DeepSpeed's zero_to_fp32 could not read it: {one_line(error)}")
    return {name: tensor.contiguous().clone() for name, tensor in state.items()}


def read_accelerate(folder: str, checkpoint: str) -> dict[str, torch.Tensor]:
    """Accelerate's save_state: the model's weights are its model file (safetensors, or a torch pickle)."""
    from safetensors.torch import load_file

    path = next(
        os.path.join(folder, name)
        for name in ACCELERATE_MODEL_FILES
        if os.path.isfile(os.path.join(folder, name))
    )
    try:
        state = load_file(path) if path.endswith(".safetensors") else torch.load(path, weights_only=True)
    except Exception as error:
        fail(f"{checkpoint!r}: its model file {os.path.basename(path)} could not be read: {one_line(error)}")
    return {name: tensor.contiguous().clone() for name, tensor in state.items()}


def read_dcp(folder: str, checkpoint: str) -> dict:
    """DCP files -> one dict of full tensors, in this process (no group needed)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        try:
            dcp_to_torch_save(folder, whole)
            return torch.load(whole, weights_only=True)
        except (Exception, CheckpointException) as error:  # noqa: B014 (CheckpointException is a BaseException)
            fail(f"{checkpoint!r} could not be read: {one_line(error)}")


def to_safetensors(checkpoint: str, output: str) -> dict[str, torch.Tensor]:
    refuse_existing(output)
    weights, trained_with = read_checkpoint(checkpoint)
    metadata = {DIGEST_KEY: weights_digest(weights)}
    architecture = model_architecture(trained_with)
    if architecture:  # the model the weights are (a GPT's flags): --init_from refuses another one
        metadata[MODEL_KEY] = json.dumps(architecture, sort_keys=True)
    write_whole(output, lambda temporary: write_safetensors(weights, temporary, metadata))
    return weights


def read_safetensors(weights_file: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file written by to-safetensors, checked against its recorded digest."""
    try:
        return read_weights(weights_file)[0]
    except UsageError as error:
        fail(str(error))


def from_safetensors(weights_file: str, checkpoint: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    refuse_existing(checkpoint)
    weights = read_safetensors(weights_file)

    def write(folder: str) -> None:
        os.makedirs(folder)
        with tempfile.TemporaryDirectory() as scratch:
            whole = os.path.join(scratch, "whole.pt")
            torch.save({"model": weights}, whole)
            torch_save_to_dcp(whole, os.path.join(folder, STATE_FOLDER))
        record = {"format": FORMAT, "model_digest": weights_digest(weights), "files": files_manifest(folder)}
        architecture = recorded_architecture(weights_file)
        if architecture:  # carried on: the folder's weights are the same model
            record["model_flags"] = architecture
        record = seal(record)
        with open(os.path.join(folder, WEIGHTS_FILE), "w") as handle:
            json.dump(record, handle, indent=1)

    write_whole(checkpoint, write)
    return weights


def write_whole(output: str, write) -> None:
    """write(temporary path), then rename to `output`: a failure (a full disk) leaves nothing behind."""
    temporary = f"{os.path.abspath(output)}.partial{os.getpid()}"
    try:
        write(temporary)
        os.replace(temporary, output)
    except BaseException as error:  # DCP's CheckpointException (a full disk) is a BaseException
        if isinstance(error, SystemExit):
            raise
        if os.path.isdir(temporary):
            shutil.rmtree(temporary, ignore_errors=True)
        elif os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(error, KeyboardInterrupt):
            fail("interrupted (Ctrl-C); nothing written", code=130)
        fail(f"could not write {output!r}: {one_line(error)}; nothing written")


def one_line(error: BaseException) -> str:
    """The error in one line: the OS's reason where there is one (DCP's CheckpointException wraps each rank's)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    if getattr(error, "errno", None) == 28:
        return "disk full"
    text = (getattr(error, "strerror", None) or str(error)).strip()
    return (text.splitlines()[-1] if text else type(error).__name__)[:300]


def refuse_existing(path: str) -> None:
    """Never overwrite: results are not lost to a mistyped output path."""
    if os.path.lexists(path):
        fail(f"{path!r} exists; choose a new output path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        fail(f"{path!r}: the folder {parent!r} does not exist")


def fail(message: str, code: int = 2):
    print(f"convert_checkpoint: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to = commands.add_parser(
        "to-safetensors", help="DCP checkpoint folder -> one .safetensors file of full weights"
    )
    to.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX folder (or its state/ folder)")
    to.add_argument("output", help="the .safetensors file to write (must not exist)")
    back = commands.add_parser(
        "from-safetensors",
        help=".safetensors file (written by to-safetensors) -> DCP checkpoint folder of weights",
    )
    back.add_argument("weights", help="a .safetensors file written by to-safetensors")
    back.add_argument("output", help="the checkpoint folder to write (must not exist)")
    args = parser.parse_args(argv)
    if args.command == "to-safetensors":
        weights = to_safetensors(args.checkpoint, args.output)
        target = args.output
    else:
        weights = from_safetensors(args.weights, args.output)
        target = f"{args.output}/{STATE_FOLDER}"
    print(
        f"{len(weights)} tensors, {sum(t.numel() for t in weights.values()):,} values, verified -> {target}"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        fail("interrupted (Ctrl-C)", code=130)
