"""gloo's collectives as a training step issues them, measured (benchmarks/op_costs.py runs them): each after some
compute, with the same partner or a new one, and a receive posted late."""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

COLLECTIVE_BYTES = [2**k for k in range(14, 23, 2)]  # 16 KB to 4 MB: what a layout's collectives carry here
# each size's calls: on 2 ranks each one beside a compute alone; on 4 ranks in 4 turns with the compute alone (60
# calls, timed once, fitted a same-partner all-reduce at 0.4-1.4 ms latency in four runs a minute apart; 240 in
# turns, averaged over the ranks: 1.3-1.5 ms)
CALLS_OF_2, CALLS_OF_4, TURNS = 120, 240, 4
COMPUTE_BETWEEN = 256  # a 256-square matmul (about 0.3 ms here) three times between two collectives


def collectives_between_compute(same_group: bool = False, whole_world: bool = False) -> list[dict]:
    """gloo's collectives as a training step issues them: each after some compute, the two ranks not in lockstep
    (back to back, as a collectives benchmark times them, a 1 MB all-reduce took 0.75 ms here; after 1 ms of
    matmuls, 2.9 ms). Per kind and size: the MEAN time of (compute + collective) minus the compute's alone, the
    ranks' figures averaged. A step's time is the sum of its collectives, so their mean is what it pays: two
    ranks' threads (compute and gloo's) on two cores leave a long tail (a 128 KB all-reduce after 1 ms of
    matmuls: median 1.3 ms, mean 1.9; in a tp run's profile, 95 waits: median 1.2 ms, mean 2.1). The median,
    used before, dropped it: tp's 19 all-reduces a step were priced at 9.6 ms against the 40 ms the profile shows
    them waiting.

    On 4 ranks (2 a core) the ranks pair as a 2 x 2 layout's two dimensions: each call with the partner of its
    rank's previous one (`same_group`, as tp's chained all-reduces) or each with the other partner (as FSDP's
    all-gathers between tp's all-reduces). The compute alone is timed in a phase of its own, every rank computing:
    timed between the collectives (the 2-rank way) it ran while the other pair waited in theirs, on a core less
    shared than a step's, and a 64 KB all-reduce read 2.4-2.9 ms against 1.6-2.4 measured by phases."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename: the same op
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN), torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN)
    groups = [None]  # 2 ranks: the world
    if world == 4 and not whole_world:
        rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = [rows[rank // 2]] if same_group else [rows[rank // 2], columns[rank % 2]]
    size_of = dist.get_world_size(groups[0])

    def compute():
        for _ in range(3):
            torch.mm(a, b)

    def timed(run, calls: int) -> list[float]:
        took = []
        for i in range(calls):
            started = time.perf_counter()
            compute()
            if run:
                run(groups[i % len(groups)])
            took.append(time.perf_counter() - started)
        return took

    partner = (rank + world // 2) % world  # a pipeline's next or previous stage (the outer dimension)

    def exchange(tensor: torch.Tensor) -> None:
        """A stage's send and receive, one each way, as torch's schedules post them."""
        first, then = (dist.isend, dist.irecv) if rank < partner else (dist.irecv, dist.isend)
        for op in (first, then):  # post them (batch_isend_irecv); each work waited on once
            for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, partner)]):
                work.wait()

    rows = []
    # 4 ranks, each call with a new partner: also a pipeline's sends on shared cores, priced a send and a receive
    kinds = ("all_reduce", "all_gather", "reduce_scatter") + (
        ("send",) if world > 2 and not (same_group or whole_world) else ()
    )
    for kind in kinds:
        for size in COLLECTIVE_BYTES:
            whole = torch.zeros(size // 4)
            part = torch.zeros(size // 4 // size_of)
            run = {"all_reduce": lambda g: dist.all_reduce(whole, group=g),  # noqa: B023
                   "all_gather": lambda g: dist.all_gather_into_tensor(whole, part, group=g),  # noqa: B023
                   "reduce_scatter": lambda g: dist.reduce_scatter_tensor(part, whole, group=g),  # noqa: B023
                   "send": lambda g: exchange(whole)}[kind]  # noqa: B023 # fmt: skip
            dist.barrier()
            both, alone = [], []
            if world <= 2:  # each rank its own core: the compute alone between the collectives
                for _ in range(CALLS_OF_2):
                    both += timed(run, 1)
                    alone += timed(None, 1)
            else:  # in turns, so that the machine's drift reaches both alike
                for _ in range(TURNS):
                    dist.barrier()
                    alone += timed(None, CALLS_OF_4 // TURNS)
                    dist.barrier()
                    both += timed(run, CALLS_OF_4 // TURNS)
            seconds = max(statistics.mean(both) - statistics.mean(alone), 1e-6)
            rows.append({"op": kind, "bytes": size, "time_us": seconds * 1e6})
    each = [None] * world  # every rank's figures (a rank's own wait is a step's): their mean
    dist.all_gather_object(each, rows)
    return [{**row, "time_us": statistics.mean(r[i]["time_us"] for r in each)} for i, row in enumerate(rows)]


def late_receive_us(rounds: int = 60) -> float:
    """What a pipeline's receive waits when it is posted after its data was sent: rank 0 sends (a micro-batch's
    activations, 32 and 256 KB) and goes on computing for 3 ms, as a stage goes on to its next micro-batch; rank
    1 posts its receive 1.5 ms later, as a stage reaching the forward that needs it; the receive's mean time
    (torch's schedules post each receive when they reach its action: in a 1F1B step on these 2 cores the last
    stage waited 1.0-1.9 ms before each steady-state forward whose input had been sent long before)."""
    import torch.distributed as dist

    a, b = torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN), torch.randn(COMPUTE_BETWEEN, COMPUTE_BETWEEN)

    def compute(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            torch.mm(a, b)

    waited = []
    for size in (32 * 1024, 256 * 1024):
        message = torch.zeros(size // 4)
        for _ in range(rounds):
            dist.barrier()
            if dist.get_rank() == 0:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, message, 1)])
                compute(3e-3)
            else:
                compute(1.5e-3)
                started = time.perf_counter()
                works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, message, 0)])
            for work in works:  # once each: a gloo receive waited on again waits for another message
                work.wait()
            if dist.get_rank() == 1:
                waited.append(time.perf_counter() - started)
    each = [0.0, 0.0]
    dist.all_gather_object(each, statistics.mean(waited) if waited else 0.0)
    return round(each[1] * 1e6, 2)  # rank 1's: the receiver's
