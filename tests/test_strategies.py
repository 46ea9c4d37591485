"""strategies/: each dimension is one whole module; the presets only fill in degrees; and the composed closed
forms give, without launching a rank, the bytes held and sent that train_gpt's runs counted (README's
strategies table, default model: 1,063,168 parameters, per-rank batch 4 x 64 tokens), for every rank of any
layout. The runs check the same theory against what ranks really hold and send (communication_volume,
memory_per_rank)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import numpy
import pytest
import torch

from common.config import UsageError
from common.gpt import GPTConfig, build_gpt
from strategies import (
    activation_checkpointing,
    compile,
    cp,
    deepspeed,
    ep,
    pp,
    pp_schedules,
    registry,
    replicate,
    shard,
    tp,
)
from strategies.args import COMMON_WRONG_VARIANTS, WRONG_VARIANTS, ParallelArgs
from strategies.args import is_a_mistake_under as is_a_mistake_under_plan
from strategies.layout import DIMS, Layout, Mistake, Workload, chunk_rows
from strategies.piece import Piece, Plan
from strategies.theory import held_bytes, sent_bytes

MODEL = build_gpt(GPTConfig(), 0)  # 1,063,168 parameters: 4,252,672 bytes in float32
FULL = 4_252_672
HALF, EMBEDDING = FULL // 2, 4 * 2048 * 128
WORK = Workload(GPTConfig(), 4)
MODULES = (replicate, shard, tp, cp, pp, ep, activation_checkpointing, compile)


def plan_of(layout: Layout, engine_stage: int | None = None, work: Workload = WORK, **flags) -> Plan:
    return Plan(ParallelArgs(**flags), layout, work, engine_stage, registry.PIECES)


def is_a_mistake_under(variant: str, layout: Layout, engine_stage: int | None) -> bool:
    return is_a_mistake_under_plan(variant, plan_of(layout, engine_stage))


def layout_of(preset: str, ranks: int, **flags) -> tuple[Layout, ParallelArgs]:
    args = ParallelArgs(strategy=preset, **flags)
    return args.resolve_layout(ranks), args


def theory(layout: Layout, args: ParallelArgs, rank: int = 0, work: Workload = WORK) -> tuple[dict, dict]:
    return held_bytes(MODEL, layout, rank, args, work), sent_bytes(MODEL, layout, rank, args, work)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.split(".")[-1])
def test_every_dimension_is_one_whole_module_behind_one_interface(module):
    assert module.__doc__ and len(module.__doc__) > 500  # it teaches what it is
    piece = module.PIECE
    assert isinstance(piece, Piece) and piece in registry.PIECES  # one interface, registered
    assert dataclasses.is_dataclass(piece.Flags) and piece.Flags is module.Flags
    flags = {f.name for f in dataclasses.fields(piece.Flags)}
    assert flags <= {f.name for f in dataclasses.fields(ParallelArgs)}  # folded into the CLI
    assert all(isinstance(m, Mistake) and m.what for m in piece.MISTAKES.values())
    # the same signatures for every piece: what it overrides keeps the interface's parameters
    for name, method in vars(type(piece)).items():
        if inspect.isfunction(method) and hasattr(Piece, name) and not name.startswith("_"):
            assert list(inspect.signature(method).parameters) == list(
                inspect.signature(getattr(Piece, name)).parameters
            ), (piece.name, name)


def test_the_registry_applies_the_pieces_in_torchtitans_order():
    names = [piece.name for piece in registry.PIECES]
    assert names == [
        "pp",
        "tp",
        "cp",
        "ep",
        "activation_checkpointing",
        "compile",
        "dp_shard",
        "dp_replicate",
        "fault_tolerant",  # across the replica groups, each one launch of the layout above
    ]


def test_every_mistake_says_what_it_is_and_is_one_under_some_layout():
    assert set(COMMON_WRONG_VARIANTS) < set(WRONG_VARIANTS) and all(WRONG_VARIANTS.values())
    layouts = [
        Layout(dp_shard=2, tp=2, pp=2, cp=2),
        Layout(dp_replicate=2),
        Layout(ep=2),
        Layout(ep=2, tp=2),
        Layout(ep=2, cp=2),
    ]
    works = [WORK, Workload(GPTConfig(n_experts=4, capacity_factor=1.0), rows=4)]  # a MoE's under a capacity
    # a fault-tolerant replacement group: fault tolerance's mistakes
    flags = [{}, {"fault_tolerant": True, "ft_replacement": True}]
    for variant in WRONG_VARIANTS:
        assert any(is_a_mistake_under_plan(variant, plan_of(layout, stage, work, **f)) for layout in layouts
                   for stage in (None, 3) for work in works for f in flags), variant  # fmt: skip
    ddp = Layout(
        dp_replicate=2
    )  # Accelerate's DDP broadcasts rank 0's weights: seed_per_rank changes nothing
    assert not is_a_mistake_under("seed_per_rank", ddp, None) and is_a_mistake_under(
        "seed_per_rank", Layout(tp=2), None
    )
    assert is_a_mistake_under(
        "seed_per_rank", Layout(dp_replicate=2, tp=2), None
    )  # PyTorch's replicate does not
    assert not is_a_mistake_under("unwrapped_root", Layout(dp_replicate=2, cp=2), None)


@pytest.mark.parametrize(
    ("preset", "ranks", "degrees"),
    [
        ("none", 1, {}),
        ("ddp", 2, {"dp_replicate": 2}),
        ("zero2", 3, {"dp_shard": 3}),
        ("fsdp_tp", 4, {"dp_shard": 2, "tp": 2}),
        ("fsdp_tp", 8, {"dp_shard": 4, "tp": 2}),
        ("pp", 2, {"pp": 2}),
        ("cp", 2, {"cp": 2}),
    ],
)
def test_a_preset_only_fills_in_degrees(preset, ranks, degrees):
    layout, args = layout_of(preset, ranks)
    assert {dim: n for dim, n in layout.degrees().items() if n > 1} == degrees
    assert args.reshard_after_forward == ("never" if preset == "zero2" else "default")


def test_degrees_the_flags_give_take_precedence_and_the_preset_takes_the_rest():
    layout, args = layout_of("pp", 4, dp_replicate=2)  # two pipelines of two stages
    assert (layout.pp, layout.dp_replicate) == (2, 2) and args.pp == 2
    layout, _ = layout_of("auto", 8, dp_shard=2, tp=2, pp=2)
    assert layout.describe() == "pp 2 x dp_shard 2 x tp 2 (8 ranks)"


@pytest.mark.parametrize(
    ("preset", "ranks", "flags", "message"),
    [
        ("fsdp", 1, {}, "--strategy fsdp on 1 rank(s): nothing else leaves 1 rank(s) for --dp_shard"),
        ("none", 2, {}, "one process = 1 rank(s), but 2 were launched"),
        ("auto", 4, {"dp_shard": 3, "tp": 2}, "--dp_shard 3 x --tp 2 = 6 rank(s), but 4 were launched"),
        ("fsdp_tp", 2, {}, "--strategy fsdp_tp on 2 rank(s): --tp 2 leaves 1 rank(s) for --dp_shard"),
        (
            "pp",
            4,
            {"dp_replicate": 4},
            "--strategy pp on 4 rank(s): --dp_replicate 4 leaves 1 rank(s) for --pp",
        ),
        ("auto", 2, {"cp": -2}, "--cp must be >= 0"),
        (
            "zero2",
            2,
            {"reshard_after_forward": "always"},
            "--strategy zero2 is --reshard_after_forward never",
        ),
    ],
)
def test_layouts_refuse_shapes_they_cannot_run(preset, ranks, flags, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout_of(preset, ranks, **flags)


# (preset, ranks) -> rank 0's params / grads / optimizer bytes, and one step's bytes per kind and on the wire,
# as the runs counted them (the README's table; docs/train_gpt.md)
THEORY = {
    ("none", 1): (FULL, FULL, 8_505_600, {}, 0),
    ("ddp", 2): (FULL, FULL, 8_505_600, {"all_reduce": FULL}, FULL),
    ("zero2", 2): (HALF, HALF, 4_252_928, {"all_gather": FULL, "reduce_scatter": FULL}, FULL),
    ("fsdp", 2): (HALF, HALF, 4_252_928, {"all_gather": 7_422_976, "reduce_scatter": FULL}, 5_837_824),
    ("tp", 2): (2_149_376, 2_149_376, 4_299_008, {"all_gather": 2_097_152, "all_reduce": 2_359_296}, 3_407_872),
    # stage 0 of 2 (1f1b, m 4): the embeddings and blocks 0-1 (666,624 parameters in 32 tensors); 4 micro-batch
    # activations of 1 x 64 x 128 floats each way, the loss, the tied embedding's gradient with stage 1
    ("pp", 2): (2_666_496, 2_666_496, 2 * 2_666_496 + 4 * 32,
                {"send": 4 * 32_768, "recv": 4 * 32_768, "broadcast": 4, "all_reduce": EMBEDDING},
                4 * 32_768 + 4 + EMBEDDING),
    # every block all-gathers K and V of the whole sequence (4 x 64 x 128 floats each) and reduce-scatters
    # their gradients over the 2 cp ranks; DDP all-reduces the gradients
    ("cp", 2): (FULL, FULL, 8_505_600, {"all_gather": 8 * 131_072, "reduce_scatter": 8 * 131_072, "all_reduce": FULL},
                8 * 131_072 + FULL),
    ("fsdp_tp", 4): (1_074_688, 1_074_688, 2_149_632,
                     {"all_gather": 5_837_824, "all_reduce": 2_359_296, "reduce_scatter": 2_149_376}, 6_352_896),
}  # fmt: skip


@pytest.mark.parametrize(("preset", "ranks"), THEORY)
def test_the_composed_closed_forms_give_the_counted_bytes(preset, ranks):
    params, grads, optimizer, sent, wire = THEORY[(preset, ranks)]
    held, theory_sent = theory(*layout_of(preset, ranks))
    assert (held["params"], held["grads"], held["optimizer"]) == (params, grads, optimizer)
    assert {kind: size for kind, size in theory_sent["by_kind"].items() if size} == sent
    assert theory_sent["wire_bytes"] == wire


def test_deepspeed_stages_hold_and_send_what_their_runs_counted():
    layout = Layout(dp_shard=2)
    zero1, zero3 = deepspeed.held_bytes(MODEL, layout, 1), deepspeed.held_bytes(MODEL, layout, 3)
    assert (zero1["params"], zero1["grads"], zero1["optimizer"]) == (FULL, 0, 3 * HALF + 8)
    # every parameter but the embedding (1,048,576 bytes) stays whole
    assert (zero3["params"], zero3["grads"]) == (HALF + FULL - EMBEDDING, HALF)
    assert deepspeed.sent_bytes(MODEL, layout, 2, WORK)["by_kind"] == {
        "all_reduce": FULL + 8,
        "all_gather": FULL,
    }
    sent3 = deepspeed.sent_bytes(MODEL, layout, 3, WORK)["by_kind"]
    assert sent3 == {"reduce_scatter": FULL, "all_gather": 2 * EMBEDDING + FULL - EMBEDDING, "all_reduce": 16}


LAYOUTS = [
    Layout(**dict(zip(pair, (2, 2), strict=True)))
    for pair in itertools.combinations(("dp_replicate", "dp_shard", "tp", "pp", "cp"), 2)
] + [Layout(dp_shard=2, tp=2, pp=2), Layout(dp_shard=2, tp=2, pp=2, cp=2), Layout(dp_replicate=2, dp_shard=3, tp=2),
     Layout(pp=4, tp=2), Layout(dp_shard=3)]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.describe())
def test_the_ranks_of_any_layout_hold_each_parameter_as_often_as_it_is_copied(layout):
    """Over all ranks, each parameter's elements are held once per copy: tensor parallelism and FSDP split
    (their pieces add up to the whole), the pipeline places each block on one stage-rank (the tied embedding's
    copy once more, with the head), and replicas, tensor-parallel ranks (for what TP does not split) and
    unsharded context-parallel ranks copy. Every rank of a tensor-parallel group sends what the others send."""
    args = ParallelArgs()
    held = sum(held_bytes(MODEL, layout, rank, args, WORK)["params"] for rank in range(layout.world_size))
    copies_of_all = layout.dp_replicate * (1 if "cp" in layout.shard_dims else layout.cp)
    expected = 0
    for name, param in MODEL.named_parameters():
        copies = copies_of_all * (1 if tp.split_dim(name) is not None else layout.tp)
        expected += 4 * param.numel() * copies * (1 + (name == "tok_emb.weight" and layout.pp > 1))
    assert held == expected
    for rank in range(layout.world_size):
        group = layout.group(rank, ("tp",))
        sent = [sent_bytes(MODEL, layout, r, args, WORK)["by_dimension"].get("tp") for r in group]
        assert all(s == sent[0] for s in sent)


def test_pipeline_and_replicas_compose_per_stage():
    layout, args = layout_of("pp", 4, dp_replicate=2)  # ranks 0, 1: stage 0 of pipelines 0, 1
    assert [layout.coordinate(r, "pp") for r in range(4)] == [0, 0, 1, 1]
    assert [layout.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    sent = theory(layout, args)[1]["by_dimension"]
    assert sent["dp_replicate"] == {"all_reduce": 2_666_496}  # stage 0's gradients over its 2 replicas
    assert sent["pp"]["all_reduce"] == EMBEDDING  # the tied embedding's gradient with stage 1


def test_accumulation_multiplies_what_each_micro_batch_sends_not_the_gradients():
    layout, args = layout_of("fsdp", 2)
    once = theory(layout, args)[1]["by_kind"]
    twice = theory(layout, args, work=dataclasses.replace(WORK, micro_batches=2))[1]["by_kind"]
    assert twice["all_gather"] == 2 * once["all_gather"] and twice["reduce_scatter"] == once["reduce_scatter"]
    ddp, ddp_args = layout_of("ddp", 2)
    assert theory(ddp, ddp_args, work=dataclasses.replace(WORK, micro_batches=4))[1]["by_kind"] == {
        "all_reduce": FULL
    }


def test_three_ranks_hold_torch_chunks_uneven_shards():
    layout, args = layout_of("fsdp", 3)
    held = [theory(layout, args, rank)[0]["params"] for rank in range(3)]
    assert held[0] == held[1] > held[2] and sum(held) == FULL
    assert [chunk_rows(2048, 3, r) for r in range(3)] == [683, 683, 682]
    # the arithmetic is torch.chunk's, empty trailing pieces too (torch.chunk(5 rows, 4): 2, 2, 1, none)
    for rows, parts in [(0, 3), (5, 4), (7, 7), (10, 4), (2048, 5), (3, 8)]:
        pieces = [p.shape[0] for p in torch.chunk(torch.empty(rows), parts)]
        assert [chunk_rows(rows, parts, i) for i in range(parts)] == pieces + [0] * (parts - len(pieces))
    # FSDP2 gathers into a buffer padded to a multiple of 3 ranks: more than the parameters
    assert theory(layout, args)[1]["by_kind"]["all_gather"] > 7_422_976


def test_bf16_gathers_two_byte_copies_under_fsdp():
    layout, args = layout_of("fsdp", 2)
    bf16 = theory(layout, args, work=dataclasses.replace(WORK, mixed_precision="bf16"))[1]["by_kind"]
    assert bf16["all_gather"] == 7_422_976 // 2 and bf16["reduce_scatter"] == FULL  # reduced in float32


def test_hsdp_all_reduces_each_shard_over_the_replicas():
    layout, args = layout_of("auto", 4, dp_replicate=2, dp_shard=2)
    held, sent = theory(layout, args)
    assert held["params"] == HALF and sent["by_dimension"]["dp_replicate"] == {"all_reduce": HALF}


def test_ranks_are_numbered_tp_fastest_then_cp_dp_shard_dp_replicate_pp():
    layout = Layout(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.coordinate(r, "tp") for r in range(4)] == [0, 1, 0, 1]
    assert [layout.coordinate(r, "pp") for r in range(8)] == [0] * 4 + [1] * 4
    assert layout.group(5, ("tp",)) == [4, 5] and layout.group(5, ("pp",)) == [1, 5]
    assert layout.rank_at(pp=1, dp_shard=1, tp=1) == 7 and DIMS[0] == "pp" and DIMS[-1] == "tp"


def test_context_parallel_ranks_join_the_data_parallel_gradient_group():
    assert Layout(dp_shard=2, cp=2).shard_dims == ("dp_shard", "cp")
    assert Layout(dp_replicate=2, cp=2).replicate_dims == ("dp_replicate", "cp")
    assert Layout(dp_replicate=2, dp_shard=2, cp=2).replicate_dims == ("dp_replicate",)
    layout = Layout(dp_replicate=2, cp=2)  # 2 groups of 2 ranks, each group splitting its own samples
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.coordinate(r, "cp") for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    ("piece", "layout", "flags", "work", "message"),
    [
        (tp, Layout(tp=4), {}, dataclasses.replace(WORK, model=GPTConfig(n_head=2)),
         "--n_head 2 must be divisible by --tp 4"),
        (tp, Layout(tp=2, cp=2), {"sequence_parallel": True}, WORK, "--sequence_parallel with --cp: not built"),
        (cp, Layout(cp=2), {}, dataclasses.replace(WORK, model=GPTConfig(block_size=30)),
         "--block_size 30 with --cp 2: .* a multiple of 4"),
        (shard, Layout(dp_shard=2, pp=2), {"reshard_after_forward": "always"}, WORK,
         "--reshard_after_forward always with --pp: not built"),
        (pp, Layout(pp=2), {}, dataclasses.replace(WORK, micro_batches=2), "the pipeline's micro-batches are its accumulation"),
        (pp, Layout(pp=2), {"pp_microbatches": 3}, WORK, "--per_rank_batch_size 4 must split evenly into --pp_microbatches 3"),
        (pp, Layout(pp=2), {"pp_schedule": "interleaved_1f1b"}, dataclasses.replace(WORK, model=GPTConfig(n_layer=3)),
         "cuts the GPT into 4 stages: --n_layer 3 must be >= 4"),
        (pp, Layout(pp=2), {"pp_microbatches": 1}, dataclasses.replace(WORK, rows=1),
         "--pp_microbatches 1 with --pp_schedule 1f1b on 2 stage ranks"),
        (pp, Layout(pp=2), {"pp_schedule": "dualpipev", "pp_microbatches": 2}, WORK, "it needs >= 4"),
        (pp, Layout(pp=4), {"pp_fewer_blocks_at_ends": 2}, dataclasses.replace(WORK, model=GPTConfig(n_layer=4)),
         "--pp_fewer_blocks_at_ends 2 with --n_layer 4 on 4 stages: it must be >= 0 and leave every stage a block "
         "(blocks a stage: .0, 2, 2, 0.)"),
        (pp, Layout(pp=2), {"pp_fewer_blocks_at_ends": -1}, WORK, "--pp_fewer_blocks_at_ends -1 with"),
    ],
)  # fmt: skip
def test_each_dimension_refuses_what_it_cannot_run(piece, layout, flags, work, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        piece.PIECE.refuse(plan_of(layout, work=work, **flags))


def test_pieces_that_cannot_work_together_are_refused_together():
    with pytest.raises(UsageError, match="torch's selective checkpoint allows one"):
        ParallelArgs(pp_schedule="zbv", activation_checkpointing="selective").refuse_layout(
            Layout(pp=2), WORK, 1.0
        )


def test_pipeline_stages_sit_looped_or_in_a_v_and_split_the_blocks_evenly():
    assert [pp_schedules.stages_of(r, 2, "1f1b") for r in range(2)] == [[0], [1]]
    assert [pp_schedules.stages_of(r, 2, "interleaved_1f1b") for r in range(2)] == [[0, 2], [1, 3]]  # looped
    assert [pp_schedules.stages_of(r, 3, "zbv") for r in range(3)] == [
        [0, 5],
        [1, 4],
        [2, 3],
    ]  # a V: rank 0 holds both ends
    assert (
        pp_schedules.holder(3, 2, "dualpipev") == 0
        and pp_schedules.holder(3, 2, "interleaved_zero_bubble") == 1
    )
    assert pp_schedules.block_bounds(4, 2) == [0, 2, 4] and pp_schedules.block_bounds(6, 4) == [0, 2, 3, 4, 6]
    # the ends lighter (Llama 3: 126 blocks on 32 stages, 3 at each end and 4 on every other)
    sizes = numpy.diff(pp_schedules.block_bounds(126, 32, fewer_at_ends=1)).tolist()
    assert sizes == [3] + [4] * 30 + [3]
    assert (
        numpy.diff(pp_schedules.block_bounds(126, 32)).tolist().count(3) == 2
    )  # as even: two 3s mid-pipeline


def test_pipeline_ranks_hold_the_model_between_them_and_the_tie_once_more():
    for schedule in ("1f1b", "zbv"):  # the head keeps its own copy of the tied embedding, wherever it sits
        layout, args = layout_of("pp", 2, pp_schedule=schedule)
        held = [theory(layout, args, rank)[0]["params"] for rank in range(2)]
        assert sum(held) == FULL + EMBEDDING, schedule
    # a V holds both ends on rank 0: the tie is summed in place, nothing all-reduced
    layout, args = layout_of("pp", 2, pp_schedule="zbv")
    assert "all_reduce" not in theory(layout, args)[1]["by_kind"]


def test_pipeline_bubble_theory_falls_with_micro_batches_and_interleaving():
    assert (
        pp_schedules.bubble_theory("gpipe", 2, 4)
        == pp_schedules.bubble_theory("1f1b", 2, 4)
        == pytest.approx(1 / 5)
    )
    assert pp_schedules.bubble_theory("interleaved_1f1b", 2, 4) == pytest.approx(
        1 / 9
    )  # (p - 1) / (v m + p - 1)
    assert (
        pp_schedules.bubble_theory("zbv", 2, 4) == 0 and pp_schedules.bubble_theory("zbv", 4, 4) is None
    )  # zero only with m >= 2p
    assert pp_schedules.bubble_theory("dualpipev", 2, 4) is None
