"""collectives: what does each torch.distributed collective compute, and what does it cost here?

Seed 000 lists init_process_group, barrier, all_reduce and reduce, and gets them wrong: it calls
all_reduce on a Python list (it takes one tensor, reduced in place) and says reduce returns the result
to every rank (only `dst` holds it). This experiment uses the raw torch.distributed API on purpose:
the process group comes from Accelerate's state (or torchrun), the collectives are called by hand.

Verify mode (default): every op runs on rank-dependent inputs, x_r = (r + 1) * [1, 2, ..., count], and
every rank compares its result with the closed form, for float32, bfloat16 and int64. Examples with
n ranks: all_reduce(SUM) = n(n+1)/2 * base; all_reduce(PRODUCT) = n! * base^n; reduce(dst=0) puts the
sum on rank 0 only; all_to_all sends chunk j of rank r to rank j. A combination the backend refuses
(gloo has no all_reduce AVG for int64, for instance) is recorded as `unsupported` with the backend's
own message: neither a crash nor a pass. summary.json has one check per op.

Bench mode (--bench): message sizes from --min_bytes to --max_bytes (powers of two), warm-up, then
--repeats timings of --iters calls each with torch.utils.benchmark (it synchronizes GPUs), the slowest
rank's median taken. algbw = bytes / time; busbw = algbw x the nccl-tests factor (all_reduce 2(n-1)/n;
all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1), so busbw compares with the link
speed whatever the op. On one host the link is memory: busbw is also shown as % of this machine's
memcpy bandwidth, measured in the same run.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/collectives.py            # verify, 2 CPU ranks
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/collectives.py --bench    # benchmark
    torchrun --nproc_per_node 2 experiments/collectives.py --ops all_reduce,broadcast
    accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml experiments/collectives.py --bench  # NCCL
    python experiments/collectives.py      # 1 rank: a 1-process gloo group made here, so the API still runs
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.utils.benchmark import Timer

from common.config import RunArgs, UsageError, flag, parse_config, require, require_positive, run_cli
from common.runtime import check_distributed, make_accelerator, one_rank_group_if_needed, prepare_output_dir
from common.tracking import RunRecorder, resolve_trackers

EXPERIMENT = "collectives"
VERIFY_OPS = ("barrier", "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send_recv")
BENCH_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast", "reduce")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn).
ALL_GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "product": dist.ReduceOp.PRODUCT}


@dataclass
class Config(RunArgs):
    ops: str = flag("", "comma-separated subset of ops (default: all); verify: " + ",".join(VERIFY_OPS) + "; bench: " + ",".join(BENCH_OPS))
    backend: str = flag("", "process-group backend override: gloo, nccl or mpi (default: Accelerate's choice)", choices=("", "gloo", "nccl", "mpi"))
    noncontiguous: bool = flag(False, "pass inputs as strided views (every 2nd element of a buffer): shows gloo's silent wrong answers")
    count: int = flag(6, "elements per rank in verify mode (kept small so bfloat16 holds every closed form exactly)")
    bench: bool = flag(False, "benchmark instead of verify")
    min_bytes: int = flag(1024, "smallest benchmark message, bytes (a power of two)")
    max_bytes: int = flag(16 * 2**20, "largest benchmark message, bytes (a power of two)")
    warmup: int = flag(3, "untimed calls per size before timing")
    iters: int = flag(10, "calls per timing")
    repeats: int = flag(5, "timings per size (median and spread are over these)")
    memcpy_bytes: int = flag(256 * 2**20, "size of the tensor copy that measures memcpy bandwidth")

    def validate(self) -> None:
        super().validate()
        allowed = BENCH_OPS if self.bench else VERIFY_OPS
        for op in self.op_list():
            require(op in allowed, f"--ops: {op!r} is not a {'bench' if self.bench else 'verify'} op; allowed: {', '.join(allowed)}")
        # Strided inputs only for in-place ops: elsewhere gloo may refuse them on one rank only, and the
        # other rank would wait for a collective that never comes (until --dist_timeout_s).
        in_place = ("all_reduce", "reduce", "broadcast")
        require(not self.noncontiguous or set(self.op_list()) <= set(in_place),
                f"--noncontiguous works with --ops from {', '.join(in_place)}, got {self.ops or 'all ops'}")
        for name in ("min_bytes", "max_bytes", "memcpy_bytes"):
            value = getattr(self, name)
            require(value >= 64 and value & (value - 1) == 0, f"--{name} must be a power of two >= 64, got {value}")
        require(self.min_bytes <= self.max_bytes, f"--min_bytes {self.min_bytes} must be <= --max_bytes {self.max_bytes}")
        require_positive(self, "count", "iters", "repeats")
        require(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")

    def op_list(self) -> list[str]:
        return [op.strip() for op in self.ops.split(",") if op.strip()] or list(BENCH_OPS if self.bench else VERIFY_OPS)


# ----------------------------------------------------------------------------------------------- verify

def verify_op(op: str, variant: str, dtype: torch.dtype, rank: int, n: int, count: int, device, strided: bool = False) -> tuple[bool, str]:
    """Run `op` once on x_r = (r+1) * base and compare with its closed form. Returns (ok, detail).
    `variant` is the reduction of all_reduce (sum, avg, max, min, product) and empty for other ops."""
    base = torch.arange(1, count + 1, dtype=torch.float64)

    def x(r, scale=1.0):
        values = ((r + 1) * scale * base).to(dtype).to(device)  # fresh and contiguous: gloo needs that
        if not strided:
            return values
        buffer = torch.zeros(2 * count, dtype=dtype, device=device)
        buffer[::2] = values
        return buffer[::2]  # same values, stride 2: measured to come back wrong from gloo collectives

    def close(got, want) -> bool:
        tolerance = {torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(dtype, 0)
        if not torch.allclose(got.double().cpu(), want.double(), rtol=tolerance, atol=0):
            raise WrongResult(f"got {got.double().cpu().tolist()}, want {want.double().tolist()}")
        return True

    if op == "barrier":
        dist.barrier()
        return True, "every rank passed it"
    if op == "all_reduce":
        want = {"sum": n * (n + 1) / 2 * base, "avg": (n + 1) / 2 * base, "max": n * base, "min": base,
                "product": math.factorial(n) * base**n}[variant]
        tensor = x(rank)
        dist.all_reduce(tensor, op=REDUCE_OPS[variant])  # one tensor, reduced in place: not a Python list
        return close(tensor, want), f"every rank holds the {variant} over ranks"
    if op == "reduce":
        tensor = x(rank)
        dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
        if rank == 0:  # only dst's result is defined; the seed's "returned to every rank" is wrong
            return close(tensor, n * (n + 1) / 2 * base), "sum on dst=0 (other ranks' buffers are unspecified)"
        return True, "not dst: nothing to check"
    if op == "broadcast":
        tensor = x(rank)
        dist.broadcast(tensor, src=0)
        return close(tensor, base), "every rank holds rank 0's tensor"
    if op == "all_gather":
        outputs = [torch.empty(count, dtype=dtype, device=device) for _ in range(n)]
        dist.all_gather(outputs, x(rank))
        return all(close(outputs[j], (j + 1) * base) for j in range(n)), "list entry j is rank j's tensor"
    if op == "all_gather_into_tensor":
        output = torch.empty(n * count, dtype=dtype, device=device)
        ALL_GATHER_INTO_TENSOR(output, x(rank))
        return close(output, torch.cat([(j + 1) * base for j in range(n)])), "ranks' tensors concatenated in rank order"
    if op in ("reduce_scatter", "reduce_scatter_tensor"):
        chunks = [x(rank, scale=j + 1) for j in range(n)]  # chunk j of rank r = (r+1)(j+1) * base
        output = torch.empty(count, dtype=dtype, device=device)
        if op == "reduce_scatter":
            dist.reduce_scatter(output, chunks)
        else:
            REDUCE_SCATTER_TENSOR(output, torch.cat(chunks))
        return close(output, (rank + 1) * n * (n + 1) / 2 * base), "rank r holds the sum over ranks of chunk r"
    if op in ("all_to_all", "all_to_all_single"):
        chunks = [torch.full((count,), rank * n + j, dtype=dtype, device=device) for j in range(n)]  # r -> j
        if op == "all_to_all":
            outputs = [torch.empty(count, dtype=dtype, device=device) for _ in range(n)]
            dist.all_to_all(outputs, chunks)
            output = torch.cat(outputs)
        else:
            output = torch.empty(n * count, dtype=dtype, device=device)
            dist.all_to_all_single(output, torch.cat(chunks))
        want = torch.cat([torch.full((count,), k * n + rank, dtype=torch.float64) for k in range(n)])
        return close(output, want), "rank r receives chunk r of every rank k (value k*n + r)"
    if op == "gather":
        outputs = [torch.empty(count, dtype=dtype, device=device) for _ in range(n)] if rank == 0 else None
        dist.gather(x(rank), gather_list=outputs, dst=0)
        if rank == 0:
            return all(close(outputs[j], (j + 1) * base) for j in range(n)), "dst=0 holds every rank's tensor"
        return True, "not dst: nothing to check"
    if op == "scatter":
        chunks = [x(j) for j in range(n)] if rank == 0 else None
        output = torch.empty(count, dtype=dtype, device=device)
        dist.scatter(output, scatter_list=chunks, src=0)
        return close(output, (rank + 1) * base), "rank r holds src's chunk r"
    if op == "send_recv":
        # A ring: even ranks send first, odd ranks receive first, so blocking calls cannot deadlock.
        received = torch.empty(count, dtype=dtype, device=device)
        to_rank, from_rank = (rank + 1) % n, (rank - 1) % n
        if rank % 2 == 0:
            dist.send(x(rank), dst=to_rank)
            dist.recv(received, src=from_rank)
        else:
            dist.recv(received, src=from_rank)
            dist.send(x(rank), dst=to_rank)
        return close(received, (from_rank + 1) * base), "rank r receives rank r-1's tensor around the ring"
    raise AssertionError(op)


class WrongResult(Exception):
    """A collective returned something other than its closed form."""


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def run_verify(cfg: Config, accelerator, recorder) -> tuple[dict, dict]:
    rank, n = dist.get_rank(), dist.get_world_size()
    checks, results = {}, []
    for op in cfg.op_list():
        if op == "send_recv" and n < 2:
            results.append({"op": op, "dtype": "-", "status": "skipped", "detail": "needs >= 2 ranks"})
            continue
        op_results = []
        for variant in REDUCE_OPS if op == "all_reduce" else [""]:
            for dtype_name, dtype in DTYPES.items() if op != "barrier" else [("-", None)]:
                try:
                    _, detail = verify_op(op, variant, dtype, rank, n, cfg.count, accelerator.device, cfg.noncontiguous)
                    status = "ok"
                except WrongResult as error:
                    status, detail = "wrong", f"rank {rank}: {error}"
                except (RuntimeError, ValueError) as error:  # the backend refused this combination
                    status, detail = "unsupported", first_line(error)
                # Every rank's verdict counts (reduce and gather are only checkable on dst).
                verdict = torch.tensor([status != "wrong"], dtype=torch.int32, device=accelerator.device)
                dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
                if verdict.item() == 0 and status != "wrong":
                    status, detail = "wrong", "another rank got a wrong result"
                name = f"{op}({variant})" if variant else op
                op_results.append({"op": name, "dtype": dtype_name, "status": status, "detail": detail})
        results += op_results
        verified = [r for r in op_results if r["status"] == "ok"]
        wrong = [r for r in op_results if r["status"] == "wrong"]
        checks[op] = {
            "passed": bool(verified) and not wrong,  # unsupported combinations are listed, never counted as passes
            "detail": f"{len(verified)} verified, {len(wrong)} wrong, {len(op_results) - len(verified) - len(wrong)} unsupported"
            + "".join(f"; {r['op']}/{r['dtype']} WRONG: {r['detail']}" for r in wrong[:3]),
        }
    for row in results:
        recorder.print(f"{row['op']:<24} {row['dtype']:<9} {row['status']:<12} {row['detail']}")
    unsupported = {f"{r['op']}/{r['dtype']}": r["detail"] for r in results if r["status"] == "unsupported"}
    return checks, {"results": results, "unsupported": unsupported, "verified": sum(r["status"] == "ok" for r in results)}


# ------------------------------------------------------------------------------------------------ bench

def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw = algbw x factor: the bytes each rank's link really carries per message byte."""
    if op == "all_reduce":
        return 2 * (n - 1) / n  # a ring reduce-scatter then a ring all-gather: 2(n-1)/n of the message each
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return (n - 1) / n  # every rank receives the n-1 chunks it does not own
    return 1.0  # broadcast, reduce: the whole message crosses a link once


def make_bench_call(op: str, size_bytes: int, n: int, device):
    """A closure issuing `op` on a float32 message of about size_bytes (rounded down to n chunks).
    Message size follows nccl-tests: the whole array (all_gather: the output, reduce_scatter: the input)."""
    elements = max(size_bytes // 4 // n, 1) * n
    full, chunk = torch.ones(elements, device=device), torch.ones(elements // n, device=device)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather_into_tensor": lambda: ALL_GATHER_INTO_TENSOR(full, chunk),
        "reduce_scatter_tensor": lambda: REDUCE_SCATTER_TENSOR(chunk, full),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(full), full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "reduce": lambda: dist.reduce(full, dst=0),
    }
    return calls[op], elements * 4


def time_per_call_s(fn, cfg: Config, device) -> list[float]:
    """`repeats` timings of `iters` calls each, with torch.utils.benchmark (which synchronizes CUDA).
    Every rank runs the same fixed counts: an adaptive count (blocked_autorange) would let ranks
    disagree on how many collectives to issue, and hang."""
    for _ in range(cfg.warmup):
        fn()
    timer = Timer(stmt="fn()", globals={"fn": fn})
    timings = []
    for _ in range(cfg.repeats):
        dist.barrier()  # start each timing together, or the first rank's time includes waiting for the last
        timings.append(timer.timeit(cfg.iters).mean)
    slowest = torch.tensor(timings, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective is as fast as its slowest rank
    return slowest.tolist()


def memcpy_gbps(cfg: Config, device) -> float:
    """This host's copy bandwidth, every rank copying at once as in a collective (mean over ranks)."""
    source = torch.ones(cfg.memcpy_bytes // 4, device=device)
    target = torch.empty_like(source)
    dist.barrier()
    seconds = Timer(stmt="target.copy_(source)", globals={"target": target, "source": source}).timeit(5).mean
    bandwidth = torch.tensor([cfg.memcpy_bytes / seconds / 1e9], dtype=torch.float64, device=device)
    dist.all_reduce(bandwidth)
    return bandwidth.item() / dist.get_world_size()


def run_bench(cfg: Config, accelerator, recorder) -> tuple[dict, dict]:
    n, device = dist.get_world_size(), accelerator.device
    copy_gbps = memcpy_gbps(cfg, device)
    sizes = [2**k for k in range(int(math.log2(cfg.min_bytes)), int(math.log2(cfg.max_bytes)) + 1)]
    rows = []
    recorder.print(f"memcpy bandwidth: {copy_gbps:.2f} GB/s ({n} ranks copying at once)")
    recorder.print(f"{'op':<24}{'bytes':>12}{'time_us':>12}{'spread_us':>11}{'algbw_GB/s':>12}{'busbw_GB/s':>12}{'%memcpy':>9}")
    for op in cfg.op_list():
        for size in sizes:
            fn, message_bytes = make_bench_call(op, size, n, device)
            timings = sorted(time_per_call_s(fn, cfg, device))
            median = timings[len(timings) // 2]
            algbw = message_bytes / median / 1e9
            busbw = algbw * bus_factor(op, n)
            row = {"op": op, "bytes": message_bytes, "time_us": median * 1e6, "spread_us": (timings[-1] - timings[0]) * 1e6,
                   "algbw_gbps": algbw, "busbw_gbps": busbw, "busbw_pct_of_memcpy": 100 * busbw / copy_gbps}
            rows.append(row)
            recorder.log(len(rows), row, console=False)
            recorder.print(f"{op:<24}{message_bytes:>12,}{row['time_us']:>12.1f}{row['spread_us']:>11.1f}"
                           f"{algbw:>12.3f}{busbw:>12.3f}{row['busbw_pct_of_memcpy']:>8.1f}%")
    plot_path = plot_busbw(rows, copy_gbps, n, recorder.output_dir) if recorder.is_main else None
    recorder.log_wandb_table_and_image("bench", rows, plot_path)
    well_formed = all(math.isfinite(r["time_us"]) and r["time_us"] > 0 for r in rows) and len(rows) == len(sizes) * len(cfg.op_list())
    checks = {"bench_rows": {"passed": well_formed, "detail": f"{len(rows)} rows ({len(cfg.op_list())} ops x {len(sizes)} sizes), all times finite and > 0"}}
    return checks, {"rows": rows, "memcpy_gbps": copy_gbps, "plot": plot_path}


def plot_busbw(rows: list[dict], copy_gbps: float, n: int, output_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for op in dict.fromkeys(r["op"] for r in rows):
        points = [(r["bytes"], r["busbw_gbps"]) for r in rows if r["op"] == op]
        axes.plot(*zip(*points, strict=True), marker="o", label=op)
    axes.axhline(copy_gbps, color="grey", linestyle="--", label=f"memcpy {copy_gbps:.1f} GB/s")
    axes.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s)", title=f"busbw vs message size, {n} ranks")
    axes.legend(fontsize=8)
    path = os.path.join(output_dir, "busbw.png")
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return path


# -------------------------------------------------------------------------------------------------- run

def run(cfg: Config) -> int:
    output_dir = prepare_output_dir(cfg, EXPERIMENT)
    log_with, init_kwargs, tracker_notes = resolve_trackers(cfg.report_to, output_dir)
    accelerator = make_accelerator(cfg, output_dir, log_with=log_with, backend=cfg.backend or None)
    recorder = RunRecorder(accelerator, EXPERIMENT, cfg, output_dir, init_kwargs, tracker_notes)
    checks = {"distributed": check_distributed(accelerator, cfg)}
    if not checks["distributed"]["passed"]:
        return recorder.finish({}, checks)
    own_group = one_rank_group_if_needed()  # one process: a 1-rank gloo group, so every call still runs
    if cfg.backend and dist.get_backend() != cfg.backend:
        raise UsageError(f"--backend {cfg.backend}: the process group uses {dist.get_backend()}")
    checks_run, metrics = (run_bench if cfg.bench else run_verify)(cfg, accelerator, recorder)
    checks.update(checks_run)
    metrics["backend"] = dist.get_backend()
    if own_group:
        dist.destroy_process_group()
    return recorder.finish(metrics, checks)


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
