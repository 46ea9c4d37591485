"""What one AdamW step of train_gpt's GPT costs on plain tensors (ddp) and on FSDP2's DTensor shards, per
implementation: PyTorch's CPU default (one parameter at a time), foreach (one op per group), fused (one kernel).

    torchrun --nproc_per_node 2 benchmarks/optimizer_step.py

Each rank runs one thread (as under accelerate launch); every step is a real forward and backward, only the
optimizer step is timed (median of 20 after 5 warm-up steps). Rank 0 prints the table: under fsdp the default
pays DTensor's dispatch on every one of a dozen ops per parameter, which is why GPT.configure_optimizers
asks for the fused kernel (tp, whose parameters mix DTensors and plain tensors, keeps the default).
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from common.device import backend_for, device_time, process_device
from common.gpt import PER_RANK_BATCH_SIZE, GPTConfig, build_gpt, lm_loss


def step_ms(model, optimizer, x, y) -> float:
    times, device = [], x.device
    for _ in range(25):
        lm_loss(model(x), y).backward()
        started = device_time(device)  # the device's time for the step (a GPU's kernels, not their launches)
        optimizer.step()
        times.append(device_time(device) - started)
        optimizer.zero_grad(set_to_none=True)
    return 1e3 * statistics.median(times[5:])


def main() -> int:
    torch.set_num_threads(1)
    device = process_device(int(os.environ.get("LOCAL_RANK", "0")))  # the rank's own GPU where there are GPUs
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=120))
    cfg = GPTConfig()
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = (
        torch.randint(0, cfg.vocab_size, (PER_RANK_BATCH_SIZE, cfg.block_size), generator=generator).to(
            device
        )
        for _ in "xy"
    )
    rows = []
    for layout in ("plain (ddp's)", "FSDP2 shards"):
        for name, options in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
            model = build_gpt(cfg, 0).to(device)
            if layout.startswith("FSDP2"):
                for block in model.blocks.values():
                    fully_shard(block)
                fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **options)
            rows.append((layout, name, step_ms(model, optimizer, x, y)))
    if dist.get_rank() == 0:
        print("| parameters | AdamW | step ms (median, rank 0) |\n|---|---|---|")
        for layout, name, ms in rows:
            print(f"| {layout} | {name} | {ms:.2f} |")
    gc.collect()  # the models (DDP, FSDP2) hold the group: gone before it is torn down
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
