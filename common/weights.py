"""One safetensors file of full model weights: what tools/convert_checkpoint.py writes for inference elsewhere,
and what train_gpt's --init_from starts a new run from (fine-tuning from exported weights).

The file records the sha256 of its tensors in its metadata (`weights_sha256`); every reader checks it, so a
corrupt or foreign file is one line naming it, never a run on damaged weights. Weights only: no optimizer state,
no step, no data position; a run that starts from them is a new run (a fresh optimizer, step 0).
"""

from __future__ import annotations

import functools
import json
import os

import torch

from common.checkpoint import digest_named_values
from common.config import UsageError

DIGEST_KEY = "weights_sha256"  # in the safetensors file's metadata
MODEL_KEY = (
    "model_flags"  # the GPT the weights are: its architecture's flags, JSON (files from a GPT's checkpoint)
)
# the flags that make two GPTs of the same tensor shapes different models (--n_head 2 and 4 split the same
# matrices into other heads); the sizes the shapes already show, and how a model trains, are not among them
ARCHITECTURE = ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "mlp", "norm", "positions", "bias",
                "tie_weights", "n_experts", "top_k", "n_shared_experts", "router", "route_norm")  # fmt: skip


def write_safetensors(weights: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """safetensors' file, its header's keys in sorted order: safetensors writes its metadata map in any order
    (a hash map's), and the same weights and metadata must make the same bytes (a round trip is bitwise). The
    tensors' offsets count from the data's start, so the header may be rewritten; it stays padded to 8 bytes."""
    from safetensors.torch import save

    written = save(weights, metadata=metadata)
    length = int.from_bytes(written[:8], "little")
    header = json.dumps(json.loads(written[8 : 8 + length]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header + written[8 + length :])


def model_architecture(flags: dict) -> dict:
    """The architecture's flags among `flags` (a run's trajectory), {} for a run that is not a GPT's."""
    return {name: flags[name] for name in ARCHITECTURE if name in flags}


def recorded_architecture(weights_file: str) -> dict:
    """The architecture a weights file records it was trained as ({}: none recorded)."""
    from safetensors import safe_open

    with safe_open(weights_file, framework="pt") as handle:
        recorded = (handle.metadata() or {}).get(MODEL_KEY)
    return json.loads(recorded) if recorded else {}


def refuse_other_model(weights_file: str, flags: dict, what: str) -> None:
    """UsageError, naming both values, when the weights in `weights_file` were trained as another architecture
    than `flags` (this run's) asks for. A file that records none (written before it did) is checked by shape only."""
    trained = recorded_architecture(weights_file)
    differ = [f"--{name} {trained[name]} (this run: {flags[name]})" for name in ARCHITECTURE
              if name in trained and name in flags and trained[name] != flags[name]]  # fmt: skip
    if differ:
        raise UsageError(f"{what}: these weights were trained as another model: {', '.join(differ)}; give the model "
                         "flags they were trained with")  # fmt: skip


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    return digest_named_values((name, weights[name]) for name in sorted(weights))


def read_weights(
    weights_file: str, what: str = "", foreign: bool = False
) -> tuple[dict[str, torch.Tensor], str]:
    """(the tensors of a safetensors file written by tools.convert_checkpoint to-safetensors, their digest),
    checked against the digest recorded in it; UsageError naming `what` (the flag) and the file otherwise. Read
    once per file version: a run's flags are checked before it starts and the same tensors load after.
    `foreign`: a file written by another tool (transformers' save_pretrained) records no digest: its tensors'
    digest is computed, for the run's record, and nothing is verified but that it reads."""
    said = f"{what} {weights_file}" if what else repr(weights_file)
    if os.path.isdir(weights_file):
        raise UsageError(f"{said} is a folder; it must be a .safetensors file (tools.convert_checkpoint to-safetensors "
                         "writes one from any checkpoint)")  # fmt: skip
    if not os.path.isfile(weights_file):
        raise UsageError(f"{said}: no such file")
    status = os.stat(weights_file)
    return _verified(os.path.abspath(weights_file), status.st_size, status.st_mtime_ns, said, foreign)


@functools.lru_cache(maxsize=1)
def _verified(
    weights_file: str, size: int, mtime_ns: int, said: str, foreign: bool
) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors import safe_open

    try:
        with safe_open(weights_file, framework="pt") as handle:
            metadata = handle.metadata() or {}
            weights = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except Exception as error:  # safetensors raises its own types for a file that is not safetensors
        text = (getattr(error, "strerror", None) or str(error)).strip()
        reason = (text.splitlines()[-1] if text else type(error).__name__)[:300]
        raise UsageError(f"{said} is not a readable safetensors file: {reason}") from None
    if foreign and DIGEST_KEY not in metadata:
        return weights, weights_digest(weights)
    if DIGEST_KEY not in metadata:
        raise UsageError(f"{said} records no {DIGEST_KEY} (not written by tools.convert_checkpoint to-safetensors): "
                         "it cannot be verified")  # fmt: skip
    digest = weights_digest(weights)
    if digest != metadata[DIGEST_KEY]:
        raise UsageError(f"{said}: its tensors do not match the digest recorded in it (corrupted?)")
    return weights, digest


def refuse_unfit(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """UsageError unless `weights` has exactly the names and shapes of a model's state dict `expected`."""
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = [f"{name} {tuple(weights[name].shape)} (the model's {tuple(expected[name].shape)})"
             for name in sorted(set(weights) & set(expected)) if weights[name].shape != expected[name].shape]  # fmt: skip
    if missing or extra or wrong:
        problems = [f"missing {', '.join(missing[:3])}" * bool(missing), f"not in the model {', '.join(extra[:3])}" * bool(extra),
                    f"shapes differ: {', '.join(wrong[:3])}" * bool(wrong)]  # fmt: skip
        raise UsageError(f"{what}: these weights are not this model's ({'; '.join(p for p in problems if p)}): "
                         "give the model flags the weights were trained with")  # fmt: skip
