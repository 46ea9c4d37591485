"""One safetensors file of full model weights: what tools/convert_checkpoint.py writes for inference elsewhere,
and what train_gpt's --init_from starts a new run from (fine-tuning from exported weights).

The file records the sha256 of its tensors in its metadata (`weights_sha256`); every reader checks it, so a
corrupt or foreign file is one line naming it, never a run on damaged weights. Weights only: no optimizer state,
no step, no data position; a run that starts from them is a new run (a fresh optimizer, step 0).
"""

from __future__ import annotations

import os

import torch

from common.checkpoint import digest_named_values
from common.config import UsageError

DIGEST_KEY = "weights_sha256"  # in the safetensors file's metadata


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    return digest_named_values((name, weights[name]) for name in sorted(weights))


def read_weights(weights_file: str, what: str = "") -> tuple[dict[str, torch.Tensor], str]:
    """(the tensors of a safetensors file written by tools.convert_checkpoint to-safetensors, their digest),
    checked against the digest recorded in it; UsageError naming `what` (the flag) and the file otherwise."""
    from safetensors import safe_open

    said = f"{what} {weights_file}" if what else repr(weights_file)
    if os.path.isdir(weights_file):
        raise UsageError(f"{said} is a folder; it must be a .safetensors file (tools.convert_checkpoint to-safetensors "
                         "writes one from any checkpoint)")  # fmt: skip
    if not os.path.isfile(weights_file):
        raise UsageError(f"{said}: no such file")
    try:
        with safe_open(weights_file, framework="pt") as handle:
            metadata = handle.metadata() or {}
            weights = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except Exception as error:  # safetensors raises its own types for a file that is not safetensors
        text = (getattr(error, "strerror", None) or str(error)).strip()
        reason = (text.splitlines()[-1] if text else type(error).__name__)[:300]
        raise UsageError(f"{said} is not a readable safetensors file: {reason}") from None
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
