"""The checkpointers, with the same save / load / full_state / digest: Accelerate's save_state for a model every
rank holds whole, PyTorch's distributed checkpoint (DCP) for any layout."""

from __future__ import annotations

import contextlib
import copy
import os

from common.checkpoint.flags import STATE_FOLDER
from common.checkpoint.integrity import full_state_digest


# ------------------------------------------------------------------------------------- checkpointers
def _unwrap(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer holds the real one


class FullState:
    """The contract every checkpointer keeps beside save and load: the full state (every tensor whole, keyed
    by parameter name, on the main process) and its digest, the same whatever the layout. Here for a model
    every rank holds whole; ShardedCheckpointer gathers it from any layout, DeepSpeed's through its engine."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, _unwrap(optimizer)

    def full_state(self) -> tuple[dict, dict]:
        """(model, optimizer) state with every tensor whole, keyed by name, on the main process (empty
        dicts elsewhere); a collective for sharded models. Cloned: for a plain CPU tensor the state dict
        holds the live tensor, which the next step would change."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        return copy.deepcopy(model_state), copy.deepcopy(optimizer_state)

    def digest(self, full_state: tuple[dict, dict] | None = None) -> str | None:
        """full_state_digest of the state (main process; None elsewhere). A collective unless the full
        state is passed in."""
        import torch.distributed as dist

        model_state, optimizer_state = full_state or self.full_state()
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        return full_state_digest(model_state, optimizer_state)


class AccelerateCheckpointer(FullState):
    """Accelerate's save_state / load_state (model, optimizer, every rank's RNG states), for a model every
    rank holds whole (one process, DDP)."""

    def __init__(self, accelerator, model, optimizer):
        super().__init__(model, optimizer)
        self.accelerator = accelerator

    def save(self, folder: str) -> None:
        self.accelerator.save_state(folder)

    def load(self, folder: str, same_layout: bool) -> None:
        self.accelerator.load_state(folder)


@contextlib.contextmanager
def one_process_dcp():
    """DCP warns, on every save and load, that it assumes one process when there is no process group:
    that is what one process means. The warning is silenced for that call only."""
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
            )
        yield


class ShardedCheckpointer(FullState):
    """PyTorch's distributed checkpoint: each rank writes its pieces, any layout reads them.

    What it holds is independent of how a layout groups or names things for its own sake:
    - the optimizer's STATE, by parameter name (DCP's get_state_dict keys it so), and no param_groups: how
      AdamW groups parameters is a matter of speed (fused AdamW takes one kind of tensor per group: tensor
      parallelism groups DTensor and plain parameters apart), and a checkpoint that stored groups by index
      could not be resumed by a layout that groups otherwise. A load takes the resuming run's own groups;
    - `aliases` {name here: name in the checkpoint}: a pipeline's last stage keeps the tied embedding's copy as
      head.weight, its optimizer state stored under tok_emb.weight (the tie is one weight in any layout).
    `restore_optimizer=False` loads the parameters only: the classic half-resume that train_gpt's
    `resume_without_optimizer_state` shows failing its check. `gathers_full_state`: whether this rank's
    piece goes into the full state (a pipeline stage's first rank; the others hold copies or pieces of it)."""

    def __init__(self, model, optimizer, restore_optimizer: bool = True, aliases: dict | None = None,
                 gathers_full_state: bool = True):  # fmt: skip
        super().__init__(model, optimizer)
        self.restore_optimizer, self.aliases, self.gathers_full_state = (
            restore_optimizer,
            aliases or {},
            gathers_full_state,
        )

    def _named_state(self, options=None) -> tuple[dict, dict]:
        """get_state_dict, the optimizer's state under the checkpoint's names (a copy whose original this rank
        also holds is dropped: equal by construction)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        state = dict(optimizer_state["state"])
        for here, there in self.aliases.items():
            if here in state:
                copy_state = state.pop(here)
                state.setdefault(there, copy_state)
        return model_state, {"state": state, "param_groups": optimizer_state["param_groups"]}

    def save(self, folder: str) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        model_state, optimizer_state = self._named_state()
        with one_process_dcp():
            dcp.save(
                {"model": model_state, "optimizer": {"state": optimizer_state["state"]}},
                checkpoint_id=os.path.join(folder, STATE_FOLDER),
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(torch.get_rng_state(), os.path.join(folder, f"rng_rank{rank}.pt"))

    def load(self, folder: str, same_layout: bool) -> None:
        """Read the checkpoint into this run's layout: its own groups, the state by name. The CPU RNG comes back
        only at the same layout (a rank of another world size has no counterpart); train_gpt draws no random
        numbers while training."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        if not self.restore_optimizer:
            with one_process_dcp():
                dcp.load({"model": model_state}, checkpoint_id=os.path.join(folder, STATE_FOLDER))
            set_model_state_dict(self.model, model_state)
            return
        state = dict(optimizer_state["state"])
        renamed = {
            here: there for here, there in self.aliases.items() if here in state and there not in state
        }
        for here, there in renamed.items():
            state[there] = state.pop(here)
        wanted = {"model": model_state, "optimizer": {"state": state}}
        with one_process_dcp():
            dcp.load(wanted, checkpoint_id=os.path.join(folder, STATE_FOLDER))
        state = dict(wanted["optimizer"]["state"])
        for here, there in self.aliases.items():  # renamed back, or a copy filled from its original here
            if here in renamed:
                state[here] = state.pop(there)
            elif here in optimizer_state["state"] and there in state:
                state[here] = _cloned(state[there])
        set_state_dict(self.model, self.optimizer, model_state_dict=wanted["model"],
                       optim_state_dict={"state": state, "param_groups": optimizer_state["param_groups"]})  # fmt: skip
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng = os.path.join(folder, f"rng_rank{rank}.pt")
        if same_layout and os.path.exists(rng):
            torch.set_rng_state(torch.load(rng))

    def full_state(self) -> tuple[dict, dict]:
        """Every tensor whole, by name, on the main process (empty elsewhere): each rank gathers its own piece
        whole (a collective over its tensor-parallel and sharding ranks), the first rank of each pipeline stage
        sends it to the main process, which puts the pieces together by name."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        model_state, optimizer_state = self._named_state(options)
        mine = (
            (_to_cpu(model_state), _to_cpu(optimizer_state["state"])) if self.gathers_full_state else ({}, {})
        )
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return copy.deepcopy(mine[0]), {"state": copy.deepcopy(mine[1])}
        pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, pieces, dst=0)
        if dist.get_rank() != 0:
            return {}, {}
        model_full = {name: value for piece, _ in pieces for name, value in piece.items()}
        state_full = {name: value for _, piece in pieces for name, value in piece.items()}
        return dict(sorted(model_full.items())), {"state": dict(sorted(state_full.items()))}


def _to_cpu(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {key: _to_cpu(value) for key, value in tree.items()}
    return copy.deepcopy(tree)


def _cloned(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return {key: _cloned(value) for key, value in tree.items()} if isinstance(tree, dict) else tree


def load_full_optimizer_state(optimizer, model, full_state: dict) -> None:
    """Load a name-keyed full optimizer state ({"state": {name: {...}}}, as full_state gives it) into a plain
    one-process optimizer, whose own state_dict is keyed by parameter position in its own groups. No
    collective: for the one-process reference, which runs on the main process alone."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    own = optimizer.state_dict()
    position = {}  # the optimizer numbers its parameters in the order its groups list them
    for group in optimizer.param_groups:
        for param in group["params"]:
            position[name_of[id(param)]] = len(position)
    state = {position[name]: value for name, value in full_state["state"].items() if name in position}
    optimizer.load_state_dict({"state": state, "param_groups": own["param_groups"]})
