"""common/profiling.py: a step's time split into compute / communication / overlapped / idle, on a trace
built by hand (the arithmetic) and on a real torch.profiler trace of a 2-thread program."""

from __future__ import annotations

import pytest

from common.profiling import difference, merged, step_breakdown


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


def test_merged_is_a_union():
    assert merged([(5, 7), (0, 2), (1, 3), (7, 9)]) == [(0, 3), (5, 9)]


def test_difference_cuts_holes():
    assert difference([(0, 10), (20, 30)], [(2, 3), (5, 22), (29, 40)]) == [(0, 2), (3, 5), (22, 29)]
    assert difference([(0, 10)], [(0, 10)]) == [] and difference([(0, 10)], []) == [(0, 10)]
