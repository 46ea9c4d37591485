"""common/profiling.py: a step's time split into compute / communication / overlapped / idle, on a trace
built by hand (the arithmetic), and the wait for the other rank split from the transfer. Real traces:
tests/test_train_gpt.py (zero2, one process) and tests/test_performance.py (tp)."""

from __future__ import annotations

import json

import pytest

from common.profiling import difference, merged, step_breakdown, waiting_for_peers


def span(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def test_a_hand_made_step_splits_exactly():
    trace = {
        "traceEvents": [
            span("ProfilerStep#5", 0, 100, cat="user_annotation"),
            span("aten::addmm", 0, 30),  # compute 0-30
            span("aten::mm", 5, 10),  # nested: counted once
            span("c10d::allreduce_", 30, 5),  # issuing a collective: communication
            span("aten::mul", 40, 20),  # compute 40-60, except while it waits (DTensor waits inside ops)
            span("_c10d_functional::wait_tensor", 50, 5),  # nested in aten::mul: communication 50-55
            span(
                "gloo:all_reduce", 32, 38, tid=7, cat="user_annotation"
            ),  # the collective 32-70, other thread
            span("aten::add_", 90, 10),  # compute 90-100; 70-90 idle
        ]
    }
    (row,) = step_breakdown(trace)
    assert row["step"] == "5" and row["step_ms"] == pytest.approx(0.1)
    assert row["compute_ms"] == pytest.approx(0.055)  # 30 + 20 - 5 + 10 µs
    assert row["communication_ms"] == pytest.approx(0.040)  # 30-70
    assert row["overlapped_ms"] == pytest.approx(0.015)  # 40-50 and 55-60
    assert row["idle_ms"] == pytest.approx(0.020)  # 70-90
    assert row["compute_ms"] + row["communication_ms"] - row["overlapped_ms"] + row[
        "idle_ms"
    ] == pytest.approx(row["step_ms"])
    assert row["communication_intervals"] == [(0.030, 0.070)]


def test_a_gpu_step_is_split_by_the_devices_kernels_not_the_launches():
    """On a GPU an operator's CPU span is its launch: the device's kernels are the work, NCCL's the communication."""
    trace = {
        "traceEvents": [
            span("ProfilerStep#7", 0, 100, cat="user_annotation"),
            span("aten::mm", 0, 2),  # launches: no part of the device's time
            span("c10d::allreduce_", 3, 1),
            span("ampere_sgemm_128x64", 10, 30, tid=99, cat="kernel"),  # compute 10-40
            span(
                "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 35, 25, tid=100, cat="kernel"
            ),  # communication 35-60
            span("Memcpy HtoD (Pageable -> Device)", 70, 10, tid=99, cat="gpu_memcpy"),  # compute 70-80
        ]
    }
    (row,) = step_breakdown(trace)
    assert row["compute_ms"] == pytest.approx(0.040) and row["communication_ms"] == pytest.approx(0.025)
    assert row["overlapped_ms"] == pytest.approx(0.005)  # the GEMM beside NCCL's kernel: 35-40
    assert row["idle_ms"] == pytest.approx(0.040)  # 0-10, 60-70, 80-100
    assert row["communication_intervals"] == [(0.035, 0.060)]


def test_merged_is_a_union():
    assert merged([(5, 7), (0, 2), (1, 3), (7, 9)]) == [(0, 3), (5, 9)]


def test_difference_cuts_holes():
    assert difference([(0, 10), (20, 30)], [(2, 3), (5, 22), (29, 40)]) == [(0, 2), (3, 5), (22, 29)]
    assert difference([(0, 10)], [(0, 10)]) == [] and difference([(0, 10)], []) == [(0, 10)]


def write_trace(path, spans):
    path.write_text(json.dumps({"traceEvents": spans}))
    return str(path)


def test_waiting_for_the_other_rank_is_split_from_the_transfer(tmp_path):
    step = span("ProfilerStep#5", 0, 100, cat="user_annotation")
    rank0 = [step, span("gloo:all_reduce", 10, 30, tid=7), span("gloo:all_gather", 60, 10, tid=7)]
    rank1 = [step, span("gloo:all_reduce", 25, 15, tid=7), span("gloo:all_gather", 55, 15, tid=7)]
    paths = [write_trace(tmp_path / "r0.json", rank0), write_trace(tmp_path / "r1.json", rank1)]
    figures = waiting_for_peers(paths)
    # rank 0 entered the all-reduce at 10, rank 1 at 25: 15 µs of waiting; the all-gather none
    assert figures["calls_per_step"] == 2 and figures["spans_ms"] == pytest.approx(0.040)
    assert figures["waiting_ms"] == pytest.approx(0.015) and figures["after_arrival_ms"] == pytest.approx(
        0.025
    )
    rank1_short = [step, span("gloo:all_reduce", 25, 15, tid=7)]
    assert waiting_for_peers([paths[0], write_trace(tmp_path / "r1b.json", rank1_short)]) == {}
