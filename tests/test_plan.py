"""tools/plan.py: the layouts of a published model that fit on N GPUs, fastest first (predicted); why the rest
do not; nothing-fits in words; unknown shapes and profiles in one line."""

from __future__ import annotations

import json
import math

import pytest

from tools.plan import main


def test_a_plan_lists_fitting_layouts_fastest_first_and_says_why_others_do_not(capsys):
    assert main(["--model", "llama3_8b", "--gpus", "8", "--top", "50"]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[1].splitlines()[1:]  # the fitting layouts, under their header
    tokens_per_s = [float(line.split()[-3].replace(",", "")) for line in table]
    assert tokens_per_s == sorted(tokens_per_s, reverse=True) and len(tokens_per_s) > 3
    peaks = [float(line.split()[-5]) for line in table]
    assert max(peaks) <= 80.0  # an H100's memory: every listed layout fits
    assert "need more memory than a GPU has" in out and "GiB over" in out
    assert "python experiments/at_scale.py --model llama3_8b --world_size 8" in out
    # Llama 3's pipeline (its ends a block lighter) beside the even split, each under its own words
    assert any("ends 1 block(s) lighter" in line for line in table)
    assert any(line.startswith("pp ") and "lighter" not in line for line in table)


def test_the_search_weighs_a_pipelines_ends_a_block_lighter_where_that_is_another_layout_unless_told_which():
    """Not given, --pp_fewer_blocks_at_ends is searched at 0 and 1 for every pipeline where 1 makes a layout of its
    own: 32 blocks on 2 ranks are 16 and 16 either way (the same memory and work, listed once); given, only that."""
    from common.config import parse_config
    from planning.published import MODELS
    from tools.plan import PlanArgs, candidates

    shape, base = MODELS["llama3_8b"].shape, ["--model", "llama3_8b", "--gpus", "8"]
    searched = parse_config(PlanArgs, base).fewer_at_ends_searched()
    given = parse_config(PlanArgs, [*base, "--pp_fewer_blocks_at_ends", "0"]).fewer_at_ends_searched()
    assert searched == (0, 1) and given == (0,)
    layouts = list(candidates(shape, 8, 8, 2048, searched))
    lighter = {(degrees["pp"], schedule) for degrees, _, schedule, fewer in layouts if fewer}
    assert {(4, "1f1b"), (8, "1f1b"), (4, "interleaved_1f1b")} <= lighter
    assert not lighter & {
        (1, "1f1b"),
        (2, "1f1b"),
        (2, "interleaved_1f1b"),
    }  # 16 and 16 blocks a rank either way
    assert list(candidates(shape, 8, 8, 2048, given)) == [layout for layout in layouts if not layout[3]]


def test_a_mixture_of_experts_is_planned_with_expert_parallelism_and_priced_by_its_active_parameters(capsys):
    """OLMoE on 8 GPUs: ep enumerated over the data-parallel ranks, the layouts priced (no refusal); its model
    FLOPs are the active parameters' (1.3B of 6.9B), so that no layout claims more TFLOP/s than the hardware. The
    table's columns line up however long a layout's words."""
    from common.moe import active_parameter_count
    from planning.cost_model import model_flops_per_token
    from planning.published import MODELS

    assert main(["--model", "olmoe_1b_7b", "--gpus", "8", "--top", "50"]) == 0
    out = capsys.readouterr().out
    header, *table = out.split("\n\n")[1].splitlines()
    assert len({len(line) for line in [header, *table]}) == 1  # every column under its header
    assert any(" x ep " in line for line in table) and any(" x ep " not in line for line in table)
    assert all(float(line.split()[-2]) <= 989 for line in table)  # TFLOP/s under an H100's bf16 peak
    shape = MODELS["olmoe_1b_7b"].shape
    active = active_parameter_count(shape, 6_919_096_320)
    assert model_flops_per_token(shape) == 3 * (2 * (active - shape.vocab_size * shape.d_model)
                                                + 4 * shape.n_layer * shape.block_size * shape.d_model)  # fmt: skip


def test_no_layout_shows_an_mfu_above_the_hardwares_ceiling_even_at_a_long_context(capsys):
    """A 32K-token context on A100s, where attention is most of the work: PaLM's count (the whole attention, where a
    causal kernel runs half) read 93 % MFU against matmuls that reach 86 %. The planner counts the causal half."""
    from planning.cost_model import model_flops_per_token
    from planning.hardware import load_hardware
    from planning.published import MODELS

    args = ["--model", "custom", "--n_layer", "8", "--d_model", "1024", "--n_head", "8", "--block_size", "32768",
            "--global_batch", "16", "--gpus", "4", "--hardware", "a100_80gb", "--json"]  # fmt: skip
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    ceiling = load_hardware("a100_80gb").ops.gemm_efficiency
    assert rows and max(row["mfu"] for row in rows) <= ceiling
    shape = MODELS["llama3_8b"].shape
    whole, causal = model_flops_per_token(shape), model_flops_per_token(shape, causal=True)
    assert whole - causal == 3 * 2 * shape.n_layer * shape.block_size * shape.d_model  # half of 12 L T d


def test_nothing_fits_is_said_in_words(capsys):
    assert main(["--model", "llama3_8b", "--gpus", "1"]) == 1
    out = capsys.readouterr().out
    # 8.03B parameters x 16 bytes = 119.7 GiB of weights, gradients and AdamW moments on the one GPU
    assert "nothing fits: llama3_8b on 1 x h100_sxm" in out and "119.7 GiB a GPU" in out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt5"], "--model 'gpt5' is not a shape this project knows"),
        (["--hardware", "tpu_v9"], "--hardware 'tpu_v9' is not a profile in planning/hardware.yaml"),
        (["--gpus", "0"], "--gpus must be > 0, got 0"),
        (["--gpus", "1000000000"], "--gpus 1,000,000,000: at most 1,048,576"),  # it hung in the divisor walk
        (
            ["--gpus", "512", "--tp", "8", "--dp_shard", "16"],
            "--dp_shard 16 x --tp 8 = 128 GPU(s), but --gpus 512",
        ),
        (["--gpus", "8", "--tp", "-2"], "--tp must be >= 0, got -2"),
        (["--pp_schedule", "pipedream"], "argument --pp_schedule: invalid choice: 'pipedream'"),
        (["--model", "custom", "--gpus", "8"], "--model custom needs --global_batch"),
        (["--model", "llama3_8b", "--n_head", "7", "--gpus", "8"], "--n_head 7 must divide --d_model 4096"),
    ],
)
def test_unknown_input_is_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and err.strip().count("\n") == 0


def test_a_gpu_count_no_layout_can_be_built_from_is_one_line_naming_a_count_that_can(capsys):
    """131 is prime: past a node for tp, past the layers for pp, and no divisor of the 2,048 sequences: no layout
    was considered, so that is what is said (not "nothing fits"), with the nearest count that works."""
    from helpers import run_main_in_process

    code, stderr = run_main_in_process(main, ["--gpus", "131"], capsys)
    assert code == 2 and stderr.strip().count("\n") == 0, stderr
    assert "--gpus 131: no layout of llama3_70b can be built from 131 GPUs" in stderr and "e.g. 132" in stderr
    assert "nothing fits" not in stderr


def test_divisors_are_every_divisor_in_order_at_any_size():
    from tools.plan import divisors

    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 300))
    assert divisors(2**20) == [2**k for k in range(21)]  # in sqrt(n) steps: 16,384 ranks and beyond at once


def test_selective_checkpointing_is_priced_for_a_given_layout_between_none_and_full(capsys):
    """--activation_checkpointing selective with a given layout: its recompute priced (the forward's ops its
    policy does not save, no matmul), so its step is between no checkpointing's and full's; its at_scale command
    carries it. OLMoE under ep, which refuses full checkpointing, fits the published batch with it."""
    steps = {}
    for mode in ("none", "selective", "full"):
        main(["--model", "llama3_8b", "--gpus", "8", "--dp_shard", "8", "--activation_checkpointing", mode])
        out = capsys.readouterr().out
        steps[mode] = float(out.split(" step ")[1].split(" s,")[0])
    assert steps["none"] < steps["selective"] < steps["full"], steps
    assert main(["--model", "olmoe_1b_7b", "--gpus", "256", "--dp_shard", "32", "--ep", "8",
                 "--activation_checkpointing", "selective"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "dp_shard 32 x ep 8, selective checkpointing: peak" in out and "(fits)" in out
    assert "--ep 8 --activation_checkpointing selective" in out


def test_a_given_layout_is_priced_even_when_it_does_not_fit_and_json_lists_the_degrees(capsys):
    """--tp --pp --dp_shard ...: that one layout, priced and printed; one that does not fit says so (exit 1).
    --json: the layouts that fit, fastest first, each with its degrees by name (as the table: the priced ones that
    do not fit read up to 74 % MFU on llama3_70b, needing 1,265 GiB)."""
    assert main(["--model", "llama3_8b", "--gpus", "8", "--dp_shard", "8"]) == 1
    out = capsys.readouterr().out
    assert "llama3_8b on 8 x h100_sxm, dp_shard 8: peak" in out and "does NOT fit: rank 0 (stage 0)" in out
    assert "PREDICTED (fused kernels, flash attention) step" in out and "--world_size 8 --dp_shard 8" in out
    assert main(["--model", "llama3_8b", "--gpus", "8", "--json", "--top", "50"]) == 0
    layouts = json.loads(capsys.readouterr().out)
    steps = [row["step_s"] for row in layouts]
    assert steps == sorted(steps) and len(layouts) > 1 and all(row["fits"] for row in layouts)
    assert all(row["peak_gib"] <= 80 for row in layouts)
    assert all(set(row["layout"]) == {"dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"} for row in layouts)
    assert all(math.prod(row["layout"].values()) == 8 for row in layouts)
    assert {"tflops_per_gpu", "mfu", "step_s", "peak_gib", "pp_schedule", "sequence_parallel"} <= set(
        layouts[0]
    )
    # no layout that fits above what an H100 reaches: matmuls at 80.1% of peak (MAMF), attention and memory-bound
    # ops slower
    assert max(row["mfu"] for row in layouts if row["fits"]) <= 0.60
    # nothing fits (8B's model states alone are 120 GiB on one GPU): an empty list for the program reading it, the
    # reason on stderr, exit 1
    assert main(["--model", "llama3_8b", "--gpus", "1", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out) == [] and "nothing fits: llama3_8b on 1 x h100_sxm" in captured.err


def test_an_interleaved_schedule_halves_the_bubble_and_a_refused_flag_is_one_line(capsys):
    # 16 sequences a data-parallel rank, one a micro-batch, on 16 stages
    base = ["--model", "llama3_8b", "--gpus", "1024", "--pp", "16", "--dp_shard", "8", "--tp", "8", "--global_batch",
            "128"]  # fmt: skip
    import torch

    from common.gpt import GPT
    from planning.cost_model import predict_step
    from planning.hardware import load_hardware
    from planning.published import MODELS
    from strategies.layout import Layout, Workload
    from strategies.theory import stage_theories
    from tools.plan import Candidate

    cfg = MODELS[
        "llama3_405b"
    ].shape  # 126 blocks: 16 stages about alike (the 8B's head would outweigh its 2)
    with torch.device("meta"):
        reference = GPT(cfg)
    layout, work, bubble = Layout(pp=16, dp_shard=8, tp=8), Workload(cfg, 16, 1, "bf16"), {}
    for schedule in ("1f1b", "interleaved_1f1b"):
        flags = Candidate(pp=16, dp_shard=8, tp=8, pp_microbatches=16, pp_schedule=schedule)
        terms = predict_step(
            stage_theories(reference, layout, flags, work), layout, flags, work, load_hardware("h100_sxm")
        )["terms_s"]
        work_s = terms["compute"] + terms["tp"]  # the 16 micro-batches' own work on the slowest stage
        bubble[schedule] = (terms["bubble"] / work_s, (terms["bubble"] + terms["pp_sends"]) / work_s)
        main([*base, "--pp_schedule", schedule, "--json"])
        (row,) = json.loads(capsys.readouterr().out)
        assert row["pp_schedule"] == schedule
    # 16 micro-batches on 16 stages: 1F1B's bubble 15 micro-batch times (15/16 of the work; the last stage, the
    # slowest, its head and float32 loss over 128K words ~10 % more than another stage's work: 15/16 of the others'
    # times over its own); two stages a rank, 7.5, but twice the sends (31 hops each way, not 15)
    assert bubble["1f1b"][0] == pytest.approx(15 / 16 / 1.1, rel=0.1)
    assert bubble["interleaved_1f1b"][1] < 0.65 * bubble["1f1b"][1]
    main([*base, "--pp_schedule", "interleaved_1f1b"])
    out = capsys.readouterr().out
    # the at_scale command it prints runs: at_scale runs one stage a rank, so the layout is checked under 1f1b
    command = out.split("check it at the real size: ")[1].splitlines()[0]
    assert "ceiling: h100_sxm's matmuls reach 80.1% of its bf16 peak" in out
    assert "--pp_schedule" not in command and "(interleaved_1f1b is priced, not run at scale" in command
    from common.config import UsageError  # run_cli prints it as one line, exit 2

    # sequence parallelism under the pipeline: each stage keeps and sends 1/8 of its tokens between the sub-layers
    main([*base, "--json"])
    (plain,) = json.loads(capsys.readouterr().out)
    main([*base, "--sequence_parallel", "--json"])
    (split,) = json.loads(capsys.readouterr().out)
    assert split["sequence_parallel"] and not plain["sequence_parallel"]
    assert split["peak_gib"] < plain["peak_gib"]
    with_cp = ["--model", "llama3_8b", "--gpus", "1024", "--pp", "16", "--dp_shard", "4", "--cp", "2", "--tp", "8",
               "--global_batch", "128", "--sequence_parallel"]  # fmt: skip
    with pytest.raises(UsageError, match="--sequence_parallel with --cp: not built"):
        main(with_cp)  # with context parallelism: the strategies' refusal


def test_a_shape_of_your_own_is_planned_and_its_check_at_scale_runs_the_same_shape(capsys):
    """tools.plan takes train_gpt's model flags: a published shape changed by the ones given (or `custom`, the
    project's GPT changed so); the at_scale command it prints carries them, and the batch when it is not the
    published one."""
    import dataclasses

    from common.gpt import parameter_count
    from planning.published import MODELS

    changed = dict(n_layer=48, d_model=6144, n_head=48)
    assert (
        main(
            [
                "--model",
                "llama3_8b",
                *(f"--{k}={v}" for k, v in changed.items()),
                "--gpus",
                "8",  # a small search: 256 GPUs took 15 s here, 32 GPUs 8 s, 8 GPUs 4.5 s
                "--top",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    expected = parameter_count(dataclasses.replace(MODELS["llama3_8b"].shape, **changed))
    assert f"llama3_8b: {expected:,} parameters" in out
    command = out.split("check the first at the real size: ")[1].splitlines()[0]
    assert all(f"--{k} {v}" in command for k, v in changed.items()) and "--per_rank_batch_size" not in command
    assert main(["--model", "custom", "--n_layer", "4", "--d_model", "256", "--n_head", "4", "--global_batch", "64",
                 "--gpus", "8", "--top", "1"]) == 0  # fmt: skip
    command = capsys.readouterr().out.split("check the first at the real size: ")[1].splitlines()[0]
    assert "--model custom" in command and "--n_layer 4" in command and "--per_rank_batch_size" in command


def test_a_pipelines_ends_can_hold_fewer_blocks_and_its_first_stage_then_holds_less(capsys):
    """--pp_fewer_blocks_at_ends 1 (Llama 3's pipeline): llama3_8b's 32 blocks on 4 stages as 7, 9, 9, 7; the
    first stage, which holds the embedding and the most micro-batches in flight, held the peak: it falls."""
    base = ["--model", "llama3_8b", "--gpus", "32", "--pp", "4", "--dp_shard", "8", "--json"]
    main(base)
    even = json.loads(capsys.readouterr().out)[0]
    main([*base, "--pp_fewer_blocks_at_ends", "1"])
    lighter = json.loads(capsys.readouterr().out)[0]
    assert lighter["peak_gib"] < even["peak_gib"]
    main(base[:-1] + ["--pp_fewer_blocks_at_ends", "1"])
    out = capsys.readouterr().out
    assert "pp 4 x dp_shard 8, ends 1 block(s) lighter: peak" in out
    assert "--pp 4 --dp_shard 8 --pp_fewer_blocks_at_ends 1 --hardware h100_sxm" in out
