"""The GPU rehearsal on the CPU (common/rehearsal.py)."""

from __future__ import annotations

import pytest

from experiments import train_gpt
from helpers import GPT_TINY, assert_gpt_passed, fork_launch

REHEARSAL = {"DIST_REHEARSAL": "1"}
# 4 blocks (a 2-stage pipeline has blocks on both stages), 4 steps, parity over 2
REHEARSAL_TINY = [*GPT_TINY, "--n_layer", "4", "--max_steps", "4", "--parity_steps", "2", "--log_every", "2",
                  "--min_loss_drop", "0"]  # fmt: skip


@pytest.mark.launch
@pytest.mark.parametrize("ranks,degrees", [
    (1, ""), (2, "--dp_replicate 2"), (2, "--dp_shard 2"), (2, "--dp_shard 2 --reshard_after_forward never"),
    (2, "--tp 2 --sequence_parallel"), (2, "--pp 2"), (2, "--ep 2 --n_experts 4 --top_k 2"),
    (2, "--dp_replicate 2 --n_experts 2 --mixed_precision bf16 --parity_steps_bf16 2"), (4, "--dp_shard 2 --tp 2"),
])  # fmt: skip
def test_rehearsal_passes_train_gpt_layouts(tmp_path, ranks, degrees):
    finished = fork_launch(train_gpt.main, [*REHEARSAL_TINY, *degrees.split()], tmp_path / "run",
                           num_processes=ranks, env=REHEARSAL)  # fmt: skip
    assert_gpt_passed(finished, ranks)
