"""This machine's op model (planning/op_model.py's OpModel), measured: the matmuls and attention kernels at the
shapes the layouts run (as the fake ranks recorded them), an elementwise op's bandwidth by size
(benchmarks/kernel_costs.py), what eager PyTorch and DTensor cost per op dispatched (benchmarks/overhead_costs.py),
and gloo's collectives as a step issues them (benchmarks/collective_costs.py). Measured as the ranks run: two ranks
under torchrun (benchmarks/workers.spawn), one thread each, so the two share the cores, the caches and the memory
bus as two ranks of a layout do. benchmarks/at_scale_calibration.py calls `measure_this_machine` and writes the
result into the this_machine profile.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.collective_costs import collectives_between_compute, late_receive_us
from benchmarks.kernel_costs import attention_gflops, gemm_gflops, memory_points, overheads_us, timed_ops
from benchmarks.overhead_costs import (
    dtensor_gaps,
    eager_gaps,
    fsdp_overhead_us,
    functional_collective_overhead_us,
    gaps_of,
    redistribute_overhead_us,
    shared_core_ratio,
)
from benchmarks.workers import benchmark_parser, run_worker, scratch_folder, spawn, write_result


def measure(spec: dict) -> dict:
    """One rank's measurement of `spec` ({gemm: [(shape, dtype)], attention: [(shape, dtype)], replays, budget_s,
    model_shape, rows}), one thread. What a step costs beyond its ops is measured last, its ops priced by the
    table just timed (the prediction's own prices), the ranks starting together (as a layout's ranks run)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    budget = spec["budget_s"]
    figures = {
        **overheads_us(budget),
        "memory_points": memory_points(budget),
        "gemm_points": [
            {"shape": list(shape), "dtype": dtype, "gflops": round(gemm_gflops(shape, dtype, budget), 3)}
            for shape, dtype in spec["gemm"]
        ],  # fmt: skip
        "attention_points": [
            {"shape": list(shape), "dtype": dtype, "gflops": round(attention_gflops(shape, dtype, budget), 3)}
            for shape, dtype in spec["attention"]
        ],  # fmt: skip
        "measured_ops": timed_ops(spec["replays"], budget / 10),
        "eager_gaps": {},
    }
    if spec.get("model_shape"):
        timed = {key: us * 1e-6 for key, us in figures["measured_ops"].items()}
        dist.barrier()
        figures["eager_gaps"] = eager_gaps(spec["model_shape"], spec["rows"], budget, timed)
        dist.barrier()
        figures["redistribute_overhead_us"] = redistribute_overhead_us(budget, figures, timed)
        dist.barrier()
        figures["dtensor_gaps"] = dtensor_gaps(spec["model_shape"], spec["rows"], budget, figures, timed)
        dist.barrier()
        figures["fsdp_overhead_us"] = fsdp_overhead_us(
            spec["model_shape"], spec["rows"], budget, figures, timed
        )
        dist.barrier()
        figures["functional_collective_overhead_us"] = functional_collective_overhead_us(
            spec["model_shape"], spec["rows"], budget, figures, timed
        )
        dist.barrier()
        figures["shared_core_ratio"] = shared_core_ratio(spec["model_shape"], spec["rows"])
    return figures


def merged(results: list[dict]) -> dict:
    """Two ranks' measurements as one: each figure their mean (an op either rank could not run: left out)."""
    mean = lambda key: round((results[0][key] + results[1][key]) / 2, 2)  # noqa: E731
    figures = {key: mean(key) for key in ("op_overhead_us", "view_overhead_us", "redistribute_overhead_us",
                                          "fsdp_overhead_us", "functional_collective_overhead_us",
                                          "shared_core_ratio") if key in results[0]}  # fmt: skip
    figures["dtensor_gaps"] = {
        k: round((v + results[1]["dtensor_gaps"][k]) / 2, 2)
        for k, v in results[0].get("dtensor_gaps", {}).items()
    }
    figures["eager_gaps"] = {}  # none without a model to step
    if "points" in results[0].get("eager_gaps", {}):  # the two ranks' points averaged, then fitted
        points = {phase: [{**p, "beyond_us": round((p["beyond_us"] + q["beyond_us"]) / 2, 2)}
                          for p, q in zip(ranks_points, results[1]["eager_gaps"]["points"][phase], strict=True)]
                  for phase, ranks_points in results[0]["eager_gaps"]["points"].items()}  # fmt: skip
        figures["eager_gaps"] = {**gaps_of(points), "points": points}
    both = results[0]["measured_ops"].keys() & results[1]["measured_ops"].keys()
    figures["measured_ops"] = {k: round((results[0]["measured_ops"][k] + results[1]["measured_ops"][k]) / 2, 3)
                              for k in sorted(both)}  # fmt: skip
    for key, field in (("memory_points", "gbps"), ("gemm_points", "gflops"), ("attention_points", "gflops")):
        figures[key] = [
            {**p, field: round((p[field] + q[field]) / 2, 3)}
            for p, q in zip(results[0][key], results[1][key], strict=False)
        ]
    return figures


def worker(args):
    """Each rank: gloo's collectives after compute, then the ops of the spec, both ranks at once; rank 0 writes
    both ranks' figures merged."""
    import torch.distributed as dist

    from common.config import RunArgs
    from common.runtime import make_accelerator

    accelerator = make_accelerator(RunArgs(), scratch_folder(args))
    collective_rows = collectives_between_compute()
    late_receive = late_receive_us() if dist.get_world_size() == 2 else None
    # no spec: the collectives alone (4 ranks on the 2 cores), each with its last call's partner, and over all 4
    if not args.spec:
        same_group_rows = collectives_between_compute(same_group=True)
        group_of_4_rows = collectives_between_compute(whole_world=True)
        if accelerator.is_main_process:
            write_result(args.result, {"collective_rows": collective_rows, "same_group_rows": same_group_rows,
                                       "group_of_4_rows": group_of_4_rows})  # fmt: skip
        return accelerator
    with open(args.spec, "rb") as handle:
        spec = pickle.load(handle)
    dist.barrier()  # the two ranks measure the ops side by side
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, measure(spec))
    if accelerator.is_main_process:
        write_result(args.result, {"collective_rows": collective_rows,
                                   "ops": {**merged(each), "late_receive_us": late_receive}})  # fmt: skip
    return accelerator  # run_worker shuts it down


def fitted_of(rows: list[dict]) -> dict:
    """gloo's collectives_between_compute rows as a fit per kind: latency + bytes / bandwidth."""
    from benchmarks.performance import fit_alpha_beta

    return {kind: {"bandwidth_gbps": round(f["bandwidth_gbps"] or 1e6, 3), "latency_us": round(f["alpha_us"])}
            for kind, f in fit_alpha_beta(rows).items()}  # fmt: skip


def measure_this_machine(spec: dict, timeout_s: float = 1800) -> tuple[dict, dict, dict]:
    """The op model's figures and gloo's fit per kind (latency + bytes / bandwidth), measured on 2 ranks; and the
    same fits on twice as many ranks as cores, in pairs (what a 4-rank layout's collectives cost on 2 cores: each
    rank's compute shares a core, and a partner may wait for its turn on one; a collective between two of 4 ranks
    here took 1.3-2.3x what it took between 2 ranks): {"switching": each call with a new partner, "same_group":
    each with its last call's, "group_of_4": each over all 4 ranks (a dimension of 4)}."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "spec.pickle")  # OpCall replays hold dtypes and TensorSpecs: not JSON
        with open(path, "wb") as handle:
            pickle.dump(spec, handle)
        result = spawn("op_costs.py", 2, ["--spec", path], timeout_s)
    shared = (
        spawn("op_costs.py", 4, [], timeout_s) if os.cpu_count() == 2 else None
    )  # the 4-rank layouts' case
    return (
        fitted_of(result["collective_rows"]),
        result["ops"],
        {
            "switching": fitted_of(shared["collective_rows"]),
            "same_group": fitted_of(shared["same_group_rows"]),
            "group_of_4": fitted_of(shared["group_of_4_rows"]),
        }
        if shared
        else {},
    )


def main() -> None:
    parser = benchmark_parser(__doc__, has_workers=True)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker:
        parser.error("run by benchmarks/at_scale_calibration.py (its ops to time come from the fake ranks)")
    run_worker(worker, args)


if __name__ == "__main__":
    main()
