"""collectives_bench: what does each torch.distributed collective cost here, against the link's ceiling?

The timing half of the collectives experiment (collectives.py proves what each op computes).
Message sizes from --min_bytes to --max_bytes (powers of two), warm-up, then --repeats timings of
--iters calls each with torch.utils.benchmark (it synchronizes GPUs), the slowest rank's median taken.
algbw = bytes / time; busbw = algbw x the nccl-tests factor (all_reduce 2(n-1)/n; all_gather,
reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1), so busbw compares with the link speed
whatever the op. On one host the link is memory: busbw is also shown as % of this machine's memcpy
bandwidth, measured in the same run. Raw torch.distributed on purpose: the API is the subject.

Checks: every (op, size) row was timed, with finite times > 0, and busbw never exceeds the memcpy
ceiling by more than a factor of --max_memcpy_multiple (a faster-than-memory collective means the
timing is wrong, e.g. a call that did not wait for the data).

Run it:
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml experiments/collectives_bench.py
    accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml experiments/collectives_bench.py  # NCCL
    torchrun --nproc_per_node 2 experiments/collectives_bench.py --ops all_reduce --max_bytes 1048576
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("collectives_bench.py")

import torch.distributed as dist

from common.collective_bench import BENCH_OPS, make_bench_call, memcpy_gbps, plot_busbw, time_per_call_s
from common.comm_counter import bus_factor
from common.config import RunArgs, flag, parse_config, require, require_positive, run_cli
from common.run import start_run

EXPERIMENT = "collectives_bench"


@dataclass
class Config(RunArgs):
    sweep_metrics = ()

    ops: str = flag("", "comma-separated subset of ops (default: all): " + ",".join(BENCH_OPS))
    backend: str = flag(
        "",
        "process-group backend override: gloo, nccl or mpi (default: Accelerate's choice)",
        choices=("", "gloo", "nccl", "mpi"),
    )
    min_bytes: int = flag(1024, "smallest message, bytes (a power of two)")
    max_bytes: int = flag(16 * 2**20, "largest message, bytes (a power of two)")
    warmup: int = flag(3, "untimed calls per size before timing")
    iters: int = flag(10, "calls per timing")
    repeats: int = flag(5, "timings per size (median and spread are over these)")
    memcpy_bytes: int = flag(256 * 2**20, "size of the tensor copy that measures memcpy bandwidth")
    max_memcpy_multiple: float = flag(
        2.0, "fail a row whose busbw exceeds this multiple of memcpy bandwidth (impossible on one host)"
    )

    def validate(self) -> None:
        super().validate()
        require(
            not self.ops.strip() or bool(self.op_list()),
            f"--ops {self.ops!r} names no op; allowed: {', '.join(BENCH_OPS)}",
        )
        for op in self.op_list():
            require(op in BENCH_OPS, f"--ops: {op!r} is not a bench op; allowed: {', '.join(BENCH_OPS)}")
        for name in ("min_bytes", "max_bytes", "memcpy_bytes"):
            value = getattr(self, name)
            require(
                value >= 64 and value & (value - 1) == 0,
                f"--{name} must be a power of two >= 64, got {value}",
            )
        require(
            self.min_bytes <= self.max_bytes,
            f"--min_bytes {self.min_bytes} must be <= --max_bytes {self.max_bytes}",
        )
        require_positive(self, "iters", "repeats", "max_memcpy_multiple")
        require(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")

    def op_list(self) -> list[str]:
        return [op.strip() for op in self.ops.split(",") if op.strip()] or (
            [] if self.ops.strip() else list(BENCH_OPS)
        )


def run(cfg: Config) -> int:
    with start_run(cfg, EXPERIMENT, needs_process_group=True, backend=cfg.backend or None) as session:
        require(
            not cfg.backend or dist.get_backend() == cfg.backend,
            f"--backend {cfg.backend}: the process group uses {dist.get_backend()}",
        )
        n, device = dist.get_world_size(), session.accelerator.device
        copy_gbps = memcpy_gbps(cfg.memcpy_bytes, device)
        sizes = [2**k for k in range(int(math.log2(cfg.min_bytes)), int(math.log2(cfg.max_bytes)) + 1)]
        rows = []
        session.print(f"memcpy bandwidth: {copy_gbps:.2f} GB/s ({n} ranks copying at once)")
        session.print(
            f"{'op':<24}{'bytes':>12}{'time_us':>12}{'spread_us':>11}{'algbw_GB/s':>12}{'busbw_GB/s':>12}{'%memcpy':>9}"
        )
        for op in cfg.op_list():
            for size in sizes:
                fn, message_bytes = make_bench_call(op, size, n, device)
                timings = sorted(time_per_call_s(fn, cfg.warmup, cfg.iters, cfg.repeats, device))
                median = timings[len(timings) // 2]
                algbw = message_bytes / median / 1e9
                busbw = algbw * bus_factor(op, n)
                rows.append(
                    {
                        "op": op,
                        "bytes": message_bytes,
                        "time_us": median * 1e6,
                        "spread_us": (timings[-1] - timings[0]) * 1e6,
                        "algbw_gbps": algbw,
                        "busbw_gbps": busbw,
                        "busbw_pct_of_memcpy": 100 * busbw / copy_gbps,
                    }
                )
                session.print(
                    f"{op:<24}{message_bytes:>12,}{median * 1e6:>12.1f}{rows[-1]['spread_us']:>11.1f}"
                    f"{algbw:>12.3f}{busbw:>12.3f}{rows[-1]['busbw_pct_of_memcpy']:>8.1f}%"
                )
        plot_path = plot_busbw(rows, copy_gbps, n, session.output_dir) if session.is_main else None
        session.log_table("bench", rows, plot_path)
        timed = [(r["op"], r["bytes"]) for r in rows if math.isfinite(r["time_us"]) and r["time_us"] > 0]
        session.check(
            "every_row_timed",
            len(timed) == len(sizes) * len(cfg.op_list()),
            f"{len(timed)} of {len(sizes) * len(cfg.op_list())} rows ({len(cfg.op_list())} ops x {len(sizes)} sizes) "
            "with a finite time > 0",
        )
        too_fast = [
            f"{r['op']}@{r['bytes']}" for r in rows if r["busbw_gbps"] > cfg.max_memcpy_multiple * copy_gbps
        ]
        session.check(
            "below_memory_ceiling",
            not too_fast or device.type != "cpu",
            f"busbw at most {cfg.max_memcpy_multiple}x memcpy ({copy_gbps:.2f} GB/s) on one host; "
            f"over it: {too_fast or 'none'}",
        )
        session.metrics.update(rows=rows, memcpy_gbps=copy_gbps, plot=plot_path, backend=dist.get_backend())
    return session.exit_code


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
