"""A new piece of parallelism is one module: a toy one, defined in this file alone, registered, and picked up by
the flags, the refusals, the theory check and the mistakes with no other file edited (issue #43).

The toy is static loss scaling (fp16 training's, in its simplest form): backward starts from the loss times
--loss_scale, and once a step, after backward, the gradients are divided by it again and every rank learns, in one
all-reduce of a 4-byte flag, whether any rank's gradients overflowed. Its one closed form: that all-reduce, 4
bytes per step over every rank. Its one mistake: the gradients never divided back. It refuses a scale <= 0, and
a pipeline (whose schedule computes the loss, so backward cannot start from a scaled one here).

Run as a script (what the test launches), it registers the toy and runs experiments/train_gpt.py's main.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # launched as a script: the repository on the path, as the tests have it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest
import torch
import torch.distributed as dist

from common.config import flag, require
from strategies.layout import Mistake, Traffic
from strategies.piece import HooksTheStep, Piece, Plan, Theory


@dataclass
class LossScaleFlags:
    loss_scale: float = flag(1.0, "static loss scaling: backward starts from the loss times this (1: off)")


class LossScale(Piece, HooksTheStep):
    """Static loss scaling: the loss multiplied before backward, the gradients divided after it."""

    name = "loss_scale"
    Flags = LossScaleFlags
    MISTAKES = {
        "loss_scale_never_undone": Mistake(
            "the gradients of a scaled loss used as they are, never divided by the scale",
            lambda plan: plan.engine_stage is None and plan.args.loss_scale != 1,
        )
    }

    def is_on(self, plan: Plan) -> bool:
        return plan.args.loss_scale != 1

    def refuse(self, plan: Plan) -> None:
        scale = plan.args.loss_scale
        require(scale > 0, f"--loss_scale {scale:g}: must be > 0 (1: off)")
        require(scale == 1 or "pipeline" not in plan.traits,
                f"--loss_scale {scale:g} with a pipeline: not built (its schedule computes the loss)")  # fmt: skip

    def sent(self, t: Theory) -> list[Traffic]:
        world = t.layout.world_size
        return [Traffic("all_reduce", 4, world, self.name)] if world > 1 else []

    def loss_for_backward(self, job, loss: torch.Tensor) -> torch.Tensor:
        return loss * job.args.loss_scale

    def after_backward(self, job) -> None:
        if not job.accelerator.sync_gradients:  # the step's gradients are whole on its last micro-batch
            return
        grads = [p.grad for p in job.model.parameters() if p.grad is not None]
        if job.args.wrong_variant != "loss_scale_never_undone":
            for grad in grads:
                grad.div_(job.args.loss_scale)
        # each rank looks at its own pieces (a DTensor's local one); the all-reduce tells every rank of any
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        overflowed = torch.tensor([float(not all(torch.isfinite(g).all() for g in local))])
        if job.layout.world_size > 1:
            dist.all_reduce(overflowed)
        require(overflowed.item() == 0, f"--loss_scale {job.args.loss_scale:g}: the gradients overflowed")


if __name__ == "__main__":
    from strategies import registry

    registry.register(LossScale())
    from experiments import train_gpt

    sys.exit(train_gpt.main())


from tests.helpers import GPT_TINY, REPO, clean_env, free_port, run_process_tree  # noqa: E402

TOY = str(Path(__file__).resolve())


@pytest.mark.launch
def test_a_toy_piece_is_one_module_the_flags_refusals_theory_and_mistakes_pick_up(tmp_path):
    env = clean_env(HOME=str(tmp_path))
    # the flag is the CLI's, and its refusal is one line, exit 2, before anything is written
    refused = run_process_tree([sys.executable, TOY, "--output_dir", str(tmp_path / "no"), "--loss_scale", "0"],
                               120, env=env, cwd=REPO)  # fmt: skip
    said = refused.stderr.strip()
    assert refused.returncode == 2 and "--loss_scale 0: must be > 0 (1: off)" in said and "\n" not in said, (
        said
    )
    assert not (tmp_path / "no").exists()
    # on two ranks, with its mistake: its bytes are counted and equal its closed form (every rank's), and the
    # mistake fails the gradient-norm check it exists for
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), TOY, "--output_dir", str(run), *GPT_TINY, "--loss_scale", "1024",
               "--wrong_variant", "loss_scale_never_undone", "--parity_steps", "1"]  # fmt: skip
    done = run_process_tree(command, 240, env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    summary = json.loads((run / "summary.json").read_text())
    checks = summary["checks"]
    assert done.returncode == 1 and not summary["passed"], done.stderr[-3000:]
    assert checks["communication_volume"]["passed"] and checks["memory_per_rank"]["passed"]
    theory = summary["metrics"]["communication"]["theory_per_rank"]
    assert all(rank["by_dimension"]["loss_scale"] == {"all_reduce": 4} for rank in theory)
    assert not checks["grad_norm_is_global"]["passed"]
    # the norm clipping saw is the scale times the one-process norm, at the first step (both from the same
    # weights; after it the scaled norms clip differently and AdamW's moments part: 1025.15 at a later step)
    assert summary["metrics"]["grad_norm_max_rel_diff"] == pytest.approx(1023, rel=1e-3)
