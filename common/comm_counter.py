"""Count the bytes a piece of training sends through collectives, whoever issues them.

DDP's reducer, FSDP2's all-gathers and reduce-scatters and DTensor's tensor-parallel all-reduces all
go through PyTorch's dispatcher as `c10d.*` or `_c10d_functional.*` ops (also from the autograd
engine during backward), so one TorchDispatchMode sees every one of them. PyTorch's own
`CommDebugMode` counts them too, but records no sizes; this records the message size of each call
in the nccl-tests convention, the size of the whole tensor being reduced or gathered:
  all_reduce      the tensor (every rank holds all of it before and after);
  all_gather      the gathered output (N shards);
  reduce_scatter  the input (N shards, before reduction);
  send, recv      the tensor(s) sent or received, point to point (a pipeline's activations and their
                  gradients between stages).
Bytes each rank really puts on the wire are that times 2(N-1)/N for all_reduce and (N-1)/N for the
other two (`bus_factor`, the nccl-tests factor; also what makes collectives_bench's busbw comparable),
N the size of the group the call ran on.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# op name (without namespace) -> kind; wait_tensor, _wrap_tensor_autograd and the like are not collectives
KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send",
    "recv_": "recv",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}
# the torch.distributed call behind each kind, as collectives_bench names its rows
KIND_OF_OP = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw = algbw x factor: the bytes each rank's link really carries per message byte, for a
    collective over n ranks (a kind, or the op collectives_bench times)."""
    kind = KIND_OF_OP.get(kind, kind)
    if kind == "all_reduce":
        return 2 * (n - 1) / n  # a ring reduce-scatter then a ring all-gather: 2(n-1)/n of the message each
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n  # every rank receives the n-1 chunks it does not own
    return 1.0  # broadcast, reduce, send, recv: the whole message crosses a link once


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def group_of(args: tuple) -> str | None:
    """The name of the process group a c10d op runs on: its ProcessGroup argument's (in-place ops), or the last
    string argument (functional ops take the group's name last: all_reduce(input, op, group_name))."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name().endswith("ProcessGroup"):
            return dist.ProcessGroup.unbox(arg).group_name
    names = [arg for arg in args if isinstance(arg, str)]
    return names[-1] if names else None


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter() as counter: ...` then `counter.calls` and `counter.bytes`, by kind, and
    `counter.switched`: the calls on a process group other than the previous call's (on a CPU with more ranks
    than cores, a collective with a new partner waits longer: benchmarks/collective_costs.collectives_between_compute);
    `counter.on_groups_of`: per (kind, ranks of the group), the calls and their bytes."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.switched: Counter = Counter()
        self.on_groups_of: dict[tuple[str, int], list[int]] = {}
        self.last_group: str | None = None

    def passed(self, group: str) -> None:
        """A call on `group` the counted code makes but does not run here (a fake rank's pipeline sends: it calls
        its stage directly): the next call on another group is one with a new partner."""
        self.last_group = group

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        namespace, _, name = str(func.overloadpacket).partition(".")
        kind = KINDS.get(name) if "c10d" in namespace else None
        if kind:
            self.calls[kind] += 1
            group = group_of(args)
            self.switched[kind] += self.last_group is not None and group != self.last_group
            self.last_group = group
            message = self._message_bytes(kind, namespace == "c10d", args, result)
            self.bytes[kind] += message
            ranks = dist.distributed_c10d._resolve_process_group(group).size() if group else 1
            sized = self.on_groups_of.setdefault((kind, ranks), [0, 0])
            sized[0], sized[1] = sized[0] + 1, sized[1] + message
        return result

    @staticmethod
    def _message_bytes(kind: str, in_place: bool, args: tuple, result) -> int:
        """The full tensor's bytes. In-place c10d ops take (output(s), input(s), group, ...); functional ops
        take (input, ..., group) and return the output."""
        if kind == "all_gather":
            return _nbytes(args[0] if in_place else result)
        if kind in ("reduce_scatter", "all_to_all"):  # what this rank sends (to itself too)
            return _nbytes(args[1] if in_place else args[0])
        return _nbytes(args[0])  # all_reduce, broadcast, send, recv: the tensor(s) themselves
