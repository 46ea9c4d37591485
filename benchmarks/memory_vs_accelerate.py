"""Your model's training memory: `accelerate estimate-memory`'s count beside at_scale's, for the same transformers
configs (Llama 3 8B and 70B, Mixtral 8x7B shapes), saying what each counts.

accelerate estimate-memory builds the model empty and counts its parameters' and buffers' bytes; "training using Adam" at batch
1 is those bytes x 4 in float32 (the weights, their gradients, Adam's two moments: 16 bytes a parameter), x 2 under
mixed precision; no activations, for any sequence. Its command reads the config from the Hugging Face Hub; its own
functions (accelerate.commands.estimate: calculate_maximum_sizes, estimate_training_usage) are called here on the
same model built empty from a config on disk, so the count is the command's, offline.

at_scale (experiments/at_scale.py --hf_config) runs one rank of the training step on fake tensors, float32, one
sequence of --seq tokens: what it holds (the weights, gradients, AdamW's moments and step counts) is measured and
checked against the theory to the byte, and its peak adds the activations the step keeps for backward, measured.
A transformers mixture of experts does not run on fake tensors (its routing needs values): its states are the
theory's (strategies/theory.held_bytes on the model built empty, the same count at_scale checks), its peak not run.

    python -m benchmarks.memory_vs_accelerate                 # the three configs, 4,096 tokens: minutes
    python -m benchmarks.memory_vs_accelerate --quick         # llama3_8b only, 512 tokens

Writes <output_dir>/<UTC time>/memory_vs_accelerate.md and .json, and each at_scale run's folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.at_scale_published import run
from benchmarks.workers import benchmark_parser, dated_folder, write_table

GIB = 2**30
# the shapes as published, each its family's config class (the config.json each model ships has the same fields)
CONFIGS = {
    "llama3_8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128_256,
                                      rope_theta=500_000.0), "Llama 3 paper, Table 3"),
    "llama3_70b": ("LlamaConfig", dict(hidden_size=8192, intermediate_size=28_672, num_hidden_layers=80,
                                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128_256,
                                       rope_theta=500_000.0), "Llama 3 paper, Table 3"),
    "mixtral_8x7b": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
                                           num_attention_heads=32, num_key_value_heads=8, vocab_size=32_000,
                                           num_local_experts=8, num_experts_per_tok=2),
                     "Mixtral of Experts (Jiang et al. 2024), Table 1"),
}  # fmt: skip


def accelerate_count(config_dir: Path) -> dict:
    """What `accelerate estimate-memory` says of this config: its parameters' bytes, and Adam's training peak at
    batch 1 in float32 and in mixed precision (its own functions, on the model built empty as it builds it)."""
    import transformers
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    config = transformers.AutoConfig.from_pretrained(config_dir, local_files_only=True)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    total, _ = calculate_maximum_sizes(model)
    return {"bytes": total, "float32": max(estimate_training_usage(total, "float32").values()),
            "mixed": max(estimate_training_usage(total, "float16").values())}  # fmt: skip


def ours(folder: Path, name: str, seq: int) -> tuple[int, dict, int | None]:
    """(parameters, what one rank holds, its peak) training the config in `folder`/configs/`name` on one GPU, one
    sequence of `seq` tokens, float32: at_scale's measurement, or the theory's where at_scale does not run."""
    from common.gpt import count_parameters
    from common.hf_model import experts_of, gpt_config_of, read_hf_config
    from experiments.at_scale import Config
    from planning.fake_ranks import meta_gpt
    from strategies.layout import Layout, Workload
    from strategies.theory import held_bytes

    config = folder / "configs" / name
    cfg = gpt_config_of(read_hf_config(str(config)), read_hf_config(str(config)).vocab_size, seq)
    if experts_of(cfg):
        model, args = meta_gpt(cfg), Config(hf_config=str(config), mixed_precision="no")
        return count_parameters(model), held_bytes(model, Layout(), 0, args, Workload(cfg, 1, 1, "no")), None
    one_sequence = ["--world_size", "1", "--per_rank_batch_size", "1", "--block_size", str(seq)]
    metrics = run(folder, name, ["--hf_config", str(config), "--mixed_precision", "no", *one_sequence])[
        "metrics"
    ]
    (rank,), (memory,) = metrics["ranks"], metrics["memory"]
    return metrics["parameters"], rank["held"], memory["peak_bytes"]


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--seq", type=int, default=4096, help="tokens of the one sequence at_scale's rank trains"
    )
    parser.add_argument(
        "--output_dir", default="runs/memory_vs_accelerate", help="a new dated folder is made in it"
    )
    args = parser.parse_args(argv)
    seq = 512 if args.quick else args.seq
    folder = dated_folder(args.output_dir, "memory_vs_accelerate")
    if folder is None:
        return 2
    import transformers

    rows, payload = [], {}
    for name in ["llama3_8b"] if args.quick else CONFIGS:
        class_name, fields, source = CONFIGS[name]
        getattr(transformers, class_name)(**fields).save_pretrained(folder / "configs" / name)
        theirs = accelerate_count(folder / "configs" / name)
        parameters, held, peak = ours(folder, name, seq)
        states = held["params"] + held["grads"] + held["optimizer"]
        payload[name] = {"accelerate": theirs, "parameters": parameters, "held": held, "peak_bytes": peak,
                         "source": source}  # fmt: skip
        measured = "measured" if peak else "by theory"
        rows.append(f"| {name} ({source}) | {parameters / 1e9:.2f} B | {theirs['bytes'] / GIB:,.1f} | "
                    f"{theirs['float32'] / GIB:,.1f} | {theirs['mixed'] / GIB:,.1f} | {states / GIB:,.1f} ({measured}) | "
                    f"{f'{peak / GIB:,.1f}' if peak else 'not run (its routing needs values)'} |")  # fmt: skip
    command = "python -m benchmarks.memory_vs_accelerate" + (" --quick" if args.quick else f" --seq {seq}")
    table = "\n".join([
        f"`{command}` (GiB; one GPU, batch 1; ours: one sequence of {seq:,} tokens, float32)", "",
        "| config | parameters | accelerate: the model | accelerate: training with Adam, float32 | accelerate: "
        "mixed precision | ours: weights + gradients + AdamW | ours: the step's peak, with activations |",
        "|---|---|---|---|---|---|---|", *rows])  # fmt: skip
    write_table(folder, "memory_vs_accelerate", table, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
