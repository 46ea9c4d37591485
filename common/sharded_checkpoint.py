"""Checkpoints that any strategy can write and any other can read: PyTorch's distributed checkpoint (DCP).

`get_state_dict(model, optimizer)` gives the state in this run's layout (DTensor shards under FSDP / TP,
plain tensors under DDP or one process) keyed by parameter name, never by position; `dcp.save` has each
rank write its own pieces plus a metadata file that says which piece of which full tensor each is. On
load, `dcp.load` reads into THIS run's layout whatever the writer's was: saved by fsdp on 2 ranks, read
by fsdp on 3, by ddp, or by one process. `set_state_dict` puts it into the model and optimizer.

The proof that a load is exact is a digest of the FULL state (every parameter and optimizer tensor
gathered whole, by name): it does not depend on how the state is split, so the digest written at save
time must equal the one computed right after loading, at any world size and strategy.

Used by train_gpt through TrainLoop(checkpointer=...); ddp_linear keeps Accelerate's save_state.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from common.reliability import digest_named_values

STATE_FOLDER = "state"  # inside a checkpoint folder: the DCP files (one .distcp per rank + .metadata)


def _unwrap(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer holds the real one


class ShardedCheckpointer:
    """save(folder) / load(folder) / digest() for a model and its optimizer; each is a collective (every
    rank calls it). `restore_optimizer=False` loads the parameters only: the classic half-resume that
    train_gpt's `resume_without_optimizer_state` shows failing its check."""

    def __init__(self, model, optimizer, restore_optimizer: bool = True):
        self.model, self.optimizer, self.restore_optimizer = model, _unwrap(optimizer), restore_optimizer
        self.last_full_state: tuple[dict, dict] | None = None  # what the last digest() gathered

    def save(self, folder: str) -> None:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=os.path.join(folder, STATE_FOLDER),
        )
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(torch.get_rng_state(), os.path.join(folder, f"rng_rank{rank}.pt"))

    def load(self, folder: str, same_layout: bool) -> None:
        """Read the checkpoint into this run's layout. The CPU RNG comes back only at the same layout (a
        rank of another world size has no counterpart); train_gpt draws no random numbers while training."""
        if not self.restore_optimizer:
            model_state = get_model_state_dict(self.model)
            dcp.load({"model": model_state}, checkpoint_id=os.path.join(folder, STATE_FOLDER))
            set_model_state_dict(self.model, model_state)
            return
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=os.path.join(folder, STATE_FOLDER))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng = os.path.join(folder, f"rng_rank{rank}.pt")
        if same_layout and os.path.exists(rng):
            torch.set_rng_state(torch.load(rng))

    def full_state(self) -> tuple[dict, dict]:
        """(model, optimizer) state with every tensor whole, by name, on the main process (empty dicts
        elsewhere); cloned, because for a plain CPU tensor the state dict holds the live tensor."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        return copy.deepcopy(model_state), copy.deepcopy(optimizer_state)

    def digest(self) -> str | None:
        """sha256 of the full state (main process; None elsewhere). Names and bytes of every parameter
        and every optimizer tensor (exp_avg, exp_avg_sq, step), learning rates excluded (a function of
        the step, set before each update)."""
        model_state, optimizer_state = self.last_full_state = self.full_state()
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        return full_state_digest(model_state, optimizer_state)


def full_state_digest(model_state: dict, optimizer_state: dict) -> str:
    states = optimizer_state.get("state", {})
    return digest_named_values(
        [(name, model_state[name]) for name in sorted(model_state)]
        + [
            (f"optimizer.{name}.{key}", value)
            for name in sorted(states)
            for key, value in sorted(states[name].items())
        ]
    )


def load_full_optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, full_state: dict
) -> None:
    """Load a name-keyed full optimizer state (get_state_dict's format) into a plain one-process
    optimizer, whose own state_dict is keyed by parameter position. No collective: for the one-process
    reference, which runs on the main process alone."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    # the optimizer numbers its parameters in the order its groups list them
    position = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            position[name_of[id(param)]] = len(position)
    groups = [
        {**group, "params": [position[name] for name in group["params"]]}
        for group in full_state["param_groups"]
    ]
    state = {position[name]: value for name, value in full_state["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
