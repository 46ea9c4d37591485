"""Hardware profiles (planning/hardware.yaml): each one's datasheet figures, its links and its op model, as the
predictor (planning/cost_model.py), the memory estimate and the planner read them. Every constant in a profile
names its source there."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from common.config import require
from planning.op_model import OpModel, op_model_from

PROFILES = Path(__file__).with_name("hardware.yaml")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one way
    latency: float  # s per message step
    # a collective's measured bus bandwidth (bytes/s) by its payload a call (bytes), ascending: ((bytes, B/s), ...)
    busbw: tuple = ()


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    peak_flops: dict  # precision -> FLOP/s
    memory_bytes: float
    memory_bandwidth: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    overlaps_communication: bool
    ops: OpModel  # what an op costs (planning/op_model.py); a profile without `ops:`: the roofline at its datasheet's
    fitted: dict | None = (
        None  # kind -> Link measured for a whole call (this_machine): latency + bytes / bandwidth
    )
    cores: int | None = None  # a CPU's: ranks beyond it share a core, their compute slowed by ranks / cores
    # a CPU's step of two processes sharing one core against one alone: 2.0 if time-slicing cost nothing (the
    # switches and the caches each process refills cost more, measured: benchmarks/overhead_costs.shared_core_ratio)
    shared_core_ratio: float = 2.0
    # as `fitted`, measured with twice as many ranks as cores: each call with a partner other than its rank's
    # last call's; and each with the same one
    fitted_shared: dict | None = None
    fitted_shared_same_group: dict | None = None
    # group size -> kind -> Link: the same with every call over a group of that size (4: all 4 ranks on 2 cores)
    fitted_shared_groups: dict | None = None
    # a pipeline's receive posted after its data was sent: what it waits for the sender's side to answer
    late_receive_s: float = 0.0


@functools.cache
def _profiles() -> dict:
    """planning/hardware.yaml's profiles, read once a process: a fake rank, the predictor and the planner each load
    theirs (40 ms a read in pure Python, which the suite paid some hundred times); libyaml's loader where PyYAML
    has it. Read only: hardware_from builds each Hardware's own values."""
    import yaml

    return yaml.load(PROFILES.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_hardware(name: str) -> Hardware:
    profiles = _profiles()
    require(name in profiles, f"--hardware {name!r} is not a profile in planning/hardware.yaml; known: "
            f"{', '.join(profiles)}")  # fmt: skip
    return hardware_from(name, profiles[name])


def hardware_from(name: str, p: dict) -> Hardware:
    """A profile's YAML mapping as a Hardware (units: TFLOP/s, GB, GB/s, us)."""
    link = lambda spec: Link(spec["bandwidth_gbps"] * 1e9, spec["latency_us"] * 1e-6,  # noqa: E731
                             tuple((size, gbps * 1e9) for size, gbps in (spec.get("busbw") or {}).get("points", ())))  # fmt: skip
    fitted = {kind: link(spec) for kind, spec in p["fitted"].items()} if p.get("fitted") else None
    fitted_shared = {kind: link(spec) for kind, spec in (p.get("fitted_shared") or {}).items()} or None
    same_group = {
        kind: link(spec) for kind, spec in (p.get("fitted_shared_same_group") or {}).items()
    } or None
    groups = {int(size): {kind: link(spec) for kind, spec in fits.items()}
              for size, fits in (p.get("fitted_shared_groups") or {}).items()} or None  # fmt: skip
    ops = p.get("ops") or {}
    peak, bandwidth = {k: v * 1e12 for k, v in p["peak_tflops"].items()}, p["memory_bandwidth_gbps"] * 1e9
    return Hardware(name, p["description"], peak, p["memory_gb"] * 2**30, bandwidth, p["gpus_per_node"],
                    link(p["intra_node"]), link(p["inter_node"]), p["overlaps_communication"],
                    op_model_from(p, peak, bandwidth), fitted, p.get("cores"), ops.get("shared_core_ratio", 2.0),
                    fitted_shared, same_group, groups, ops.get("late_receive_us", 0.0) * 1e-6)  # fmt: skip


def hardware_names() -> list[str]:
    return list(_profiles())
