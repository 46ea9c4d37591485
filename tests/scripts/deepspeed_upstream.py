"""Run by tests/test_deepspeed.py on 2 ranks under accelerate_configs/deepspeed_zero2.yaml's environment (forked
ranks; `accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml tests/scripts/deepspeed_upstream.py`
runs the same): records, as JSON on stdout (rank 0), three behaviours of Accelerate 1.16 + DeepSpeed 0.19.8 on CPU
that common/runtime.py and strategies/deepspeed.py work around, so that a test fails when they change upstream."""

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from common.gpt import GPTConfig, build_gpt, lm_loss
from common.runtime import deepspeed_on_cpu
from strategies.deepspeed import unmapped_parameters


def main(argv: list[str] | None = None) -> int:
    with deepspeed_on_cpu():
        plain = Accelerator()  # what a user writes: Accelerate's backend stays None on CPU
    seen_by_plain = plain.num_processes
    AcceleratorState._reset_state(True)

    threads_at_start = torch.get_num_threads()
    with deepspeed_on_cpu():
        from accelerate.utils import InitProcessGroupKwargs

        accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    # MULTI_CPU would have set cores / ranks
    threads_left_at_start = torch.get_num_threads() == threads_at_start
    model = build_gpt(GPTConfig(512, 32, 2, 2, 32), 0)
    optimizer = model.configure_optimizers(1e-3, 0.1)  # two parameter groups
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config.update(train_micro_batch_size_per_gpu=2, zero_allow_untested_optimizer=True, gradient_clipping=1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randint(0, 512, (2, 32))
    loss = lm_loss(model(x), x)
    accelerator.backward(loss)
    if accelerator.is_main_process:
        print(json.dumps({"num_processes_plain_accelerator": seen_by_plain, "num_processes_with_gloo": accelerator.num_processes,
                          "threads_left_as_torch_set_them": threads_left_at_start,
                          "unmapped_after_first_step": unmapped_parameters(model.optimizer)}))  # fmt: skip
    # gloo's threads alive at interpreter exit abort the process ("terminate called without an active exception": it
    # failed this test once, 2026-12-05): the engine dropped and collected before end_training closes the group, as
    # common/run.py closes a run
    accelerator.wait_for_everyone()
    del model, optimizer
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
