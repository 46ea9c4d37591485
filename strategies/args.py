"""The parallelism flags of an experiment, composed from the registered pieces' (strategies/registry.py), the
presets that fill in their degrees, and the deliberate mistakes a check must catch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from common.config import flag, require
from common.runtime import deepspeed_stage
from strategies import registry
from strategies.layout import DIMS, Layout, Mistake, Workload
from strategies.piece import Plan

REST = -1  # a preset's degree that takes the ranks the other degrees leave


@dataclass(frozen=True)
class Preset:
    summary: str
    degrees: dict  # {dimension: degree, or REST}
    ranks: int  # the ranks benchmarks/compare_strategies.py launches it on
    reshard_after_forward: str = "default"
    launch_config: str = ""  # the accelerate config it needs (default: accelerate_configs/cpu_ddp.yaml)


PRESETS = {
    "none": Preset("one process: the reference", {}, 1),
    "ddp": Preset("every rank holds everything; gradients all-reduced (averaged) once per step", {"dp_replicate": REST}, 2),
    "zero2": Preset("ZeRO-2 (FSDP2, no reshard after forward): gradients and optimizer state 1/N; parameters "
                    "gathered once", {"dp_shard": REST}, 2, reshard_after_forward="never"),
    "fsdp": Preset("ZeRO-3 (FSDP2): parameters, gradients, optimizer state 1/N per rank; blocks gathered per use",
                   {"dp_shard": REST}, 2),
    "tp": Preset("tensor parallelism (Megatron-style, DTensor): 1/N of every matrix and of the vocabulary per rank",
                 {"tp": REST}, 2),
    "fsdp_tp": Preset("2-D: TP inside each group of 2, FSDP2 (ZeRO-3) across groups", {"tp": 2, "dp_shard": REST}, 4),
    "pp": Preset("pipeline: stages of blocks on ranks, micro-batches through them (every schedule)", {"pp": REST}, 2),
    "cp": Preset("context parallelism: each sample's sequence split over the ranks, K/V all-gathered per block",
                 {"cp": REST}, 2),
    **{
        f"deepspeed_zero{stage}": Preset(summary, {"dp_shard": REST}, 2,
                                         launch_config=f"accelerate_configs/deepspeed_zero{stage}.yaml")
        for stage, summary in (
            (1, "DeepSpeed ZeRO-1: optimizer state (a float32 master copy + AdamW's moments) 1/N per rank"),
            (2, "DeepSpeed ZeRO-2: + gradients partitioned (all-reduced every micro-batch)"),
            (3, "DeepSpeed ZeRO-3: + parameters partitioned, those of <= 100k elements kept whole"),
        )
    },
}  # fmt: skip


def _sharded_gradients(layout: Layout) -> bool:
    return layout.dp_shard > 1 or layout.tp > 1 or layout.pp > 1


def _whole_world_ddp(layout: Layout) -> bool:
    """Every rank a replica under Accelerate's DDP, which broadcasts rank 0's weights: a seed per rank is undone."""
    return layout.world_size > 1 and layout.size(layout.replicate_dims) == layout.world_size


# The mistakes any layout can make, made by the training loop (experiments/train_gpt.py; the check each must fail:
# README "Each check with the mistake it exists for"), then each piece's and engine's own (its MISTAKES), each
# knowing the runs under which it is one: a mistake that changes nothing under a run (seed_per_rank under
# Accelerate's DDP) is refused there.
COMMON_MISTAKES = {
    "same_data_on_every_rank": Mistake("the forgotten sampler: every data-parallel rank reads rank 0's share",
                                       lambda plan: plan.engine_stage is not None or plan.layout.dp > 1),
    "local_grad_norm": Mistake("clipping by each rank's own piece's norm, not the global one",
                               lambda plan: plan.engine_stage is None and _sharded_gradients(plan.layout)),
    "seed_per_rank": Mistake("every rank builds its own random weights",
                             lambda plan: plan.engine_stage is None and plan.layout.world_size > 1
                             and not _whole_world_ddp(plan.layout)),
    "resume_without_optimizer_state": Mistake("a resume that loads the parameters but not AdamW's moments",
                                              lambda plan: True),
    "resume_without_data_position": Mistake("a resume that restarts the data stream at its first sample",
                                            lambda plan: True),
}  # fmt: skip
MISTAKES = {
    **COMMON_MISTAKES,
    **{name: m for piece in (*registry.PIECES, *registry.ENGINES) for name, m in piece.MISTAKES.items()},
}
WRONG_VARIANTS = {name: mistake.what for name, mistake in MISTAKES.items()}  # --wrong_variant's values
COMMON_WRONG_VARIANTS = {name: mistake.what for name, mistake in COMMON_MISTAKES.items()}


def is_a_mistake_under(variant: str, plan: Plan) -> bool:
    """Whether --wrong_variant `variant` changes what a run under `plan` computes (so that a check can fail)."""
    return MISTAKES[variant].applies(plan)


@dataclass
class ParallelArgs(*dict.fromkeys(piece.Flags for piece in reversed(registry.PIECES))):
    """The parallelism flags of an experiment: every registered piece's own (its Flags), the preset that fills
    them in, and the deliberate mistake a check must catch. `layout_flags`: what a resume may change (a
    checkpoint of one layout continues under any other): the preset and every piece's flags."""

    layout_flags: ClassVar[tuple[str, ...]] = (
        "strategy", "checkpoint_format",
        *(f.name for piece in registry.PIECES for f in dataclasses.fields(piece.Flags)),
    )  # fmt: skip

    strategy: str = flag("auto", "a preset that fills in the degrees left unset: " + ", ".join(PRESETS) + "; auto: "
                         "the degrees as given, or none for one process, ddp for several, the DeepSpeed stage of a "
                         "DeepSpeed accelerate config", choices=("auto", *PRESETS))  # fmt: skip
    wrong_variant: str = flag("", "a deliberate mistake that a check must catch: " + ", ".join(WRONG_VARIANTS),
                              choices=("", *WRONG_VARIANTS))  # fmt: skip

    def resolve_layout(self, world_size: int) -> Layout:
        """The degrees of this launch: the flags', a preset's filling in what they leave, the product checked
        against the ranks launched; written back into the flags (config.json records what ran)."""
        for dim in DIMS:
            require(getattr(self, dim) >= 0, f"--{dim} must be >= 0 (0, 1: off), got {getattr(self, dim)}")
        given = {dim: getattr(self, dim) for dim in DIMS if getattr(self, dim) > 1}
        stage = deepspeed_stage()
        name = self.strategy
        if name == "auto" and not given:  # nothing asked: the launch decides
            name = f"deepspeed_zero{stage}" if stage else ("none" if world_size == 1 else "ddp")
        require(not stage or name in ("auto", f"deepspeed_zero{stage}"),
                f"--strategy {self.strategy}: this launch's accelerate config is DeepSpeed ZeRO-{stage}, which runs "
                f"deepspeed_zero{stage}; pass --strategy auto or deepspeed_zero{stage}, or launch with another "
                "config")  # fmt: skip
        require(not name.startswith("deepspeed") or stage,
                f"--strategy {name} runs under a DeepSpeed accelerate config of its stage: launch with --config_file "
                f"{PRESETS[name].launch_config if name in PRESETS else ''} (this launch has no DeepSpeed config)")  # fmt: skip
        preset = PRESETS.get(name, Preset("the degrees as given", {}, 0))
        degrees = dict(given)
        for dim, degree in preset.degrees.items():
            if degree != REST:
                degrees.setdefault(dim, degree)
        rest = [dim for dim, degree in preset.degrees.items() if degree == REST and dim not in given]
        taken = Layout(**degrees).world_size
        if rest:
            require(world_size % taken == 0 and world_size // taken >= 2,
                    f"--strategy {name} on {world_size} rank(s): {_product(degrees) or 'nothing else'} leaves "
                    f"{world_size / taken:g} rank(s) for --{rest[0]}, which needs a whole number >= 2 "
                    "(accelerate_configs/cpu_ddp.yaml launches 2)")  # fmt: skip
            degrees[rest[0]] = world_size // taken
        layout = Layout(**degrees)
        require(layout.world_size == world_size,
                f"{_product(degrees) or 'one process'} = {layout.world_size} rank(s), but {world_size} were launched "
                "(the degrees' product must equal the ranks)")  # fmt: skip
        if preset.reshard_after_forward != "default":
            require(self.reshard_after_forward in ("default", preset.reshard_after_forward),
                    f"--strategy {name} is --reshard_after_forward {preset.reshard_after_forward}, got "
                    f"{self.reshard_after_forward}: pass one of them")  # fmt: skip
            self.reshard_after_forward = preset.reshard_after_forward
        for dim in DIMS:
            setattr(self, dim, getattr(layout, dim))
        self.strategy = name  # auto: what the launch decided, or auto (the degrees as given)
        return layout

    @property
    def checkpoint_format(self) -> str:
        """DeepSpeed's own (its stage's), or PyTorch's distributed checkpoint ("dcp": any layout reads it)."""
        stage = deepspeed_stage()
        return f"deepspeed ZeRO-{stage}" if stage else "dcp"

    def refuse_resume(self, meta: dict, world_size: int) -> None:
        """A checkpoint in DeepSpeed's own format resumes only under the same stage on as many ranks; a DCP
        checkpoint under any layout at any world size, but not under DeepSpeed."""
        saved = meta["layout"].get("checkpoint_format", "dcp")
        require(saved == self.checkpoint_format and (saved == "dcp" or meta["world_size"] == world_size),
                f"the checkpoint is in {saved} format on {meta['world_size']} rank(s), this run writes "
                f"{self.checkpoint_format} on {world_size}: DeepSpeed's checkpoints are its own format, resumed only "
                "by the same stage on as many ranks; PyTorch's (dcp) by any layout without DeepSpeed")  # fmt: skip

    def plan(self, layout: Layout, work: Workload) -> Plan:
        """What this run asks, for the pieces: these flags, the layout, the workload, the engine if any."""
        return Plan(self, layout, work, deepspeed_stage(), registry.PIECES)

    def refuse_layout(self, layout: Layout, work: Workload, max_norm: float) -> None:
        """Every piece's (and the engine's) refusals of this layout and workload, in one line each, before
        anything starts; then a deliberate mistake that would change nothing here."""
        plan = self.plan(layout, work)
        for engine in registry.ENGINES:
            if engine.is_on(plan):
                engine.refuse(plan, max_norm)
        if work.model.hf:  # a transformers model: only the pieces that know any model made of blocks
            asked = [p for p in plan.pieces if p.is_on(plan) or (p.dim and getattr(layout, p.dim) > 1)]
            unfit = [f"--{p.name}" for p in asked if not p.any_model]
            unfit += (
                [f"DeepSpeed ZeRO-{plan.engine_stage} (the accelerate config)"] if plan.engine_stage else []
            )
            built = [p.name for p in plan.pieces if p.any_model]
            require(not unfit, f"{unfit[0] if unfit else ''} with --hf_config: not built for a transformers model "
                    f"yet (it knows the project's GPT by its modules' names); built: {', '.join(built)}")  # fmt: skip
        for piece in plan.pieces:
            piece.refuse(plan)
        variant = self.wrong_variant
        require(not variant or is_a_mistake_under(variant, plan),
                f"--wrong_variant {variant} changes nothing under {layout.describe()}"
                + (f" with DeepSpeed ZeRO-{plan.engine_stage}" if plan.engine_stage else "") + ": "
                + WRONG_VARIANTS.get(variant, ""))  # fmt: skip


def _product(degrees: dict) -> str:
    return " x ".join(f"--{dim} {n}" for dim, n in sorted(degrees.items(), key=lambda kv: DIMS.index(kv[0])))
