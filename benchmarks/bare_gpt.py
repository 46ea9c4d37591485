"""train_gpt's training step written with torch.distributed only: no Accelerate, no common/ training loop,
no checks. The yardstick for benchmarks/performance.py's overhead figure: the same model, data,
AdamW groups, learning-rate schedule, global-norm clipping and steps as `train_gpt.py --strategy ddp|fsdp`,
and the same throughput figure (training tokens / seconds in the training loop).

    torchrun --nproc_per_node 2 benchmarks/bare_gpt.py --strategy ddp --max_steps 100 --output out.json
    (--vocab_size, --block_size, --n_layer, --n_head, --d_model: another model, as train_gpt takes them)

Torch's own pieces only: DistributedDataParallel, or fully_shard on each block then the root (ZeRO-3);
torch.nn.utils.clip_grad_norm_ (which takes the global norm of FSDP2's DTensor gradients).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from common.device import backend_for, device_time, process_device
from common.gpt import (
    PER_RANK_BATCH_SIZE,
    GPTConfig,
    adamw,
    build_gpt,
    lm_loss,
)  # the model, corpus, AdamW groups and
from common.optim import cosine_lr  # schedule are the experiment's
from common.text import load_corpus

# train_gpt's default optimizer, schedule and clipping (experiments/train_gpt.py Config)
LR, MIN_LR_RATIO, WARMUP, WEIGHT_DECAY, CLIP, SEED = 3e-3, 0.1, 20, 0.1, 1.0, 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--strategy", choices=("ddp", "fsdp"), required=True, help="torch's DDP or fully_shard"
    )
    parser.add_argument("--max_steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--output", required=True, help="JSON file for the figures (rank 0 writes it)")
    defaults = GPTConfig()
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):  # train_gpt's model flags
        parser.add_argument(
            f"--{name}", type=int, default=getattr(defaults, name), help=f"as train_gpt's --{name}"
        )
    args = parser.parse_args()
    if args.max_steps < 1:
        parser.error(f"--max_steps must be >= 1, got {args.max_steps}")
    # the rank's own GPU where there are GPUs (as train_gpt runs there), else the CPU
    device = process_device(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus("", args.vocab_size, args.block_size, 0.1)
    x_all, y_all = corpus["train"]
    config = GPTConfig(corpus["vocab_size"], args.block_size, args.n_layer, args.n_head, args.d_model)
    model = build_gpt(config, SEED).to(device)
    if args.strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type != "cpu" else None
        )
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks.values():
            fully_shard(block)
        fully_shard(model)
    optimizer = adamw(model.parameters(), LR, WEIGHT_DECAY)
    global_batch = PER_RANK_BATCH_SIZE * world
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(SEED * 100_003))
    x_all, y_all = x_all.to(device), y_all.to(device)
    dist.barrier()
    started = device_time(device)
    for step in range(1, args.max_steps + 1):
        first = ((step - 1) * global_batch) % (len(order) - global_batch)
        rows = order[first + rank * PER_RANK_BATCH_SIZE : first + (rank + 1) * PER_RANK_BATCH_SIZE].to(device)
        loss = lm_loss(model(x_all[rows]), y_all[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, LR, WARMUP, args.max_steps, MIN_LR_RATIO)
        optimizer.step()
        optimizer.zero_grad()
    loss_value = loss.item()
    elapsed = device_time(device) - started
    tokens = args.max_steps * global_batch * args.block_size
    if rank == 0:
        with open(args.output, "w") as handle:
            json.dump({"strategy": args.strategy, "steps": args.max_steps, "tokens_per_s": tokens / elapsed,
                       "last_loss": loss_value}, handle)  # fmt: skip
    # the DDP model holds the process group: released and collected first, or gloo's threads can still be alive
    # when the group is torn down (`terminate called without an active exception`, seen once in this benchmark)
    del model, optimizer, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
