"""Your own model (common/hf_model.py): a transformers causal LM trained by train_gpt. The adapter is the transformers
model (its logits, to the bit, for every preset), a config.json on disk is the model it was written from, what is
not built for it is refused in one line, and it trains under every layout built for it passing every check
train_gpt makes; at_scale and the planner take it; accelerate estimate-memory's count is set beside ours."""

from __future__ import annotations

import pytest
import torch

from common.hf_model import (
    PRESETS,
    build_model,
    gpt_config_of,
    ours_from_hf,
    read_hf_config,
    transformers_config,
)
from experiments.train_gpt import main
from helpers import (
    GPT_DISTRIBUTED_CHECKS,
    HF_TINY,
    assert_gpt_passed,
    fork_launch,
    run_in_process,
    run_main_in_process,
)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_adapter_is_the_transformers_model(preset):
    """Built with the same seed, HFCausalLM holds transformers' own initial weights under the GPT's names and
    computes its logits exactly (the rotary embedding, the per-layer masks, a tied head)."""
    from transformers import AutoModelForCausalLM

    cfg = gpt_config_of(read_hf_config(preset), 300, 32)
    model = build_model(cfg, 3)
    config = transformers_config(cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(3)
    theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ours, renamed = model.state_dict(), ours_from_hf(theirs.state_dict())
    assert list(ours) == list(renamed) and all(torch.equal(ours[name], renamed[name]) for name in ours)
    idx = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(idx), theirs(idx).logits)
    assert {n.split(".")[0] for n, _ in model.named_parameters()} == {"tok_emb", "blocks", "ln_f"} | (
        set() if config.tie_word_embeddings else {"head"}
    )
    assert (model.head.weight is model.tok_emb.weight) == bool(config.tie_word_embeddings)


def test_a_sliding_window_is_applied():
    """mistral_tiny's layers see the 16 tokens before each one: its last logits differ from the same weights'
    under full causal attention, its first 16 positions (which see no further back) do not."""
    model = build_model(gpt_config_of(read_hf_config("mistral_tiny"), 300, 32), 0)
    idx = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    windowed = model(idx)
    model.layer_kinds = ["full_attention"] * len(model.blocks)
    full = model(idx)
    assert torch.equal(windowed[:, :16], full[:, :16]) and not torch.allclose(windowed[:, 16:], full[:, 16:])


def test_a_config_json_on_disk_is_the_model_it_was_written_from(tmp_path):
    """save_pretrained's config.json (by folder or by file) reads back to the model it was written from, same shape,
    same weights (a tied head here: one tensor)."""
    written = read_hf_config("qwen2_tiny")
    written.tie_word_embeddings = True
    written.save_pretrained(tmp_path)
    written_cfg = gpt_config_of(written, 300, 32)
    for path in (tmp_path, tmp_path / "config.json"):
        cfg = gpt_config_of(read_hf_config(str(path)), 300, 32)
        assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.tie_weights) == (64, 2, 4, 2, True)
        model = build_model(cfg, 0)
        assert model.head.weight is model.tok_emb.weight
        state = model.state_dict()
        assert all(
            torch.equal(a, b)
            for a, b in zip(state.values(), build_model(written_cfg, 0).state_dict().values(), strict=True)
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hf_config", "nope"], "--hf_config 'nope': neither a preset (llama_tiny, qwen2_tiny"),
        (
            ["--hf_config", "llama_tiny", "--n_layer", "3"],
            "--n_layer with --hf_config: the config sets the model's shape",
        ),
        (
            ["--hf_config", "llama_tiny", "--compile"],
            "--compile with --hf_config: not built for a transformers model yet",
        ),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message, capsys):
    code, stderr = run_main_in_process(main, [*HF_TINY, "--output_dir", str(tmp_path / "run"), *args], capsys)
    assert code == 2 and message in stderr and stderr.strip().count("\n") == 0, stderr
    assert not (tmp_path / "run").exists()


def test_what_is_not_built_for_it_is_refused_in_one_line(tmp_path):
    """cp and ep know the GPT's modules by name: refused with --hf_config, naming what is built; tensor parallelism
    refuses a plan style it does not apply (Mixtral's packed experts)."""
    from common.config import UsageError, parse_config
    from experiments.train_gpt import Config
    from strategies.layout import Layout

    def refusal(args: list[str], layout: Layout) -> str:
        cfg = parse_config(Config, args)
        with pytest.raises(UsageError) as refused:
            cfg.refuse_layout(layout, cfg.workload(), 1.0)
        return str(refused.value)

    for dim in ("cp", "ep"):
        assert refusal(["--hf_config", "llama_tiny"], Layout(**{dim: 2})).startswith(
            f"--{dim} with --hf_config: not built for a transformers model yet"
        )
    said = refusal(["--hf_config", "llama_tiny"], Layout(cp=2))
    assert said.endswith("built: pp, tp, activation_checkpointing, dp_shard, dp_replicate")
    assert "packed_colwise (blocks.*.mlp.experts.gate_up_proj)" in refusal(
        ["--hf_config", "mixtral_tiny"], Layout(tp=2)
    )


@pytest.mark.launch
def test_one_process_trains_it_and_holds_its_theory(tmp_path, capsys):
    summary = assert_gpt_passed(
        run_in_process(main, [*HF_TINY, "--hf_config", "llama_tiny"], tmp_path / "r", capsys), 1
    )
    assert summary["metrics"]["parameters"] == 158_016 and summary["config"]["hf_config"] == "llama_tiny"


@pytest.mark.launch
def test_fsdp_and_its_own_tensor_parallel_plan_on_four_ranks_pass_every_check(tmp_path):
    """llama_tiny under --dp_shard 2 x --tp 2: FSDP2 per decoder layer over the plan transformers wrote for it; the
    same loss and parameters as one process, the global gradient norm, every rank's bytes held and sent equal to
    the theory read off the plan and the module tree: per micro-batch, 7 all-reduces a layer (its 2 rowwise
    outputs forward, its 5 colwise inputs' gradients backward) and the head's."""
    args = [*HF_TINY, "--hf_config", "llama_tiny", "--dp_shard", "2", "--tp", "2"]
    summary = assert_gpt_passed(fork_launch(main, args, tmp_path / "run", num_processes=4), 4)
    assert set(summary["checks"]) == GPT_DISTRIBUTED_CHECKS
    assert summary["metrics"]["communication"]["counted"]["calls"]["all_reduce"] == 2 * 7 + 1


@pytest.mark.launch
def test_a_tied_head_under_tensor_parallelism_splits_the_embedding_it_shares(tmp_path):
    """A config with tie_word_embeddings: the plan splits the head's vocabulary, so the embedding (one tensor with
    it) is split alike and its output all-reduced; every check passes, 16 all-reduces a step (7 a layer, the head's
    input gradient, the embedding's output)."""
    tied = read_hf_config("qwen2_tiny")
    tied.tie_word_embeddings = True
    tied.save_pretrained(tmp_path / "tied")
    summary = assert_gpt_passed(fork_launch(main, [*HF_TINY, "--hf_config", str(tmp_path / "tied"), "--tp", "2"],
                                            tmp_path / "run"), 2)  # fmt: skip
    assert summary["metrics"]["communication"]["counted"]["calls"]["all_reduce"] == 2 * 7 + 2


@pytest.mark.launch
def test_a_pipeline_of_replicas_and_ddp_pass_every_check(tmp_path):
    """qwen2_tiny cut into 2 stages, each replicated twice (PyTorch's replicate: 4 ranks); llama_tiny under
    Accelerate's DDP with selective activation checkpointing, whose broadcast of the rotary frequencies (a buffer,
    once a step) the theory counts."""
    args = [*HF_TINY, "--hf_config", "qwen2_tiny", "--pp", "2", "--dp_replicate", "2"]
    assert_gpt_passed(fork_launch(main, args, tmp_path / "pp", num_processes=4), 4)
    args = [
        *HF_TINY,
        "--hf_config",
        "llama_tiny",
        "--dp_replicate",
        "2",
        "--activation_checkpointing",
        "selective",
    ]
    summary = assert_gpt_passed(fork_launch(main, args, tmp_path / "ddp"), 2)
    assert summary["metrics"]["communication"]["counted"]["bytes"]["broadcast"] == 64  # 2 buffers of 8 floats


@pytest.mark.launch
def test_a_run_starts_from_transformers_own_weights(tmp_path, capsys):
    """save_pretrained's folder: its config.json as --hf_config, its model.safetensors (transformers' names, no
    digest of ours) as --init_from; with its head zeroed every logit is 0, so the validation loss before training is
    exactly ln(vocabulary)."""
    import math

    from transformers import AutoModelForCausalLM

    from common.text import load_corpus

    vocabulary = load_corpus("", 512, 32, 0.02)["vocab_size"]
    model = AutoModelForCausalLM.from_config(
        transformers_config(gpt_config_of(read_hf_config("llama_tiny"), vocabulary, 32))
    )
    torch.nn.init.zeros_(model.lm_head.weight)
    model.save_pretrained(tmp_path / "weights")
    weights = str(tmp_path / "weights" / "model.safetensors")
    args = [*HF_TINY, "--hf_config", str(tmp_path / "weights"), "--init_from", weights]
    summary = assert_gpt_passed(run_in_process(main, args, tmp_path / "run", capsys), 1)
    assert summary["metrics"]["val_loss_before"] == pytest.approx(math.log(vocabulary), abs=1e-5)
    assert summary["metrics"]["init_from"]["path"] == weights


@pytest.mark.launch
def test_at_scale_and_the_planner_take_a_transformers_config(tmp_path, capsys):
    """A Llama-shaped config.json on disk (its own vocabulary: no tokenizer at scale): tools.plan prices a layout of
    it and prints the at_scale command for it; at_scale runs that command's ranks on fake tensors, every one holding
    and sending its theory to the byte (tensor parallelism by the model's own plan)."""
    from transformers import LlamaConfig

    from experiments.at_scale import main as at_scale
    from tools.plan import main as plan

    LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=4000).save_pretrained(tmp_path / "model")  # fmt: skip
    model = ["--hf_config", str(tmp_path / "model"), "--block_size", "128"]
    layout = ["--pp", "2", "--dp_shard", "2", "--tp", "2"]
    assert plan([*model, *layout, "--gpus", "8", "--global_batch", "16"]) == 0
    out = capsys.readouterr().out
    assert f"--hf_config {tmp_path / 'model'} --block_size 128" in out and "--model" not in out
    summary = assert_gpt_passed(run_in_process(at_scale, [*model, *layout, "--report_to", "none"], tmp_path / "run",
                                               capsys), 1)  # fmt: skip
    parameters = 2 * 4000 * 256 + 4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 704 + 2 * 256) + 256
    assert (
        summary["metrics"]["parameters"] == parameters and summary["checks"]["communication_volume"]["passed"]
    )


def test_accelerates_count_is_its_parameters_times_four_in_float32(tmp_path):
    """benchmarks/memory_vs_accelerate.py calls accelerate estimate-memory's own functions on a config on disk: the
    model's bytes are its parameters' and buffers' (float32: the rotary frequencies, 64 bytes, counted too), Adam's
    training peak 4 of them, mixed precision's 2."""
    from benchmarks.memory_vs_accelerate import accelerate_count
    from common.gpt import count_parameters

    read_hf_config("qwen2_tiny").save_pretrained(tmp_path)
    counted = accelerate_count(tmp_path)
    config = read_hf_config(str(tmp_path))
    model = build_model(gpt_config_of(config, config.vocab_size, 64), 0)
    size = 4 * count_parameters(model) + sum(b.numel() * 4 for b in model.buffers())
    assert sum(b.numel() * 4 for b in model.buffers()) == 64
    assert counted == {"bytes": size, "float32": 4 * size, "mixed": 2 * size}


def test_ddp_broadcasts_the_buffers_once_a_step_and_a_fake_world_does_not():
    """Accelerate's DDP broadcasts the rotary frequencies (64 bytes) once a step, whatever the accumulation; at_scale's
    fake world replicates by PyTorch's replicate, which sends no buffer: the theory says each."""
    from common.config import parse_config
    from experiments import at_scale, train_gpt
    from strategies.layout import Layout, Workload
    from strategies.theory import sent_bytes

    cfg = gpt_config_of(read_hf_config("llama_tiny"), 512, 32)
    model = build_model(cfg, 0)
    for micro_batches in (1, 2):
        work = Workload(cfg, 4, micro_batches, "no")
        launched = sent_bytes(model, Layout(dp_replicate=2), 0, parse_config(train_gpt.Config, []), work)[
            "by_kind"
        ]
        assert launched["broadcast"] == 64 and launched["all_reduce"] == 4 * 158_016
        fake = sent_bytes(model, Layout(dp_replicate=2), 0, at_scale.Config(), work)["by_kind"]
        assert "broadcast" not in fake and fake["all_reduce"] == 4 * 158_016
