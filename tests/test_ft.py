"""strategies/ft.py, fault tolerance as a piece of train_gpt, before anything starts: what it cannot do is refused in
one line naming the flag, and the Job's exact accumulation is what its reference computes. (A whole fault-tolerant
run, groups killed and healed: tests/test_fault_tolerance.py.)"""

from __future__ import annotations

import contextlib

import pytest
import torch

from common.gpt import GPTConfig, build_gpt, lm_loss
from common.optim import clip_by_global_norm
from common.reference import exact_accumulation
from experiments.train_gpt import main
from helpers import GPT_TINY, run_main_in_process

FT = ["--fault_tolerant", "--lighthouse", "127.0.0.1:1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fault_tolerant"], "--fault_tolerant needs torchft's lighthouse: pass --lighthouse HOST:PORT"),
        ([*FT, "--replica_groups", "2", "--replica_id", "2"], "--replica_id 2: must be in [0, 1]"),
        ([*FT, "--dp_replicate", "2", "--expected_world_size", "2"], "torchft owns the replicated dimension"),
        (
            [*FT, "--cp", "2", "--expected_world_size", "2"],
            "--fault_tolerant with collectives_in_attention inside a group",
        ),
        ([*FT, "--n_experts", "4"], "--fault_tolerant with routes_tokens inside a group: not built"),
        (
            [*FT, "--pp", "2", "--expected_world_size", "2"],
            "--fault_tolerant with pp inside a group: not built",
        ),
        ([*FT, "--ft_timeout_s", "0"], "--ft_timeout_s must be in (0, 604800]"),
        (["--replica_groups", "2"], "--replica_groups is for a fault-tolerant run: add --fault_tolerant"),
        (["--ft_replacement"], "--ft_replacement is for a fault-tolerant run: add --fault_tolerant"),
        ([*FT, "--wrong_variant", "replacement_hangs"], "--wrong_variant replacement_hangs changes nothing"),
    ],
)
def test_what_fault_tolerance_cannot_do_is_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setenv("WORLD_SIZE", "2") if "--expected_world_size" in args else None
    code, stderr = run_main_in_process(
        main, [*GPT_TINY, "--output_dir", str(tmp_path / "run"), *args], capsys
    )
    assert code == 2 and message in stderr and stderr.strip().count("\n") == 0, stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_exact_accumulation_is_the_same_whatever_the_split_and_clips_by_the_same_scale():
    """The reference's exact mode (what a fault-tolerant run is compared with) against its definition: each
    share's gradient on its own, float64 sums, a unit rounded once; and the float64 norm of the pieces of a
    gradient is the whole one's, so the clipping scale is the same to the bit."""
    model = build_gpt(GPTConfig(64, 16, 1, 2, 32), 0)
    generator = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 64, (4, 16), generator=generator) for _ in range(2)) for _ in range(3)]
    exact_accumulation(
        model, batches, 2, lambda m, x, y: lm_loss(m(x), y), torch.device("cpu"), contextlib.nullcontext
    )
    combined = [p.grad.clone() for p in model.parameters()]
    total = None
    for x, y in batches:  # by hand: two shares a unit, their float64 sum rounded, the units added in float64
        unit = 0
        for rows in (slice(0, 2), slice(2, 4)):
            model.zero_grad(set_to_none=True)
            (lm_loss(model(x[rows]), y[rows]) / 6).backward()
            unit = unit + torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        total = unit.float().double() if total is None else total + unit.float().double()
    assert torch.equal(torch.cat([g.reshape(-1) for g in combined]), total.float())
    halves = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    whole = torch.nn.Parameter(torch.zeros(4))
    whole.grad = torch.tensor([3.0, 1e-4, 7.5, 2.25])
    halves[0].grad, halves[1].grad = whole.grad[:2].clone(), whole.grad[2:].clone()
    norm = clip_by_global_norm([whole], 1.0, exact=True)
    assert norm.dtype == torch.float64 and torch.equal(norm, clip_by_global_norm(halves, 1.0, exact=True))
    assert torch.equal(whole.grad, torch.cat([h.grad for h in halves]))


def test_the_loop_redoes_a_step_that_did_not_count_and_follows_a_group_that_healed(tmp_path):
    """common/training.TrainLoop under a trainer that gates its steps: a step that did not commit moves neither the
    step nor the samples seen and is read again from the same position; a quorum that could not form is asked
    again; a group healed to its peer's step reads that step's batch."""
    from dataclasses import dataclass

    from common.checkpoint import ResumableArgs
    from common.config import flag
    from common.run import start_run
    from common.training import TrainLoop

    @dataclass
    class Args(ResumableArgs):
        max_steps: int = flag(6, "steps")
        log_every: int = flag(100, "log interval")

    # step 0 tried twice (redone), a quorum that could not form, a heal from step 1 to step 4
    asked = iter([(0, 0), None, (0, 0), (1, 1), (4, 4), (5, 5)])
    commits = iter([False, True, True, True, True])
    positions = []

    def batch_at(position: int) -> list:
        positions.append(position)
        return [position]

    with start_run(Args(output_dir=str(tmp_path / "run"), report_to="none"), "loop_test") as session:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loop = TrainLoop(session, model, optimizer, samples_per_micro_batch=4)
        for _ in loop.steps(batch_at, 3, lambda step: next(asked)):
            loop.record_step([torch.tensor(1.0)], next(commits))
        assert positions == [
            0,
            0,
            12,
            48,
            60,
        ]  # 3 micro-batches of 4 samples a step; step 4's batch after the heal
        assert (loop.step, loop.samples_seen, loop.steps_redone) == (6, 72, 1)
