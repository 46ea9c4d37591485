"""Timing collectives, shared by experiments/collectives_bench.py and benchmarks/ (which must not import an
experiment): message construction, fixed-count timing that cannot make ranks disagree, and this host's memcpy
bandwidth as the ceiling on one host (the bus factor that makes busbw comparable across ops is
common/comm_counter.bus_factor, which the counted bytes of a training step use too).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.benchmark import Timer

BENCH_OPS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "send_recv",  # point to point, as a pipeline's stages send activations: even ranks send, odd ones receive
)
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn).
ALL_GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def make_bench_call(op: str, size_bytes: int, n: int, device):
    """A closure issuing `op` on a float32 message of about size_bytes (rounded down to n chunks).
    Message size follows nccl-tests: the whole array (all_gather: the output, reduce_scatter: the input)."""
    elements = max(size_bytes // 4 // n, 1) * n
    full, chunk = torch.ones(elements, device=device), torch.ones(elements // n, device=device)
    rank = dist.get_rank()
    peer = rank ^ 1  # pairs 0-1, 2-3, ...; on an odd count the last rank has no partner and idles

    def send_recv():
        if peer < n:
            (dist.send if rank % 2 == 0 else dist.recv)(full, peer)

    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather_into_tensor": lambda: ALL_GATHER_INTO_TENSOR(full, chunk),
        "reduce_scatter_tensor": lambda: REDUCE_SCATTER_TENSOR(chunk, full),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(full), full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "reduce": lambda: dist.reduce(full, dst=0),
        "send_recv": send_recv,
    }
    return calls[op], elements * 4


def time_per_call_s(fn, warmup: int, iters: int, repeats: int, device) -> list[float]:
    """`repeats` timings of `iters` calls each (after `warmup` untimed calls), with torch.utils.benchmark
    (which synchronizes CUDA).
    Every rank runs the same fixed counts: an adaptive count (blocked_autorange) would let ranks
    disagree on how many collectives to issue, and hang."""
    for _ in range(warmup):
        fn()
    timer = Timer(stmt="fn()", globals={"fn": fn})
    timings = []
    for _ in range(repeats):
        dist.barrier()  # start each timing together, or the first rank's time includes waiting for the last
        timings.append(timer.timeit(iters).mean)
    slowest = torch.tensor(timings, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective is as fast as its slowest rank
    return slowest.tolist()


def memcpy_gbps(copy_bytes: int, device) -> float:
    """This host's copy bandwidth, every rank copying at once as in a collective (mean over ranks of each rank's
    best of 5 copies: a ceiling is what the memory can do, and a mean let one copy slowed by other work on the
    cores pull it under the collectives measured after it; that failed the ceiling check under a loaded suite)."""
    source = torch.ones(copy_bytes // 4, device=device)
    target = torch.empty_like(source)
    dist.barrier()
    timer = Timer(stmt="target.copy_(source)", globals={"target": target, "source": source})
    seconds = min(timer.timeit(1).mean for _ in range(5))
    bandwidth = torch.tensor([copy_bytes / seconds / 1e9], dtype=torch.float64, device=device)
    dist.all_reduce(bandwidth)
    return bandwidth.item() / dist.get_world_size()


def plot_busbw(rows: list[dict], copy_gbps: float, n: int, output_dir: str) -> str:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to leave behind

    figure = Figure(figsize=(8, 5))
    axes = figure.subplots()
    for op in dict.fromkeys(r["op"] for r in rows):
        points = [(r["bytes"], r["busbw_gbps"]) for r in rows if r["op"] == op]
        axes.plot(*zip(*points, strict=True), marker="o", label=op)
    axes.axhline(copy_gbps, color="grey", linestyle="--", label=f"memcpy {copy_gbps:.1f} GB/s")
    axes.set(
        xscale="log",
        xlabel="message size (bytes)",
        ylabel="busbw (GB/s)",
        title=f"busbw vs message size, {n} ranks",
    )
    axes.legend(fontsize=8)
    path = os.path.join(output_dir, "busbw.png")
    figure.savefig(path, dpi=100, bbox_inches="tight")
    return path
