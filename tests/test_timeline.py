"""The pipeline timeline (strategies/pp_schedules.simulate and step_seconds) on hand-drawn schedules, against
their closed-form steps."""

from __future__ import annotations

import pytest

from strategies.pp_schedules import Action, order, simulate, step_seconds


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 8), (4, 16)])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_microbatch_times(p, m):
    for schedule in ("gpipe", "1f1b"):
        result = simulate(schedule, p, m, forward_s=1.0, backward_s=2.0)
        assert result["step_s"] == pytest.approx((m + p - 1) * 3.0), schedule
        assert result["bubble_s"] == pytest.approx((p - 1) * 3.0), schedule


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_interleaving_v_stages_a_rank_divides_the_bubble_by_v(p, m, v):
    # each chunk does 1/v of the rank's work: Narayanan et al. 2021's (m + (p - 1) / v) (F + B)
    result = simulate("interleaved_1f1b", p, m, forward_s=1.0 / v, backward_s=2.0 / v, v=v)
    assert result["step_s"] == pytest.approx((m + (p - 1) / v) * 3.0)
    assert result["bubble_s"] == pytest.approx((p - 1) / v * 3.0)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12), (8, 16)])
@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zero_bubble"])
def test_the_zero_bubble_schedules_leave_a_third_of_1f1bs_bubble(schedule, p, m):
    """torch's own order (2 stages a rank), each backward split into the input's gradient I and the weights' W:
    with F = I = W a chunk, ZB-H1's step m v (F + I + W) + (p - 1) F (Qi et al. 2024: a third of 1F1B's
    (p - 1)(F + B) bubble), the weights' gradients filling the rest."""
    result = simulate(schedule, p, m, forward_s=1.0, backward_s=2.0, v=2)
    assert result["step_s"] == pytest.approx(m * 2 * 3.0 + (p - 1) * 1.0)
    assert result["bubble_s"] == pytest.approx((p - 1) * 1.0)
    ranks = {a.stage for a in order(schedule, 0, p, m, 2)}  # zbv: a "V" (0 and 2p - 1); else looped (0 and p)
    assert ranks == ({0, 2 * p - 1} if schedule == "zbv" else {0, p})
    kinds = [a.kind for a in order(schedule, p - 1, p, m, 2)]
    assert kinds.count("F") == kinds.count("I") == kinds.count("W") == 2 * m and "B" not in kinds


def test_1f1b_runs_each_stages_warm_up_then_alternates():
    # stage 0 of 3 with 4 micro-batches: 2 warm-up forwards, then one forward one backward, then the rest
    kinds = "".join(a.kind for a in order("1f1b", 0, 3, 4))
    assert kinds == "FF" + "FB" * 2 + "BB"
    assert order("1f1b", 2, 3, 2) == [
        Action("F", 0, 2),
        Action("B", 0, 2),
        Action("F", 1, 2),
        Action("B", 1, 2),
    ]


def test_a_slow_last_stage_and_slow_sends_lengthen_the_step_beyond_the_closed_form():
    p, m = 4, 8
    even = simulate("1f1b", p, m, 1.0, 2.0)["step_s"]
    # the last stage also runs the head and the loss: the pipeline waits for it on every micro-batch
    heavy_last = simulate("1f1b", p, m, [1.0, 1.0, 1.0, 1.5], [2.0, 2.0, 2.0, 3.0])["step_s"]
    assert heavy_last >= (m + p - 1) * 3.0 + m * 1.5 - 1e-9
    # a send of 0.25 s each way between neighbours: 2 (p - 1) sends on the critical path at least
    assert simulate("1f1b", p, m, 1.0, 2.0, send_s=0.25)["step_s"] >= even + 2 * (p - 1) * 0.25


def test_a_receive_posted_after_its_data_was_sent_waits_for_the_sender_to_answer():
    """1F1B, 2 stages, 2 micro-batches, F 1 s, B 2 s, a send 0.1 s, a late receive 0.5 s, drawn by hand: stage 1
    receives F1's activations (sent at 2.1) only when it reaches F1 (4.1): it starts at 4.6, not 4.1; every other
    receive is posted before its data arrives. Stage 0: F0 0-1, F1 1-2, B0 4.2-6.2, B1 7.7-9.7; stage 1: F0
    1.1-2.1, B0 2.1-4.1, F1 4.6-5.6, B1 5.6-7.6."""
    assert order("1f1b", 0, 2, 2) == [
        Action("F", 0, 0),
        Action("F", 1, 0),
        Action("B", 0, 0),
        Action("B", 1, 0),
    ]
    assert simulate("1f1b", 2, 2, 1.0, 2.0, send_s=0.1)["step_s"] == pytest.approx(9.2)
    late = simulate("1f1b", 2, 2, 1.0, 2.0, send_s=0.1, late_s=0.5)
    assert late["step_s"] == pytest.approx(9.7) and late["busy_s"] == pytest.approx([6.0, 6.0])
    assert late["late_receives"] == [0, 1]  # stage 1's F1, the only one


def test_an_interleaved_step_needs_whole_rounds_of_microbatches():
    with pytest.raises(ValueError, match="multiples of the stage ranks"):
        simulate("interleaved_1f1b", 4, 6, 1.0, 2.0, v=2)
    with pytest.raises(ValueError, match="no timeline"):
        simulate("dualpipe", 4, 8, 1.0, 2.0)


def test_a_long_step_is_priced_from_its_repeating_rounds_exactly():
    import random

    random.seed(0)
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zbv", 2)):
        # past 18 p: priced from its rounds (zbv on one size: its simulation is the slowest, 1.5 s for three)
        for p, m in ((2, 96), (4, 96), (8, 160)) if schedule != "zbv" else ((4, 96),):
            forward = [random.uniform(0.5, 1.5) for _ in range(p * v)]  # stages that differ
            backward = [2 * f * random.uniform(0.8, 1.2) for f in forward]
            for send in (0.0, 0.3):
                exact = simulate(schedule, p, m, forward, backward, v, send)["step_s"]
                assert step_seconds(schedule, p, m, forward, backward, v, send) == pytest.approx(
                    exact, rel=1e-9
                )
