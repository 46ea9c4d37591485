"""collectives: what does each torch.distributed collective compute? Every op against its closed form.

The collectives tutorial this project corrects (docs/tutorials.md) lists init_process_group, barrier,
all_reduce and reduce, and gets them wrong: it calls all_reduce on a Python list (it takes one tensor,
reduced in place) and says reduce returns the result to every rank (only `dst` holds it). This
experiment uses the raw torch.distributed API on purpose: the process group comes from Accelerate's
state (or torchrun), the collectives are called by hand. What each op costs: collectives_bench.py.

Every op runs on rank-dependent inputs, x_r = (r + 1) * [1, 2, ..., count], and every rank compares
its result with the closed form, for float32, bfloat16 and int64. Examples with n ranks:
all_reduce(SUM) = n(n+1)/2 * base; all_reduce(PRODUCT) = n! * base^n; reduce(dst=0) puts the sum on
rank 0 only; all_to_all sends chunk j of rank r to rank j. A combination the backend refuses (gloo
has no all_reduce AVG for int64, for instance) is recorded as `unsupported` with the backend's own
message: neither a crash nor a pass. summary.json has one check per op.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/collectives.py            # 2 CPU ranks
    torchrun --nproc_per_node 2 experiments/collectives.py --ops all_reduce,broadcast
    accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml experiments/collectives.py      # NCCL
    python experiments/collectives.py      # 1 rank: a 1-process gloo group, so the API still runs
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("collectives.py")

import torch
import torch.distributed as dist

from common.collective_bench import ALL_GATHER_INTO_TENSOR, REDUCE_SCATTER_TENSOR
from common.config import RunArgs, flag, parse_config, require, require_positive, run_cli
from common.run import start_run

EXPERIMENT = "collectives"
VERIFY_OPS = (
    "barrier",
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send_recv",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


@dataclass
class Config(RunArgs):
    ops: str = flag("", "comma-separated subset of ops (default: all): " + ",".join(VERIFY_OPS))
    backend: str = flag(
        "",
        "process-group backend override: gloo, nccl or mpi (default: Accelerate's choice)",
        choices=("", "gloo", "nccl", "mpi"),
    )
    noncontiguous: bool = flag(
        False,
        "pass inputs as strided views (every 2nd element of a buffer): shows gloo's silent wrong answers",
    )
    count: int = flag(6, "elements per rank (kept small so bfloat16 holds every closed form exactly)")

    def validate(self) -> None:
        super().validate()
        require(
            not self.ops.strip() or bool(self.op_list()),
            f"--ops {self.ops!r} names no op; allowed: {', '.join(VERIFY_OPS)}",
        )
        for op in self.op_list():
            require(op in VERIFY_OPS, f"--ops: {op!r} is not a verify op; allowed: {', '.join(VERIFY_OPS)}")
        # Strided inputs only for in-place ops: elsewhere gloo may refuse them on one rank only, and the
        # other rank would wait for a collective that never comes (until --dist_timeout_s).
        in_place = ("all_reduce", "reduce", "broadcast")
        require(
            not self.noncontiguous or set(self.op_list()) <= set(in_place),
            f"--noncontiguous works with --ops from {', '.join(in_place)}, got {self.ops or 'all ops'}",
        )
        require_positive(self, "count")

    def op_list(self) -> list[str]:
        return [op.strip() for op in self.ops.split(",") if op.strip()] or (
            [] if self.ops.strip() else list(VERIFY_OPS)
        )


# ----------------------------------------------------------------------------------------------- verify


def verify_op(
    op: str, variant: str, dtype: torch.dtype, rank: int, n: int, count: int, device, strided: bool = False
) -> str:
    """Run `op` once on x_r = (r+1) * base and compare with its closed form: returns what was checked,
    raises WrongResult when the result differs (and the backend's own error when it refuses).
    `variant` is the reduction of all_reduce (sum, avg, max, min, product) and empty for other ops."""
    base = torch.arange(1, count + 1, dtype=torch.float64)

    def x(r, scale=1.0):
        values = ((r + 1) * scale * base).to(dtype).to(device)  # fresh and contiguous: gloo needs that
        if not strided:
            return values
        buffer = torch.zeros(2 * count, dtype=dtype, device=device)
        buffer[::2] = values
        return buffer[::2]  # same values, stride 2: measured to come back wrong from gloo collectives

    def expect(got, want) -> None:
        tolerance = {torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(dtype, 0)
        if not torch.allclose(got.double().cpu(), want.double(), rtol=tolerance, atol=0):
            raise WrongResult(f"got {got.double().cpu().tolist()}, want {want.double().tolist()}")

    if op == "barrier":
        dist.barrier()
        return "every rank passed it"
    if op == "all_reduce":
        # AVG of integers is the sum divided by n, rounded down (NCCL's integer AVG; gloo refuses it)
        average = (n * (n + 1) // 2 * base) // n if not dtype.is_floating_point else (n + 1) / 2 * base
        want = {
            "sum": n * (n + 1) / 2 * base,
            "avg": average,
            "max": n * base,
            "min": base,
            "product": math.factorial(n) * base**n,
        }[variant]
        tensor = x(rank)
        dist.all_reduce(tensor, op=REDUCE_OPS[variant])  # one tensor, reduced in place: not a Python list
        expect(tensor, want)
        return f"every rank holds the {variant} over ranks"
    if op == "reduce":
        tensor = x(rank)
        dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
        if rank == 0:  # only dst's result is defined; the tutorial's "returned to every rank" is wrong
            expect(tensor, n * (n + 1) / 2 * base)
            return "sum on dst=0 (other ranks' buffers are unspecified)"
        return "not dst: nothing to check"
    if op == "broadcast":
        tensor = x(rank)
        dist.broadcast(tensor, src=0)
        expect(tensor, base)
        return "every rank holds rank 0's tensor"
    if op == "all_gather":
        outputs = [torch.empty(count, dtype=dtype, device=device) for _ in range(n)]
        dist.all_gather(outputs, x(rank))
        for j in range(n):
            expect(outputs[j], (j + 1) * base)
        return "list entry j is rank j's tensor"
    if op == "all_gather_into_tensor":
        output = torch.empty(n * count, dtype=dtype, device=device)
        ALL_GATHER_INTO_TENSOR(output, x(rank))
        expect(output, torch.cat([(j + 1) * base for j in range(n)]))
        return "ranks' tensors concatenated in rank order"
    if op in ("reduce_scatter", "reduce_scatter_tensor"):
        chunks = [x(rank, scale=j + 1) for j in range(n)]  # chunk j of rank r = (r+1)(j+1) * base
        output = torch.empty(count, dtype=dtype, device=device)
        if op == "reduce_scatter":
            dist.reduce_scatter(output, chunks)
        else:
            REDUCE_SCATTER_TENSOR(output, torch.cat(chunks))
        expect(output, (rank + 1) * n * (n + 1) / 2 * base)
        return "rank r holds the sum over ranks of chunk r"
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
        expect(output, want)
        return "rank r receives chunk r of every rank k (value k*n + r)"
    if op == "gather":
        outputs = [torch.empty(count, dtype=dtype, device=device) for _ in range(n)] if rank == 0 else None
        dist.gather(x(rank), gather_list=outputs, dst=0)
        if rank == 0:
            for j in range(n):
                expect(outputs[j], (j + 1) * base)
            return "dst=0 holds every rank's tensor"
        return "not dst: nothing to check"
    if op == "scatter":
        chunks = [x(j) for j in range(n)] if rank == 0 else None
        output = torch.empty(count, dtype=dtype, device=device)
        dist.scatter(output, scatter_list=chunks, src=0)
        expect(output, (rank + 1) * base)
        return "rank r holds src's chunk r"
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
        expect(received, (from_rank + 1) * base)
        return "rank r receives rank r-1's tensor around the ring"
    raise AssertionError(op)


class WrongResult(Exception):
    """A collective returned something other than its closed form."""


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def verify_every_op(cfg: Config, session) -> None:
    """Each op x reduction x dtype on every rank; one check per op; the table of results in session.metrics."""
    rank, n, device = dist.get_rank(), dist.get_world_size(), session.accelerator.device
    results = []
    for op in cfg.op_list():
        if op == "send_recv" and n < 2:
            results.append({"op": op, "dtype": "-", "status": "skipped", "detail": "needs >= 2 ranks"})
            continue
        op_results = []
        for variant in REDUCE_OPS if op == "all_reduce" else [""]:
            for dtype_name, dtype in DTYPES.items() if op != "barrier" else [("-", None)]:
                try:
                    detail = verify_op(op, variant, dtype, rank, n, cfg.count, device, cfg.noncontiguous)
                    status = "ok"
                except WrongResult as error:
                    status, detail = "wrong", f"rank {rank}: {error}"
                except (RuntimeError, ValueError) as error:  # the backend refused this combination
                    status, detail = "unsupported", first_line(error)
                # Every rank's verdict counts (reduce and gather are only checkable on dst).
                verdict = torch.tensor([status != "wrong"], dtype=torch.int32, device=device)
                dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
                if verdict.item() == 0 and status != "wrong":
                    status, detail = "wrong", "another rank got a wrong result"
                name = f"{op}({variant})" if variant else op
                op_results.append({"op": name, "dtype": dtype_name, "status": status, "detail": detail})
        results += op_results
        verified = [r for r in op_results if r["status"] == "ok"]
        wrong = [r for r in op_results if r["status"] == "wrong"]
        session.check(
            op,
            bool(verified) and not wrong,  # unsupported combinations are listed, never counted as passes
            f"{len(verified)} verified, {len(wrong)} wrong, {len(op_results) - len(verified) - len(wrong)} unsupported"
            + "".join(f"; {r['op']}/{r['dtype']} WRONG: {r['detail']}" for r in wrong[:3]),
        )
    for row in results:
        session.print(f"{row['op']:<24} {row['dtype']:<9} {row['status']:<12} {row['detail']}")
    unsupported = {f"{r['op']}/{r['dtype']}": r["detail"] for r in results if r["status"] == "unsupported"}
    session.metrics.update(
        results=results, unsupported=unsupported, verified=sum(r["status"] == "ok" for r in results)
    )


def run(cfg: Config) -> int:
    # needs_process_group: in one process, a 1-rank gloo group, so every call still runs
    with start_run(cfg, EXPERIMENT, needs_process_group=True, backend=cfg.backend or None) as session:
        require(
            not cfg.backend or dist.get_backend() == cfg.backend,
            f"--backend {cfg.backend}: the process group uses {dist.get_backend()}",
        )
        verify_every_op(cfg, session)
        session.metrics["backend"] = dist.get_backend()
    return session.exit_code


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
