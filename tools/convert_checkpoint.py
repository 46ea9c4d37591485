"""Convert a train_gpt checkpoint (torch.distributed.checkpoint, one file per rank that wrote it) to ONE
safetensors file of full model weights, for inference elsewhere, and back.

    python -m tools.convert_checkpoint to-safetensors runs/train_gpt/checkpoints/step_00000100 model.safetensors
    python -m tools.convert_checkpoint from-safetensors model.safetensors weights_dcp/

to-safetensors reads the DCP shards in this one process (no process group, any world size wrote them)
into full tensors and keeps the model's (the optimizer's are training state, not weights); a tied weight
(head = token embedding) is stored once under each name, as separate tensors, because safetensors stores
no shared storage. from-safetensors writes those weights as a DCP checkpoint (state/ under the folder, keys
"model.<name>" as train_gpt writes them): loadable with dcp.load into any layout. Weights only, so a
training run cannot resume from it (no optimizer state, no step). Bad paths give one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from common.sharded_checkpoint import STATE_FOLDER


def dcp_model_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint (a checkpoint folder, or its state/ folder), full size."""
    folder = (
        os.path.join(checkpoint, STATE_FOLDER)
        if os.path.isdir(os.path.join(checkpoint, STATE_FOLDER))
        else checkpoint
    )
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        fail(f"{checkpoint!r} is not a DCP checkpoint (no .metadata in {folder})")
    # every file the metadata names must be there: each rank wrote its own (__<rank>_0.distcp)
    named = {info.relative_path for info in FileSystemReader(folder).read_metadata().storage_data.values()}
    missing = sorted(name for name in named if not os.path.isfile(os.path.join(folder, name)))
    if missing:
        fail(f"{checkpoint!r} is incomplete: {', '.join(missing)} missing (written by another rank?)")
    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        try:
            dcp_to_torch_save(folder, whole)  # reads every rank's shards in this process, no group needed
        except (OSError, RuntimeError, ValueError, CheckpointException) as error:  # e.g. a shard cut short
            fail(f"{checkpoint!r} could not be read: {str(error).strip().splitlines()[-1]}")
        state = torch.load(whole, weights_only=True)
    return {name: tensor.contiguous().clone() for name, tensor in state["model"].items()}


def to_safetensors(checkpoint: str, output: str) -> dict[str, torch.Tensor]:
    weights = dcp_model_weights(checkpoint)
    refuse_existing(output)
    save_file(weights, output)
    return weights


def from_safetensors(weights_file: str, checkpoint: str) -> None:
    if not os.path.isfile(weights_file):
        fail(f"{weights_file!r} is not a file")
    weights = load_file(weights_file)
    refuse_existing(checkpoint)
    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        torch.save({"model": weights}, whole)
        torch_save_to_dcp(whole, os.path.join(checkpoint, STATE_FOLDER))


def refuse_existing(path: str) -> None:
    """Never overwrite: results are not lost to a mistyped output path."""
    if os.path.exists(path):
        fail(f"{path!r} exists; choose a new output path")


def fail(message: str) -> None:
    print(f"convert_checkpoint: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to = commands.add_parser(
        "to-safetensors", help="DCP checkpoint folder -> one .safetensors file of full weights"
    )
    to.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX folder (or its state/ folder)")
    to.add_argument("output", help="the .safetensors file to write (must not exist)")
    back = commands.add_parser(
        "from-safetensors", help=".safetensors file -> DCP checkpoint folder of weights"
    )
    back.add_argument("weights", help="a .safetensors file")
    back.add_argument("output", help="the checkpoint folder to write (must not exist)")
    args = parser.parse_args(argv)
    if args.command == "to-safetensors":
        weights = to_safetensors(args.checkpoint, args.output)
        print(f"{len(weights)} tensors, {sum(t.numel() for t in weights.values()):,} values -> {args.output}")
    else:
        from_safetensors(args.weights, args.output)
        print(f"{args.weights} -> {args.output}/{STATE_FOLDER}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
