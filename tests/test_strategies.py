"""strategies/: every module has the whole interface, and its closed forms give, without launching a
rank, the bytes held and sent that train_gpt's runs counted (README's strategies table, default model:
1,063,168 parameters, per-rank batch 4 x 64 tokens). The runs themselves check the same theory against
what ranks really hold and send (communication_volume, memory_per_rank)."""

from __future__ import annotations

import pytest

from common.config import UsageError
from common.gpt import GPTConfig, build_gpt
from experiments.train_gpt import Config
from strategies import COMMON_WRONG_VARIANTS, STRATEGIES, WRONG_VARIANTS, strategies_with
from strategies.layout import Layout, chunk_rows

MODEL = build_gpt(GPTConfig(), 0)  # 1,063,168 parameters: 4,252,672 bytes in float32
FULL = 4_252_672
INTERFACE = (
    "NAME",
    "SUMMARY",
    "RANKS",
    "AUTOCAST",
    "WRONG_VARIANTS",
    "layout",
    "refuse",
    "apply",
    "held_bytes",
    "sent_bytes",
    "STEADY_STEP",
    "CHECKPOINT_FORMAT",
    "forward",
    "backward",
    "clip",
    "checkpointer",
    "measure_held",
    "measure_window",
    "quiet",
    "report",
)


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_is_one_whole_module(name):
    module = STRATEGIES[name]
    assert all(hasattr(module, attribute) for attribute in INTERFACE) and module.NAME == name, name
    assert module.__doc__ and len(module.__doc__) > 100  # it teaches what it is
    assert set(module.WRONG_VARIANTS) <= set(WRONG_VARIANTS)
    assert {"resume_without_optimizer_state", "resume_without_data_position"} <= set(module.WRONG_VARIANTS)


def test_every_mistake_belongs_to_a_strategy_and_says_what_it_is():
    assert all(strategies_with(variant) for variant in WRONG_VARIANTS)
    assert set(COMMON_WRONG_VARIANTS) < set(WRONG_VARIANTS)  # and the strategies add their own
    assert strategies_with("unwrapped_root") == ("zero2", "fsdp", "fsdp_tp")
    assert "seed_per_rank" not in STRATEGIES["ddp"].WRONG_VARIANTS  # prepare() broadcasts rank 0's weights


# (strategy, ranks) -> rank 0's params / grads / optimizer bytes, and one step's bytes per kind and on the
# wire (the README's table; the DeepSpeed rows as their runs counted them: docs/train_gpt.md)
HALF, EMBEDDING = FULL // 2, 4 * 2048 * 128
THEORY = {
    ("none", 1): (FULL, FULL, 8_505_600, {}, 0),
    ("ddp", 2): (FULL, FULL, 8_505_600, {"all_reduce": FULL}, FULL),
    ("zero2", 2): (HALF, HALF, 4_252_928, {"all_gather": FULL, "reduce_scatter": FULL}, FULL),
    ("fsdp", 2): (HALF, HALF, 4_252_928, {"all_gather": 7_422_976, "reduce_scatter": FULL}, 5_837_824),
    ("tp", 2): (2_149_376, 2_149_376, 4_299_008, {"all_gather": 2_097_152, "all_reduce": 2_359_296}, 3_407_872),
    # a float32 master partition + 2 moments (12 bytes per partitioned parameter) + a step per group
    ("deepspeed_zero1", 2): (FULL, 0, 3 * HALF + 8, {"all_reduce": FULL + 8, "all_gather": FULL}, FULL + 8 + HALF),
    ("deepspeed_zero2", 2): (FULL, 0, 3 * HALF + 8, {"all_reduce": FULL + 8, "all_gather": FULL}, FULL + 8 + HALF),
    # every parameter but the embedding (1,048,576 bytes) stays whole; the embedding gathered twice
    ("deepspeed_zero3", 2): (HALF + FULL - EMBEDDING, HALF, 3 * HALF + 8,
                             {"reduce_scatter": FULL, "all_gather": 2 * EMBEDDING + FULL - EMBEDDING, "all_reduce": 16},
                             HALF + (2 * EMBEDDING + FULL - EMBEDDING) // 2 + 16),
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


@pytest.mark.parametrize(("name", "ranks"), THEORY)
def test_the_closed_forms_give_the_counted_bytes(name, ranks):
    params, grads, optimizer, sent, wire = THEORY[(name, ranks)]
    strategy, cfg = STRATEGIES[name], Config(strategy=name)
    layout = strategy.layout(ranks)
    held = strategy.held_bytes(MODEL, layout, 0, cfg)
    assert (held["params"], held["grads"], held["optimizer"]) == (params, grads, optimizer)
    theory = strategy.sent_bytes(MODEL, layout, cfg)
    assert {kind: size for kind, size in theory["by_kind"].items() if size} == sent
    assert theory["wire_bytes"] == wire


def test_accumulation_multiplies_what_each_micro_batch_sends_not_the_gradients():
    layout = STRATEGIES["fsdp"].layout(2)
    once = STRATEGIES["fsdp"].sent_bytes(MODEL, layout, Config(strategy="fsdp"))["by_kind"]
    twice = STRATEGIES["fsdp"].sent_bytes(
        MODEL, layout, Config(strategy="fsdp", gradient_accumulation_steps=2)
    )["by_kind"]
    assert twice["all_gather"] == 2 * once["all_gather"] and twice["reduce_scatter"] == once["reduce_scatter"]
    ddp = STRATEGIES["ddp"].sent_bytes(MODEL, layout, Config(strategy="ddp", gradient_accumulation_steps=4))
    assert ddp["by_kind"] == {"all_reduce": FULL}  # no_sync on all but the last micro-batch


def test_three_ranks_hold_torch_chunks_uneven_shards():
    layout, cfg = STRATEGIES["fsdp"].layout(3), Config(strategy="fsdp")
    held = [STRATEGIES["fsdp"].held_bytes(MODEL, layout, rank, cfg)["params"] for rank in range(3)]
    assert held[0] == held[1] > held[2] and sum(held) == FULL
    assert [chunk_rows(2048, 3, r) for r in range(3)] == [683, 683, 682]
    # FSDP2 gathers into a buffer padded to a multiple of 3 ranks: more than the parameters
    gathered = STRATEGIES["fsdp"].sent_bytes(MODEL, layout, cfg)["by_kind"]["all_gather"]
    assert gathered > 7_422_976


def test_bf16_gathers_two_byte_copies_under_fsdp():
    layout = STRATEGIES["fsdp"].layout(2)
    bf16 = STRATEGIES["fsdp"].sent_bytes(MODEL, layout, Config(strategy="fsdp", mixed_precision="bf16"))[
        "by_kind"
    ]
    assert bf16["all_gather"] == 7_422_976 // 2 and bf16["reduce_scatter"] == FULL  # reduced in float32


@pytest.mark.parametrize(
    ("name", "world", "dp", "tp", "message"),
    [
        ("fsdp", 1, 0, 0, "--strategy fsdp with 1 rank(s): 'none' is one process"),
        ("none", 2, 0, 0, "--strategy none with 2 rank(s)"),
        ("ddp", 2, 0, 2, "--dp_size / --tp_size are for --strategy tp and fsdp_tp, not ddp"),
        ("tp", 4, 2, 0, "--strategy tp puts all 4 ranks in one tensor-parallel group"),
        ("fsdp_tp", 4, 3, 2, "--dp_size 3 x --tp_size 2 must equal the 4 ranks launched"),
        ("fsdp_tp", 2, 0, 0, "--strategy fsdp_tp needs --dp_size >= 2 and --tp_size >= 2, got 1 x 2"),
        (
            "pp",
            4,
            4,
            0,
            "--strategy pp needs >= 2 stage ranks per pipeline and no --tp_size: 4 ranks, --dp_size 4",
        ),
        ("pp", 4, 0, 2, "--strategy pp needs >= 2 stage ranks per pipeline and no --tp_size"),
        ("cp", 2, 2, 0, "--strategy cp needs >= 2 ranks per sequence and no --tp_size: 2 ranks, --dp_size 2"),
    ],
)
def test_layouts_refuse_shapes_they_cannot_run(name, world, dp, tp, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        STRATEGIES[name].layout(world, dp, tp)


def test_tensor_parallelism_refuses_split_heads_and_bf16():
    with pytest.raises(UsageError, match="--n_head 2 is not divisible by the tensor-parallel degree 4"):
        STRATEGIES["tp"].refuse(Config(strategy="tp", n_head=2), Layout(4, 1, 4))
    with pytest.raises(UsageError, match="--mixed_precision bf16 with --strategy fsdp_tp: not built"):
        STRATEGIES["fsdp_tp"].refuse(Config(strategy="fsdp_tp", mixed_precision="bf16"), Layout(4, 2, 2))


def test_ranks_are_numbered_tp_major():
    layout = Layout(4, 2, 2)
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1] and [
        layout.tp_rank(r) for r in range(4)
    ] == [0, 1, 0, 1]


def test_pipeline_stages_sit_looped_or_in_a_v_and_split_the_blocks_evenly():
    from strategies.pp import block_bounds, holder, stages_of

    assert [stages_of(r, 2, "1f1b") for r in range(2)] == [[0], [1]]
    assert [stages_of(r, 2, "interleaved_1f1b") for r in range(2)] == [[0, 2], [1, 3]]  # looped
    assert [stages_of(r, 3, "zbv") for r in range(3)] == [
        [0, 5],
        [1, 4],
        [2, 3],
    ]  # the V: rank 0 holds both ends
    assert holder(3, 2, "dualpipev") == 0 and holder(3, 2, "interleaved_zero_bubble") == 1
    assert block_bounds(4, 2) == [0, 2, 4] and block_bounds(6, 4) == [0, 2, 3, 4, 6]


def test_pipeline_ranks_hold_the_model_between_them_and_the_tie_once_more():
    pp, cfg = STRATEGIES["pp"], Config(strategy="pp")
    for schedule, copies in (("1f1b", 1), ("zbv", 0)):  # a V holds both ends of the tie on rank 0
        cfg.pp_schedule = schedule
        held = [pp.held_bytes(MODEL, pp.layout(2), rank, cfg)["params"] for rank in range(2)]
        assert sum(held) == FULL + copies * EMBEDDING, schedule
    # 2 pipelines x 2 stages: rank 0 also all-reduces its stage's gradients with rank 1, its replica
    layout = pp.layout(4, 2)
    assert layout.pp_rank(2) == 1 and [layout.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    sent = pp.sent_bytes(MODEL, layout, Config(strategy="pp"))
    assert sent["data_parallel"] == {"all_reduce": 2_666_496}


def test_pipeline_bubble_theory_falls_with_micro_batches_and_interleaving():
    from strategies.pp import bubble_theory

    assert bubble_theory("gpipe", 2, 4) == bubble_theory("1f1b", 2, 4) == pytest.approx(1 / 5)
    assert bubble_theory("interleaved_1f1b", 2, 4) == pytest.approx(1 / 9)  # (p - 1) / (v m + p - 1)
    assert bubble_theory("zbv", 2, 4) == 0 and bubble_theory("zbv", 4, 4) is None  # zero only with m >= 2p
    assert bubble_theory("dualpipev", 2, 4) is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"gradient_accumulation_steps": 2}, "the pipeline's micro-batches are its accumulation"),
        ({"pp_microbatches": 3}, "--per_rank_batch_size 4 must split evenly into --pp_microbatches 3"),
        (
            {"pp_schedule": "interleaved_1f1b", "n_layer": 3},
            "cuts the GPT into 4 stages: --n_layer 3 must be >= 4",
        ),
        (
            {"pp_schedule": "1f1b", "pp_microbatches": 1},
            "--pp_microbatches 1 with --pp_schedule 1f1b on 2 stage ranks",
        ),
        ({"pp_schedule": "dualpipev", "pp_microbatches": 2}, "it needs >= 4"),
        (
            {"pp_schedule": "zbv", "activation_checkpointing": "selective"},
            "torch's selective checkpoint allows one",
        ),
    ],
)
def test_pipeline_refuses_what_its_schedules_cannot_run(flags, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        STRATEGIES["pp"].refuse(Config(strategy="pp", **flags), Layout(2, 1, 1, 2))


def test_context_parallel_ranks_split_each_sequence_inside_a_data_parallel_group():
    layout = STRATEGIES["cp"].layout(4, 2)  # 2 groups of 2 ranks, each group splitting its own samples
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1] and [
        layout.cp_rank(r) for r in range(4)
    ] == [0, 1, 0, 1]
    with pytest.raises(UsageError, match="--block_size 30 with --strategy cp on 2 ranks: .* a multiple of 4"):
        STRATEGIES["cp"].refuse(Config(strategy="cp", block_size=30), layout)
