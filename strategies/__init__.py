"""Parallelism for the GPT as degrees that compose (torchtitan's shape, with our proofs).

A job's shape is six degrees (strategies/layout.py): --pp --dp_replicate --dp_shard --ep --cp --tp, any
combination (ep with a mixture of experts), their product the ranks launched. Each dimension is one module
that teaches it whole (its flags, how it is applied, what each rank holds and sends by theory, its mistakes
and refusals, its run-time hooks) behind one interface (piece.py: a core every piece implements, capabilities a
piece declares), and knows nothing of the others:
    replicate.py   dp_replicate: replicas, gradients all-reduced (Accelerate's DDP, or PyTorch's replicate)
    shard.py       dp_shard: FSDP2, ZeRO-3 or ZeRO-2 (--reshard_after_forward), HSDP with replicas
    tp.py          tp: Megatron tensor parallelism over DTensor (and --sequence_parallel)
    cp.py          cp: each sequence split over ranks, attention over all-gathered keys and values
    pp.py          pp: stages of blocks, torch.distributed.pipelining's schedules (pp_schedules.py: the schedules
                   as one model and their timeline, shared with the predictor and the fake ranks)
    ep.py          ep: a mixture of experts' experts split over ranks, tokens sent to them by all-to-all
    activation_checkpointing.py, compile.py   features that apply to any layout
    ft.py          fault tolerance (--fault_tolerant): torchft across replica groups, each one launch of a layout
registry.py lists them in the order they are applied (and DeepSpeed's engine, deepspeed.py, which replaces them
under a DeepSpeed accelerate config); everything shared loops over it:
    args.py         the flags (every piece's, folded), the presets, the mistakes, the refusals
    parallelize.py  the pieces applied in order -> job.py, a rank's part at run time: train_step owns a step (its
                    micro-batches, the clipping, the optimizer, whether it counts)
    theory.py       what every rank holds and sends, composed from the pieces' closed forms
    checks.py       every layout held to that theory and to one process

`--strategy NAME` is a preset: it only fills in the degrees the flags leave unset (args.PRESETS), so that
`--strategy fsdp` on 2 ranks is `--dp_shard 2`, and `--strategy pp --dp_replicate 2` on 4 ranks is two
pipelines of two stages.

A new piece is one module with one `Piece` subclass, one line in registry.py, its tests and a row in
docs/train_gpt.md's layouts table (tests/test_one_module.py shows a toy one plugged in from a test file alone).
"""
