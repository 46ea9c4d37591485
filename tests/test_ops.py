"""The ops a step runs (planning/ops.py's OpRecorder) and what each costs (planning/op_model.py's OpModel):
hand-computed cases, and the recorder on a real fake rank against the GPT's own matmul count."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from common.gpt import GPT, GPTConfig
from experiments.at_scale import Config
from planning.cost_model import predict_step
from planning.fake_ranks import playing, run_rank
from planning.hardware import PROFILES, hardware_names, load_hardware
from planning.op_model import OpModel
from planning.ops import OpCall, OpRecorder, replay
from strategies.layout import Layout, Workload
from strategies.theory import stage_theories


def fake_rank(cfg, layout: Layout, work: Workload, rank: int) -> dict:
    """planning/fake_ranks.run_rank in this process, which it leaves as a new process would find it: its Accelerator
    reset (a forked launch later in this worker inherited it and ran both ranks as rank 0: measured)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        return run_rank(cfg, layout, work, rank)
    finally:
        AcceleratorState._reset_state(True)


def recorded(fn, fake: bool = True) -> dict:
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        with OpRecorder() as ops:
            fn(ops)
    return ops.calls


def of_kind(calls, kind: str) -> list[tuple[OpCall, int]]:
    return [(c, n) for c, n in calls.items() if c.kind == kind]


def test_a_matmul_and_its_backward_are_recorded_with_their_flops_per_phase():
    def step(ops):
        x, w = torch.randn(6, 5), torch.randn(5, 3, requires_grad=True)
        y = (x @ w).sum()
        ops.phase = "backward"
        y.backward()

    calls = recorded(step)
    (forward, _), *rest = of_kind(calls["forward"], "gemm")
    assert not rest and forward.shape == (6, 5, 3) and forward.flops == 2 * 6 * 5 * 3
    assert forward.bytes == 4 * (6 * 5 + 5 * 3 + 6 * 3)  # its operands read, its output written
    (backward, _), *rest = of_kind(
        calls["backward"], "gemm"
    )  # the weight's gradient: x^T (5 x 6) @ dy (6 x 3)
    assert not rest and backward.shape == (5, 6, 3) and backward.flops == 2 * 5 * 6 * 3


def test_a_batched_and_a_biased_matmul_count_every_product():
    def step(ops):
        torch.bmm(torch.randn(4, 6, 5), torch.randn(4, 5, 3))
        torch.addmm(torch.randn(3), torch.randn(6, 5), torch.randn(5, 3))

    gemms = {c.name: c for c, _ in of_kind(recorded(step)["forward"], "gemm")}
    assert gemms["bmm"].shape == (24, 5, 3) and gemms["bmm"].flops == 2 * 4 * 6 * 5 * 3
    assert gemms["addmm"].shape == (6, 5, 3) and gemms["addmm"].flops == 2 * 6 * 5 * 3


def test_attention_counts_the_causal_half_and_a_backward_of_five_matmuls():
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))  # batch 2, 4 heads, 16 tokens

    def step(ops):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        ops.phase = "backward"
        out.sum().backward()

    calls = recorded(step, fake=False)
    (forward, _), *_ = of_kind(calls["forward"], "attention")
    (backward, _), *_ = of_kind(calls["backward"], "attention")
    full = 4 * (2 * 4) * 16 * 16 * 8  # QK^T and AV, 2 FLOPs a multiply-add, every query against every key
    assert forward.causal and forward.flops == full / 2 and forward.shape == (8, 16, 16, 8)
    assert backward.backward and backward.flops == 2.5 * full / 2


def test_views_move_nothing_and_an_in_place_op_that_returns_nothing_counts_what_it_writes():
    params, grads, m, v = ([torch.randn(10)] for _ in range(4))
    steps = [torch.tensor(1.0)]

    def step(ops):
        torch.randn(4, 6).t()
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0,
                            eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip

    calls = recorded(step, fake=False)["forward"]
    (view, _), *_ = of_kind(calls, "view")
    assert view.name == "t" and view.bytes == 0
    (adamw, _), *_ = [(c, n) for c, n in calls.items() if c.name == "_fused_adamw_"]
    # reads the parameters, gradients, both moments and the step (4 x 40 + 4 bytes); writes what its schema
    # marks written: parameters, gradients (a scaler may unscale them), both moments (4 x 40)
    assert adamw.bytes == 4 * 40 + 4 + 4 * 40


def test_a_dtensor_op_is_counted_and_its_shape_propagation_is_not_the_ranks_work():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with playing(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        with FakeTensorMode(allow_non_fake_inputs=True):
            w = distribute_tensor(
                torch.randn(8, 16), mesh, [Shard(0)]
            )  # a column-parallel weight: 4 rows here
            x = distribute_tensor(torch.randn(6, 16), mesh, [Replicate()])
            with OpRecorder() as ops:
                torch.nn.functional.linear(x, w)
    gemms = of_kind(ops.calls["forward"], "gemm")
    # the local matmul alone (6 x 16 by 16 x 4), once: not DTensor's run of it on the global shapes (16 x 8)
    assert [(c.shape, n) for c, n in gemms] == [((6, 16, 4), 1)]
    assert ops.dtensor_calls["forward"] >= 2  # the transpose and the matmul, at least
    # the DTensors they took: the weight to the transpose; its transpose and the input to the matmul
    assert ops.dtensor_tensors["forward"] >= 3


def test_a_recorded_op_runs_again_at_its_shapes_with_valid_indices():
    def step(ops):
        weight = torch.randn(10, 4)
        torch.nn.functional.embedding(torch.tensor([[1, 9], [3, 0]]), weight)

    calls = recorded(step)["forward"]
    (embedding, _), *_ = [(c, n) for c, n in calls.items() if c.name == "embedding"]
    out = replay(embedding.replay)()
    assert out.shape == (2, 2, 4)  # index 0 of a made-up weight: a valid lookup


def test_the_op_model_prices_by_nearest_measured_shape_by_bandwidth_and_by_table():
    gemm = OpCall("mm", "gemm", "float32", (1000, 100, 100), 2e7, 4 * (1000 * 100 * 2 + 100 * 100))
    points = (((1024, 128, 128), "float32", 50e9), ((4096, 4096, 4096), "float32", 100e9))
    model = OpModel({"fp32": 200e9, "bf16": 400e9}, 1e12, gemm_points=points, op_overhead_s=2e-6)
    assert model.seconds(gemm) == pytest.approx(2e7 / 50e9 + 2e-6)  # the nearer point's 50 GFLOP/s
    by_peak = OpModel({"fp32": 200e9, "bf16": 400e9}, 1e12, gemm_efficiency=0.8)
    assert by_peak.seconds(gemm) == pytest.approx(2e7 / (0.8 * 200e9))
    # a memory-bound op between two measured sizes: the bandwidth interpolated in log bytes
    copy = OpCall("add", "memory", "float32", (), 0.0, 10_000)
    curve = OpModel({"fp32": 1.0}, 1.0, memory_points=((1_000, 10e9), (100_000, 30e9)))
    assert curve.seconds(copy) == pytest.approx(10_000 / 20e9)
    timed = OpModel({"fp32": 1.0}, 1.0, measured_s={repr(("add", "Tensor", (), ())): 7e-6})
    assert (
        timed.seconds(OpCall("add", "memory", "float32", (), 0.0, 10, replay=("add", "Tensor", (), ())))
        == 7e-6
    )
    # a phase: its ops, each DTensor op's dispatch, what the phase costs beyond its ops; the step's own overhead
    phased = OpModel({"fp32": 1.0}, 1.0, view_overhead_s=1e-6,
                     dtensor_overhead_s={"forward": 5e-6, "backward": 2e-6, "step": 7e-6},
                     redistribute_overhead_s=4e-4, per_op_overhead_s={"forward": 3e-6}, step_overhead_s=1e-4,
                     fsdp_overhead_s=2e-5)  # fmt: skip
    view = OpCall("t", "view", "float32", (), 0.0, 0)
    assert phased.phase_seconds("forward", [(view, 10)], dtensor_calls=2) == pytest.approx(
        10e-6 + 10e-6 + 30e-6
    )
    assert phased.phase_seconds("forward", [(view, 10)], dtensor_calls=2, redistributes=3) == pytest.approx(
        10e-6 + 10e-6 + 30e-6 + 3 * 4e-4
    )
    # a functional collective outside a redistribute (cp's gathers): its own overhead, per call
    called = dataclasses.replace(phased, functional_collective_overhead_s=7e-5)
    assert called.phase_seconds("backward", [(view, 10)], functional_collectives=8) == pytest.approx(
        10e-6 + 8 * 7e-5
    )
    assert phased.phase_seconds("step", [(view, 1)]) == pytest.approx(1e-6 + 1e-4)
    # DTensor's cost per op forward and backward; in the step per DTensor taken (one fused op takes them all)
    assert phased.phase_seconds("backward", [], dtensor_calls=3, dtensor_tensors=9) == pytest.approx(3 * 2e-6)
    assert phased.phase_seconds("step", [], dtensor_calls=2, dtensor_tensors=40) == pytest.approx(
        40 * 7e-6 + 1e-4
    )
    # FSDP's hooks: per parameter an unshard or a reduce-scatter moves
    assert phased.phase_seconds("backward", [(view, 10)], fsdp_events=7) == pytest.approx(10e-6 + 7 * 2e-5)
    # beyond its ops, per op dispatched and per byte its ops move (a view moves none)
    gapped = OpModel(
        {"fp32": 1.0}, 1.0, per_op_overhead_s={"forward": 3e-6}, per_byte_overhead_s={"forward": 1e-9}
    )
    add = OpCall("add", "memory", "float32", (), 0.0, 4000, replay=("add", "Tensor", (), ()))
    gapped = dataclasses.replace(gapped, measured_s={repr(add.replay): 5e-6})
    assert gapped.phase_seconds("forward", [(add, 2), (view, 3)]) == pytest.approx(
        2 * 5e-6 + 5 * 3e-6 + 2 * 4000 * 1e-9
    )
    assert gapped.phase_seconds("backward", [(add, 2)]) == pytest.approx(2 * 5e-6)  # no backward gap measured
    # FSDP's hook ops: their own cost, not the step's gap (nn.Module's and autograd's, per op of the model)
    assert gapped.phase_seconds("forward", [(add, 2), (view, 3)], in_fsdp_hooks=[(add, 1), (view, 3)]) == (
        pytest.approx(2 * 5e-6 + 1 * (3e-6 + 4000 * 1e-9))
    )


def test_a_gpus_gemm_runs_in_waves_of_tiles_its_last_wave_and_edge_tiles_partly_idle():
    """Tile and wave quantization (NVIDIA's Matrix Multiplication Background guide): 108 SMs, 256x128 tiles."""
    a100 = OpModel(
        {"bf16": 312e12}, 2e12, gemm_efficiency=0.8, gemm_tiles=((256, 128), (128, 256)), sm_count=108
    )
    assert a100.quantisation(256 * 12, 128 * 9) == 1.0  # 108 tiles: one full wave
    assert a100.quantisation(256 * 12, 128 * 10) == pytest.approx(120 / 216)  # 120 tiles: a second wave of 12
    # 128 rows: the 128 x 256 tile fills one wave (108 tiles), where 256 x 128 tiles, half empty, would run two
    assert a100.quantisation(128, 256 * 108) == 1.0
    assert dataclasses.replace(a100, gemm_tiles=((256, 128),)).quantisation(128, 256 * 108) == 0.5
    gemm = OpCall("mm", "gemm", "bfloat16", (256 * 12, 4096, 128 * 10), 2.0 * 3072 * 4096 * 1280, 0)
    flat = dataclasses.replace(a100, gemm_tiles=())
    assert a100.seconds(gemm) == pytest.approx(flat.seconds(gemm) * 216 / 120)
    # no tiles in the profile (a CPU): every GEMM at its measured throughput
    assert flat.quantisation(1, 1) == 1.0
    for gpu in ("a100_80gb", "h100_sxm"):  # every GEMM no faster than the profile's square one
        ops = load_hardware(gpu).ops
        assert ops.sm_count and all(
            0 < ops.quantisation(m, n) <= 1 for m in (1, 300, 8192) for n in (7, 4096)
        )


def test_a_fake_rank_records_the_matmuls_its_layout_leaves_it():
    """One forward's matmul FLOPs on a fake rank: each block's q, k, v, output (4 d^2) and MLP (8 d^2) per token,
    and the head (d V); under tp 2 each rank multiplies half of every one of them."""
    cfg = Config(model="custom", n_layer=2, d_model=64, n_head=4, vocab_size=512, block_size=32, world_size=2)
    model = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512, block_size=32)
    work, tokens, d = Workload(model, 4), 4 * 32, 64
    whole = 2 * tokens * (2 * 12 * d * d + d * 512)
    for layout, share in ((Layout(dp_replicate=2), 1), (Layout(tp=2), 2), (Layout(cp=2), 2)):
        ops = fake_rank(cfg, layout, work, 0)["ops"]
        forward = sum(c.flops * n for c, n in ops["calls"]["forward"] if c.kind == "gemm")
        # (cp: each rank projects its half of the tokens; its attention's matmuls are flash's, not counted here)
        assert forward == whole / share, layout
        # cp's functional collectives (outside a redistribute): K's and V's all-gather a block forward, their
        # reduce-scatters backward; tp's run inside its redistributes, priced there
        called = ops["functional_collectives"]
        assert called == (
            {"forward": 2 * model.n_layer, "backward": 2 * model.n_layer} if layout.cp > 1 else {}
        )
        assert {"forward", "backward", "step"} <= set(ops["calls"])
        assert (ops["dtensor_calls"].get("forward", 0) > 0) == (layout.tp > 1)
        # tp's all-reduces are DTensor redistributes (Partial -> Replicate), once forward and once back a block
        assert (ops["redistributes"].get("forward", 0) >= model.n_layer) == (layout.tp > 1)
        assert (ops["redistributes"].get("backward", 0) >= model.n_layer) == (layout.tp > 1)
        # the step priced is AdamW's second: its first makes the moments (zeros_like a parameter, twice)
        step_ops = {c.name for c, _ in ops["calls"]["step"]}
        assert "_fused_adamw_" in step_ops and "zeros_like" not in step_ops, step_ops
        assert "zeros_like" in {c.name for c, _ in ops["calls"]["first_step"]}
        # the fused step takes every DTensor parameter with its gradient and two moments: under tp the split
        # ones (q, k, v, o, fc_in, fc_out a block at least), under a fake rank's replicate all (FSDP2's DTensors)
        assert ops["dtensor_tensors"]["step"] >= 4 * 6 * model.n_layer, ops["dtensor_tensors"]
    assert not dist.is_initialized()


def test_a_fake_fsdp_rank_records_its_copies_and_counts_its_unshards_and_reduce_scatters():
    """dp_shard 2 (blocks resharded after forward, the root not): forward unshards every unit once, backward the
    blocks again and reduce-scatters every unit; FSDP's copies in and out of its buffers are memory ops."""
    cfg = Config(model="custom", n_layer=2, d_model=64, n_head=4, vocab_size=512, block_size=32, world_size=2)
    model = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512, block_size=32)
    result = fake_rank(cfg, Layout(dp_shard=2), Workload(model, 4), 0)
    ops = result["ops"]
    units = 1 + model.n_layer  # the root and each block
    assert ops["fsdp_events"] == {"forward": units, "backward": model.n_layer + units}
    copies = {
        c.name: c
        for c, _ in ops["calls"]["forward"]
        if c.name in ("all_gather_copy_in", "split_with_sizes_copy")
    }
    assert set(copies) == {"all_gather_copy_in", "split_with_sizes_copy"}
    assert all(c.kind == "memory" and c.bytes > 0 for c in copies.values())
    # the clipping by the global norm: every gradient shard's norm in one multi-tensor op, the squared sums
    # all-reduced over the 2 sharding ranks in one call of a float32 (common/optim groups the gradients by how
    # they are split), every shard scaled in one multi-tensor op
    with torch.device("meta"):
        tensors = len(list(GPT(model).parameters()))  # the tied embedding once
    clipping = Counter()
    for call, n in ops["calls"]["clip"]:
        clipping[call.name] += n
    assert clipping["_foreach_norm"] == clipping["_foreach_mul_"] == 1
    # no op a gradient; pow squares the stacked norms once
    assert "mul_" not in clipping and "pow" in clipping
    multi = {call.name: call for call, _ in ops["calls"]["clip"] if call.name.startswith("_foreach")}
    assert all(len(call.replay[2][0]) == tensors for call in multi.values())  # every gradient shard in each
    assert result["clip_collectives"]["on_groups_of"] == [("all_reduce", 2, 1, 4)]
    # a fake replica runs PyTorch's replicate (FSDP2's machinery): one reduction of every parameter, in backward
    replica = fake_rank(cfg, Layout(dp_replicate=2), Workload(model, 4), 0)
    assert replica["ops"]["fsdp_events"] == {"backward": 1}  # the whole piece one unit
    assert replica["clip_collectives"]["on_groups_of"] == []  # every replica's norm already the global one
    assert not dist.is_initialized()


def test_a_prediction_from_recorded_ops_is_their_priced_sum():
    cfg = Config(model="custom", n_layer=2, d_model=64, n_head=4, vocab_size=512, block_size=32, world_size=2)
    model = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512, block_size=32)
    work, layout = Workload(model, 4), Layout(dp_replicate=2)
    traced = [fake_rank(cfg, layout, work, 0)]
    hw = load_hardware("this_machine")
    with torch.device("meta"):
        reference = GPT(model)
    predicted = predict_step(
        stage_theories(reference, layout, cfg, work), layout, cfg, work, hw, traced=traced
    )
    ops = traced[0]["ops"]
    # a launch's replicas run DDP, not the fake rank's replicate: FSDP's hooks are not priced, neither their
    # Python nor the ops they run, nor DTensor's dispatch: DDP's parameters are plain tensors where replicate's
    # are DTensors
    assert ops["dtensor_tensors"]["step"] > 0
    hooks = {
        name: Counter(dict(ops["in_fsdp_hooks"].get(name, [])))
        for name in ("forward", "backward", "clip", "step")
    }

    def phase(name: str) -> float:
        own = [(c, n - hooks[name][c]) for c, n in ops["calls"][name] if n > hooks[name][c]]
        return hw.ops.phase_seconds(name, own, redistributes=ops["redistributes"].get(name, 0))

    assert predicted["priced"] == "recorded ops"
    assert predicted["terms_s"]["compute"] == pytest.approx(phase("forward") + phase("backward"))
    assert predicted["terms_s"]["optimizer"] == pytest.approx(phase("step"))
    # a replica clips without a collective: its ops alone
    assert predicted["terms_s"]["clip"] == pytest.approx(phase("clip"))
    assert phase("clip") > 0


def test_ranks_beyond_the_cores_share_them_and_fill_each_others_pipeline_bubbles():
    """Four ranks on two cores: without a pipeline, each rank's compute twice over, times what sharing a core
    costs beyond that (shared_core_ratio / 2); under a pipeline of 2, the two stages' compute over the cores (a
    rank waiting in the bubble lends its core), no bubble left; on four cores the schedule's own bubble."""
    shape = {"n_layer": 4, "d_model": 64, "n_head": 4, "vocab_size": 512, "block_size": 32}
    model, cfg = GPTConfig(**shape), Config(model="custom", world_size=4, pp_microbatches=4, **shape)
    work = Workload(model, 4)
    with torch.device("meta"):
        reference = GPT(model)
    # this machine's op model, without the figures this test is not about (a late receive can make the schedule
    # at a core a rank the longer of the two: measured, 1 ms each)
    hw = dataclasses.replace(load_hardware("this_machine"), late_receive_s=0.0, fitted_shared=None)

    def terms(layout, cores, ratio=2.0):
        shared = dataclasses.replace(hw, cores=cores, shared_core_ratio=ratio)
        return predict_step(stage_theories(reference, layout, cfg, work), layout, cfg, work, shared)[
            "terms_s"
        ]

    flat, pipelined = Layout(dp_replicate=4), Layout(pp=2, dp_replicate=2)
    alone = terms(flat, 4)
    assert terms(flat, 2)["compute"] == pytest.approx(2 * alone["compute"])
    assert terms(flat, 2, ratio=2.5)["compute"] == pytest.approx(2.5 * alone["compute"])
    assert terms(flat, 2, ratio=2.5)["optimizer"] == pytest.approx(2.5 * alone["optimizer"])
    own, shared = terms(pipelined, 4), terms(pipelined, 2)
    assert own["bubble"] > 0 and shared["bubble"] == pytest.approx(0.0, abs=1e-12)
    # the slowest stage alone, against both stages' compute (one holds the embedding, the other the head)
    assert own["compute"] < shared["compute"] < 2 * own["compute"]
    assert terms(pipelined, 2, ratio=3.0)["compute"] == pytest.approx(1.5 * shared["compute"])
    # on shared cores every send of a rank is in the cores' work (one each micro-batch, of 4), and each receive
    # it posts late; on its own cores, the two hops of the first and the last micro-batch
    from planning.communication import traffic_seconds

    sends = max(traffic_seconds(t.traffic, pipelined, dataclasses.replace(hw, cores=2))["pp"]
                for t in stage_theories(reference, pipelined, cfg, work))  # fmt: skip
    assert sends > 0 and shared["pp_sends"] == pytest.approx(sends)
    assert own["pp_sends"] == pytest.approx(2 * (sends / 4) / 2)
    late = dataclasses.replace(hw, cores=2, shared_core_ratio=2.0, late_receive_s=1e-3)
    late_receives = (
        predict_step(stage_theories(reference, pipelined, cfg, work), pipelined, cfg, work, late)["terms_s"][
            "pp_sends"
        ]
        - sends
    ) / 1e-3
    assert 1 <= round(late_receives) <= 2 * 4 and late_receives == pytest.approx(round(late_receives))


def test_collectives_of_ranks_beyond_the_cores_take_the_fit_measured_so_and_the_pipelines_run_once_a_step():
    """this_machine's fits: gloo on 2 ranks, on 4 ranks in pairs (2 a core) and over all 4; a layout takes the one of
    its case. A pipeline's sends are per micro-batch (pp); its loss broadcast and tied all-reduce once a step."""
    from planning.communication import traffic_seconds
    from planning.hardware import Link
    from strategies.layout import Traffic

    hw = dataclasses.replace(load_hardware("this_machine"), cores=2,
                             fitted={"all_reduce": Link(1e9, 1e-3), "broadcast": Link(1e9, 1e-4)},
                             fitted_shared={"all_reduce": Link(0.5e9, 4e-3), "broadcast": Link(1e9, 4e-4)})  # fmt: skip
    traffic = [Traffic("all_reduce", 10**6, 2, "tp")]
    assert traffic_seconds(traffic, Layout(tp=2), hw)["tp"] == pytest.approx(1e-3 + 1e-3)
    assert traffic_seconds(traffic, Layout(tp=2, dp_shard=2), hw)["tp"] == pytest.approx(4e-3 + 2e-3)
    piped = [Traffic("all_reduce", 10**6, 2, "pp", calls=1, term="pp_step"),  # as strategies/pp.py labels them
             Traffic("broadcast", 4, 2, "pp", calls=1, term="pp_step")]  # fmt: skip
    seconds = traffic_seconds(piped, Layout(pp=2), hw)
    assert "pp" not in seconds and seconds["pp_step"] == pytest.approx(1e-3 + 1e-3 + 1e-4 + 4e-9)
    # a fake rank's calls with a new partner (the share `switched`) at the shared fit, the others at the fit of
    # calls with their last call's partner
    same = dataclasses.replace(hw, fitted_shared_same_group={"all_reduce": Link(1e9, 1e-3)})
    blended = traffic_seconds(traffic, Layout(tp=2, dp_shard=2), same, switched={"all_reduce": 0.25})["tp"]
    assert blended == pytest.approx(0.25 * (4e-3 + 2e-3) + 0.75 * (1e-3 + 1e-3))
    assert traffic_seconds(traffic, Layout(tp=2), same, switched={"all_reduce": 0.25})["tp"] == pytest.approx(
        2e-3
    )
    # a group of all 4 ranks (dp_shard 4) at the fit measured over all 4; a pair of the same 4 ranks, and a group of
    # 4 where the cores are not shared, as before
    of_4 = dataclasses.replace(same, fitted_shared_groups={4: {"all_reduce": Link(0.25e9, 8e-3)}})
    whole = [Traffic("all_reduce", 10**6, 4, "dp_shard")]
    assert traffic_seconds(whole, Layout(dp_shard=4), of_4)["dp_shard"] == pytest.approx(8e-3 + 4e-3)
    assert traffic_seconds(traffic, Layout(tp=2, dp_shard=2), of_4, switched={"all_reduce": 1.0})[
        "tp"
    ] == pytest.approx(4e-3 + 2e-3)
    assert traffic_seconds(whole, Layout(dp_shard=4), dataclasses.replace(of_4, cores=4))[
        "dp_shard"
    ] == pytest.approx(1e-3 + 1e-3)
    # 12 all-reduces counted: the tied one the pipeline knows of, the other 11 tp's (not spread by bytes: the
    # tied gradient's 1 MB would take most of them)
    both = traffic_seconds(
        [*piped, Traffic("all_reduce", 10**5, 2, "tp")], Layout(pp=2, tp=2), hw, {"all_reduce": 12}
    )
    assert both["tp"] == pytest.approx(11 * 4e-3 + 10**5 / 0.5e9)
    assert both["pp_step"] == pytest.approx(4e-3 + 10**6 / 0.5e9 + 4e-4 + 4e-9)


def test_every_op_model_figure_of_a_profile_names_its_source():
    profiles = yaml.safe_load(Path(PROFILES).read_text())
    for name in hardware_names():
        for key, figure in (profiles[name].get("ops") or {}).items():
            if key.endswith("_efficiency"):
                assert figure["source"].strip() and 0 < figure["value"] <= 1, (name, key)
            if key in ("sm_count", "gemm_tiles"):
                assert figure["source"].strip() and figure["value"], (name, key)
        # a link's measured bus bandwidth by payload: its source, its points ascending
        for link in ("intra_node", "inter_node"):
            busbw = profiles[name][link].get("busbw")
            if busbw:
                assert busbw["source"].strip() and busbw["points"] == sorted(busbw["points"]), (name, link)
        table = (profiles[name].get("ops") or {}).get("measured_ops")
        if isinstance(table, str):
            assert (Path(PROFILES).parent / table).exists(), (name, table)


def test_the_calibrations_profile_takes_each_figure_as_the_median_of_its_rounds():
    """benchmarks/at_scale_calibration measures the profile after each round: every number the median of the
    rounds', a size or a shape every round measured alike kept as it is, points matched by position."""
    from benchmarks.at_scale_calibration import median_of

    rounds = [
        {"fitted": {"all_reduce": {"latency_us": latency, "bandwidth_gbps": 1.0}}, "cores": 2, "description": "x",
         "ops": {"memory_points": [{"bytes": 12288, "gbps": gbps}], "gemm_points": [{"shape": [64, 128, 64], "gflops": gbps}]}}
        for latency, gbps in ((900.0, 30.0), (1600.0, 10.0), (1300.0, 20.0))
    ]  # fmt: skip
    merged = median_of(rounds)
    assert merged["fitted"]["all_reduce"] == {"latency_us": 1300.0, "bandwidth_gbps": 1.0}
    assert merged["cores"] == 2 and merged["description"] == "x"
    assert merged["ops"]["memory_points"] == [{"bytes": 12288, "gbps": 20.0}]
    assert merged["ops"]["gemm_points"] == [{"shape": [64, 128, 64], "gflops": 20.0}]
    assert median_of([{"op(a)": 3.0, "op(b)": 1.0}, {"op(a)": 5.0}]) == {"op(a)": 4.0}  # timed in both only


def test_a_calibration_says_which_runs_other_processes_slowed():
    """others_share: the machine's CPU seconds between two clocks, less what this process and the launch (its
    finished children) used, over the cores' seconds; the table shows each layout's most of its rounds and warns, naming
    the layouts, when it is over 5 % (a timing beside other work reads slow), and not when every run was alone; and
    warns when a layout's rounds are over 1.5x apart (the machine's own speed moved)."""
    from benchmarks.at_scale_calibration import markdown
    from benchmarks.workers import others_share

    cores = os.cpu_count() or 1
    # 10 s of wall: the machine used 12 CPU seconds more, the launch's ranks 10 of them
    assert others_share((100.0, 50.0, 7.0), (112.0, 60.0, 17.0)) == pytest.approx(2 / (10 * cores))
    assert others_share((100.0, 50.0, 7.0), (109.0, 60.0, 17.0)) == 0.0  # clocks' ticks: never below nothing
    assert others_share(None, (1.0, 1.0, 1.0)) is None  # no /proc/stat
    fit = {"all_reduce": {"latency_us": 1000, "bandwidth_gbps": 2.0}}
    gaps = {"forward_us_per_op": 1, "backward_us_per_op": 1, "step_us": 100}
    ops = {
        "op_overhead_us": 2,
        "eager_gaps": gaps,
        "dtensor_gaps": {"forward_us_per_op": 10, "backward_us_per_op": 0, "step_us_per_tensor": 4},
    }
    profile = {"peak_tflops": {"fp32": 0.2}, "memory_bandwidth_gbps": 15, "fitted": fit, "ops": ops}

    def row(name: str, busy: list) -> dict:
        return {"layout": name, "ranks": 2, "measured_step_s": 0.02, "measured_rounds_s": [0.02],
                "others_share_rounds": busy, "predicted_step_s": 0.02, "ratio": 1.0, "terms_ms": {}}  # fmt: skip

    quiet = markdown([row("ddp", [0.0, 0.01]), row("tp", [0.02, None])], profile, "cmd", [0.01])
    assert "| ddp | 2 | 20.0 (20-20) | 1 % |" in quiet and "WARNING" not in quiet
    busy = markdown([row("ddp", [0.0, 0.3]), row("tp", [0.02])], profile, "cmd", [0.01, 0.0])
    assert "| ddp | 2 | 20.0 (20-20) | 30 % |" in busy
    assert (
        "WARNING: other processes used over 5 % of the cores while ddp ran (the profile's rounds: 1 %, 0 %)"
        in busy
    )
    assert "speed moved" not in quiet + busy  # one round each: nothing to compare
    # rounds of one layout over 1.5x apart, no other process to blame: the machine's own speed moved
    unsteady = {**row("pp", [0.0, 0.0, 0.0]), "measured_rounds_s": [0.030, 0.061, 0.049]}
    steady = {**row("tp", [0.0, 0.0]), "measured_rounds_s": [0.040, 0.052]}
    table = markdown([unsteady, steady], profile, "cmd", [0.0])
    assert "| pp | 2 | 20.0 (30-61) | 0 % |" in table
    assert "WARNING: the rounds of pp are over 1.5x apart: this machine's speed moved" in table


def test_the_collective_counter_counts_the_calls_with_a_new_partner():
    """A rank's calls on a group other than its previous call's (the first call has no previous), c10d's and the
    functional ones alike: what a layout on shared cores pays more for (fitted_shared against its same group)."""
    import torch.distributed._functional_collectives as funcol

    from common.comm_counter import CollectiveCounter

    with playing(0, 4):
        rows, columns = dist.new_group([0, 1]), dist.new_group([0, 2])
        tensor = torch.ones(4)
        with CollectiveCounter() as counter:
            dist.all_reduce(tensor, group=rows)  # the first: no partner before it
            dist.all_reduce(tensor, group=rows)
            dist.all_gather_into_tensor(torch.empty(8), tensor, group=columns)  # new
            funcol.wait_tensor(funcol.all_reduce(tensor, "sum", columns))
            funcol.wait_tensor(funcol.all_reduce(tensor, "sum", rows))  # new
    assert counter.calls == {"all_reduce": 4, "all_gather": 1}
    assert counter.switched == {"all_reduce": 1, "all_gather": 1}


def test_a_fake_pipeline_rank_counts_the_calls_after_its_sends_as_with_a_new_partner():
    """A fake stage rank calls its stage directly, without the schedule's sends and receives; it marks them, so
    tp's first all-reduce after each (a forward after a send or a receive, a backward after a receive) counts as
    a call with a new partner. Under tp alone, none: every all-reduce has the partner of the one before."""
    shape = {"n_layer": 2, "d_model": 64, "n_head": 4, "vocab_size": 512, "block_size": 32}
    cfg = Config(model="custom", world_size=4, pp_microbatches=4, **shape)
    work = Workload(GPTConfig(**shape), 4)
    alone = fake_rank(dataclasses.replace(cfg, world_size=2), Layout(tp=2), work, 0)["counted"]
    assert alone["calls"]["all_reduce"] > 0 and alone["switched"].get("all_reduce", 0) == 0
    staged = fake_rank(cfg, Layout(pp=2, tp=2), work, 0)["counted"]
    # the first stage's 1F1B, F F B F B F B B: a forward right after a forward follows its send (1), every
    # backward its receive (4), a forward after a backward neither (the first stage receives no input); and the
    # tied embedding's all-reduce with the last stage after them (1)
    assert staged["switched"]["all_reduce"] == 1 + 4 + 1, staged


def test_a_launchs_ddp_is_priced_without_the_ops_a_fake_ranks_replicate_runs_in_fsdps_hooks():
    """A fake world's replicas run PyTorch's replicate (FSDP2's machinery), a launch's run DDP (its reducer C++):
    the ops recorded inside FSDP2's hooks (its record_function regions) are left out of a DDP layout's price, not
    the model's own (every matmul stays); a layout that really runs FSDP keeps them."""
    from planning.communication import own_calls

    cfg = Config(model="custom", n_layer=2, d_model=64, n_head=4, vocab_size=512, block_size=32, world_size=2)
    work = Workload(GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512, block_size=32), 4)
    ops = fake_rank(cfg, Layout(dp_replicate=2), work, 0)["ops"]
    count = lambda calls, kind=None: sum(n for c, n in calls if kind in (None, c.kind))  # noqa: E731
    for phase in ("forward", "backward"):
        recorded, own = ops["calls"][phase], own_calls(ops, phase, ddp=True)
        hooks = count(ops["in_fsdp_hooks"][phase])
        assert hooks > 0 and count(own) == count(recorded) - hooks, phase
        assert count(own, "gemm") == count(recorded, "gemm") > 0
        assert own_calls(ops, phase, ddp=False) == recorded


def test_the_step_beyond_its_ops_is_fitted_from_the_combined_points():
    """eager_gaps' per op and per MB, solved from its two sizes' points by hand: forward 100 ops at both sizes,
    1 MB moved and 150 us beyond them at a quarter of the rows, 4 MB and 300 us at the rows: 1 us an op and 50 us
    a MB. The rounds' points are combined first (their median, point by point), then fitted: the fit goes
    through the median rounds' point at the rows a layout runs."""
    from benchmarks.at_scale_calibration import median_of
    from benchmarks.overhead_costs import gaps_of

    def points(few_us: float, beyond_us: float) -> dict:
        two = [
            {"ops": 100, "bytes": 10**6, "beyond_us": few_us},
            {"ops": 100, "bytes": 4 * 10**6, "beyond_us": beyond_us},
        ]
        return {"forward": two, "backward": two, "step": [{"ops": 4, "bytes": 0, "beyond_us": 500.0}]}

    gaps = gaps_of(points(150.0, 300.0))
    assert gaps["forward_us_per_op"] == pytest.approx(1.0) and gaps["forward_us_per_mb"] == pytest.approx(
        50.0
    )
    assert gaps["step_us"] == 500.0
    rounds = [points(150.0, 300.0), points(100.0, 420.0), points(180.0, 330.0)]
    fitted = gaps_of(median_of(rounds))
    at_rows = lambda g: 100 * g["forward_us_per_op"] + 4 * g["forward_us_per_mb"]  # noqa: E731
    assert at_rows(fitted) == pytest.approx(330.0)  # the rounds' median at the rows
