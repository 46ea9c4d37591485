"""Parallelism strategies for the GPT: one module each, a small registry.

Each module is one strategy, whole: how it is applied to the model, what each rank holds and sends
by theory (closed forms the checks compare with what the ranks really hold and send, to the byte),
its wrong variants and its refusals. Every module has:

    NAME, SUMMARY        its flag value and one line of what it does
    RANKS                the ranks benchmarks/compare_strategies.py launches it on (LAUNCH_CONFIG: the
                         accelerate config it needs, if not accelerate_configs/cpu_ddp.yaml)
    AUTOCAST             True: bf16 through Accelerate's autocast; False: the strategy's own (FSDP2's
                         MixedPrecisionPolicy) or none
    CHECKPOINT_FORMAT    "dcp" (any strategy resumes it) or the strategy's own (only it resumes it)
    STEADY_STEP          the first step free of one-time work: the one communication_volume counts
    WRONG_VARIANTS       the mistakes (--wrong_variant) that are mistakes under this strategy
    layout(world_size, dp_size, tp_size) -> Layout    how it arranges the ranks (strategies/layout.py)
    refuse(cfg, layout)  one line (UsageError) for what it cannot do, before anything starts
    apply(model, layout, accelerator, cfg) -> (model, optimizer)
    forward(model, x, y) -> loss   one micro-batch's forward (pp: the pipeline's whole step)
    backward(model, loss, accelerator)     its backward (pp: the gradient all-reduces after the step)
    clip(model, cfg) -> float      the step's global gradient norm, clipped to --grad_clip
    checkpointer(model, optimizer, accelerator, cfg)    save / load / full_state / digest
    held_bytes(model, layout, rank, cfg) -> {"params", "grads", "optimizer",
                                             "params_between_forward_and_backward"}   (the theory)
    sent_bytes(model, layout, cfg) -> {"by_kind", "data_parallel", "tensor_parallel", "wire_bytes"}
    measure_held(model, optimizer) -> {"params", "grads", "optimizer"}; measure_window(model) -> bytes
                                   what a rank really holds, at rest and between forward and backward
    quiet()              a context that silences what the strategy says that is expected
    report(session, model, cfg)    what it measures beyond the common checks, at the end (pp: the bubble)
(strategies/defaults.py holds the parts most strategies share: forward, backward, clip, checkpointer,
measure_*, quiet, report.)

`cfg` is train_gpt's Config (the flags: per_rank_batch_size, block_size, mixed_precision, ...); `model`
in the theory is the undistributed GPT (common/gpt.py), so the closed forms run without any process
group (tests/test_strategies.py). Adding a strategy = one module here + its tests + a README row.
"""

from __future__ import annotations

from strategies import cp, ddp, deepspeed, fsdp, fsdp_tp, none, pp, tp, zero2

STRATEGIES = {
    module.NAME: module
    for module in (
        none,
        ddp,
        zero2,
        fsdp,
        tp,
        fsdp_tp,
        pp,
        cp,
        deepspeed.ZERO1,
        deepspeed.ZERO2,
        deepspeed.ZERO3,
    )
}

# The mistakes every strategy can make (the ones a single strategy can make live in its module), and the
# check that must catch each (README "Each check with the mistake it exists for").
COMMON_WRONG_VARIANTS = {
    "same_data_on_every_rank": "the forgotten sampler: every data-parallel rank reads rank 0's share",
    "local_grad_norm": "clipping by each rank's own shard's norm, not the global one",
    "seed_per_rank": "every rank builds its own random weights",
    "resume_without_optimizer_state": "a resume that loads the parameters but not AdamW's moments",
    "resume_without_data_position": "a resume that restarts the data stream at its first sample",
}
WRONG_VARIANTS = {
    **COMMON_WRONG_VARIANTS,
    **fsdp.OWN_WRONG_VARIANTS,
    **tp.OWN_WRONG_VARIANTS,
    **pp.OWN_WRONG_VARIANTS,
    **cp.OWN_WRONG_VARIANTS,
    **deepspeed.OWN_WRONG_VARIANTS,
}


def strategies_with(variant: str) -> tuple[str, ...]:
    """The strategies under which `variant` is a mistake."""
    return tuple(name for name, module in STRATEGIES.items() if variant in module.WRONG_VARIANTS)
