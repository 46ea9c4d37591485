"""Fake ranks: one rank of an N-rank job at a time, on PyTorch's fake process group (every collective returns at
once and moves nothing) and fake tensors (shapes and dtypes, no memory), running the real `parallelize` and one
whole optimizer step, train_gpt's own (`Job.train_step`), measured as train_gpt measures a real rank
(experiments/at_scale.py is the experiment).

Per rank: the GPT built on the meta device and parallelized there (the meshes hold real rank numbers), its
parameters made fake (to_empty under FakeTensorMode); the step's micro-batches as the Job runs them, a pipeline's
in the order of the one schedule model (strategies/pp_schedules.order, run by the pipeline itself: torch's schedule
cannot run on fake tensors, its warm-up vote reads a value), FSDP told which backward is the step's last; AdamW's
step. Measured (`Measured`, the Job's instruments): bytes held at the step's end and while the micro-batches run,
the bytes each forward keeps for backward and the most in flight, FSDP's unsharded gradient sums under a pipeline,
every collective. Each rank runs in a worker process of its own (DTensor's sharding cache handed a rank the
previous rank's groups when they shared a process: measured).
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore
from tqdm import tqdm

from common.activations import SavedActivations
from common.comm_counter import CollectiveCounter
from common.config import UsageError
from common.gpt import GPTConfig, adamw
from common.hf_model import build_model
from common.moe import moe_layers
from common.processes import take_environment
from planning.memory import activation_bytes, memory_estimate
from planning.ops import OpRecorder
from strategies.job import Instruments, local_bytes
from strategies.layout import DIMS, Layout, Workload, chunk_rows, unique_tensors
from strategies.parallelize import parallelize, quiet
from strategies.theory import gathered_bytes, held_bytes, sent_bytes, theory_of


def ranks_that_differ(reference, layout: Layout, args, work: Workload) -> list[int]:
    """The first rank of each pipeline stage whose theory (what it holds and sends) differs from the stages'
    before it, and the world's last rank if its theory differs too (the last piece of every split: an uneven
    split leaves it less)."""
    seen, ranks = set(), []
    for rank in [*(layout.rank_at(pp=stage) for stage in range(layout.pp)), layout.world_size - 1]:
        theory = theory_key(reference, layout, args, work, rank)
        if theory not in seen:
            seen.add(theory)
            ranks.append(rank)
    return ranks


def theory_key(reference, layout: Layout, args, work: Workload, rank: int) -> tuple:
    """What a rank holds and sends, by theory: two ranks alike in it run the same step."""
    return (str(held_bytes(reference, layout, rank, args, work)),
            str(sent_bytes(reference, layout, rank, args, work)["by_kind"]))  # fmt: skip


def every_stage(reference, layout: Layout, args, work: Workload, results: list[dict]) -> list[dict]:
    """The results as predict_step's `traced` wants them, one a pipeline stage: a stage not run is one run with
    the same theory (ranks_that_differ ran one of each)."""
    by_theory = {theory_key(reference, layout, args, work, r["rank"]): r for r in results}
    first_ranks = [layout.rank_at(pp=stage) for stage in range(layout.pp)]
    keys = {rank: theory_key(reference, layout, args, work, rank) for rank in first_ranks}
    return [{**by_theory[keys[rank]], "rank": rank} for rank in first_ranks if keys[rank] in by_theory]


@contextlib.contextmanager
def playing(rank: int, world_size: int):
    """This process as rank `rank` of `world_size`: torch's fake process group (its collectives return at once
    and move nothing), for as long as the rank runs."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Measured(Instruments):
    """A fake rank's instruments: what its Job reports as it trains one step (strategies/job.Job.train_step), kept
    as train_gpt's probe keeps it, and more: each phase's ops (`ops.phase`); the collectives of the forwards and
    backwards and the pieces' work after them (one count), the clipping's apart; the bytes each forward keeps for
    backward, the most in flight, what is held gathered after the first forward, FSDP's unsharded gradient sums
    between a pipeline's micro-batches; the bytes held when AdamW has stepped (gradients still there); and AdamW's
    step taken again on the same gradients: its first makes its state (two moments and a count a parameter: 454 ops
    on a 2-rank ddp rank of the calibration's GPT against 4 a step after it), one-time work a run's median step leaves
    out, so the step priced is a second one. The loop's own scalars (the step's loss summed) are a phase not
    priced. A pipeline's actions are phases inside its step's (depth 2)."""

    def __init__(self, job, ops, microbatches: int):
        self.job, self.ops, self.microbatches, self.depth = job, ops, microbatches, 0
        self.counter, self.clipping = CollectiveCounter(), CollectiveCounter()
        self.kept, self.live, self.peak_live, self.in_flight, self.most_in_flight = [], 0, 0, 0, 0
        self.gathered = self.accumulated = None
        self.backwards, self.held = 0, {}

    @contextlib.contextmanager
    def watch(self, phase: str):
        self.depth += 1
        action = self.depth == 2 or self.job.runner is None  # one forward or backward, not a pipeline's step
        try:
            if phase == "forward" and self.depth == 1:
                self.ops.phase = "forward"
                self.counter.__enter__()  # until the pieces' work after backward
            if phase == "forward" and action:
                self.ops.phase = "forward"
                with SavedActivations() as saved:
                    yield
                self.kept.append(saved.bytes)
                self.live += saved.bytes
                self.peak_live, self.in_flight = max(self.peak_live, self.live), self.in_flight + 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                self.gathered = self.job.measure_window() if self.gathered is None else self.gathered
            elif phase == "backward" and action:
                self.ops.phase = "backward"
                yield
                self.live -= self.kept[self.backwards]
                self.in_flight, self.backwards = self.in_flight - 1, self.backwards + 1
                if (
                    self.accumulated is None and self.backwards < self.microbatches
                ):  # FSDP's sums, until the last
                    self.accumulated = unsharded_gradient_bytes(self.job.model, self.job.stages)
            elif phase == "after_backward":
                self.ops.phase = "step"
                yield
                self.counter.__exit__(None, None, None)
                self.ops.phase = "loop"  # the loop's own scalars (the step's loss summed): not priced
            elif (
                phase == "clip"
            ):  # its all-reduces of a few bytes each, counted apart (not in the layout's theory)
                self.ops.phase = "clip"
                with self.clipping:
                    self.clipping.passed(self.counter.last_group)
                    yield
            elif phase == "optimizer":
                self.ops.phase = "first_step"
                yield
            else:
                yield
        finally:
            self.depth -= 1

    def passed(self, dim: str) -> None:
        self.counter.passed(dim)

    def after_step(self, job, loss, grad_norm, step=None) -> None:
        self.held = job.measure_held()
        self.ops.phase = "step"
        job.optimizer.step()
        self.ops.phase = "loop"


def run_rank(cfg, layout: Layout, work: Workload, rank: int) -> dict:
    """One rank of the job, one optimizer step, on fake tensors: what it holds, keeps and sends."""
    from accelerate import Accelerator

    started = time.perf_counter()
    # this worker's own Accelerator, one process: it prepares the optimizer and autocasts as in train_gpt
    accelerator = Accelerator(cpu=True, mixed_precision="no" if layout.shard_dims else cfg.mixed_precision)
    with playing(rank, layout.world_size), quiet():
        gpt = meta_gpt(work.model)
        # the clipping by the global norm, as train_gpt runs it (at its default norm, unless the config says another)
        max_norm = getattr(cfg, "grad_clip", 1.0)
        job = parallelize(gpt, layout, cfg, work, accelerator, lambda p: adamw(p, 3e-4, 0.1), max_norm)
        for layer in moe_layers(job.model):  # fake tensors hold no routing: every rank routes uniformly
            layer.order = functools.partial(uniform_order, layer)
            if hasattr(layer.exchange, "assume_same_routing"):  # expert parallelism's all-to-all
                layer.exchange.assume_same_routing = True
        m = cfg.pp_microbatches if layout.pp > 1 else 1
        with FakeTensorMode(allow_non_fake_inputs=True):
            made_fake(job, accelerator.device)
            with OpRecorder() as ops:
                shape = (work.rows, work.model.block_size)
                ids = torch.randint(0, work.model.vocab_size, shape, device=accelerator.device)
                # train_gpt's step (strategies/job.py), one global batch; a pipeline's in its schedule's order
                job.instruments = measured = Measured(job, ops, m)
                job.train_step([(ids, ids)], 3e-4)
        counter, clipping = measured.counter, measured.clipping
        stage_index = layout.coordinate(rank, "pp")
        first, last = stage_index == 0, stage_index == layout.pp - 1
        routing = job.theory_inputs().get(
            "routing", []
        )  # what the MoE blocks sent and received: ep's theory's
    reference = meta_gpt(work.model)
    theory = held_bytes(reference, layout, rank, cfg, work)
    holding = theory_of(reference, layout, rank, cfg, work)  # its blocks
    return {
        "rank": rank,
        "coordinates": {d: layout.coordinate(rank, d) for d in DIMS if getattr(layout, d) > 1},
        "blocks": holding.blocks,
        "held": {**measured.held, "params_gathered": measured.gathered},
        "theory": {
            **{k: theory[k] for k in ("params", "grads", "optimizer")},
            "params_gathered": gathered_bytes(reference, layout, rank, cfg, work),
        },  # fmt: skip
        "activations_per_microbatch": max(measured.kept),
        "activations_peak": measured.peak_live,
        "activations_estimate": round(activation_bytes(work, layout, cfg, holding.blocks, first, last)),
        "peak_estimate": round(memory_estimate(reference, layout, cfg, work, rank)["peak"]),
        "in_flight": measured.most_in_flight,
        "grads_accumulated_unsharded": measured.accumulated or 0,
        "counted": {
            "calls": dict(counter.calls),
            "bytes": dict(counter.bytes),
            "switched": dict(counter.switched),
        },
        "ops": ops.summary(),
        "clip_collectives": {  # as "counted", with the calls and bytes per (kind, ranks of the group)
            "calls": dict(clipping.calls),
            "switched": dict(clipping.switched),
            "on_groups_of": [
                (kind, ranks, calls, sent) for (kind, ranks), (calls, sent) in clipping.on_groups_of.items()
            ],
        },
        "sent_theory": sent_bytes(reference, layout, rank, cfg, work, routing),
        "seconds": time.perf_counter() - started,
    }


def made_fake(job, device) -> None:
    """The job's parameters made fake tensors in place of meta ones. to_empty gives each plain parameter (not a
    DTensor) a new Parameter: a FakeTensor cannot take a meta tensor's place inside it. The optimizer parallelize
    built still held the meta ones and kept no state for them (measured: a tp x pp rank without data parallelism,
    its norms and position embedding), so it is pointed at the new ones, name by name."""
    before = dict(job.model.named_parameters(remove_duplicate=False))
    job.model.to_empty(device=device)
    after = dict(job.model.named_parameters(remove_duplicate=False))
    replaced = {id(before[name]): after[name] for name in before}
    optimizer = getattr(job.optimizer, "optimizer", job.optimizer)  # Accelerate's wrapper holds the real one
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]


def unsharded_gradient_bytes(model, stages) -> int:
    """Gradient bytes a rank holds between a pipeline's micro-batches: the .grad of the parameters (unsharded
    while FSDP keeps them gathered, the embedding's sometimes whole: tp.align_gradients), and the float32 sums
    FSDP2 keeps of bf16 gradients on its own (FSDPParam.unsharded_accumulated_grad: private, only read here)."""
    total = sum(local_bytes(p.grad) for p in unique_tensors(model.parameters()) if p.grad is not None)
    for module in (m for stage in stages for m in stage.modules()):
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group else []:
                summed = getattr(fsdp_param, "unsharded_accumulated_grad", None)
                total += local_bytes(summed) if summed is not None else 0
    return total


def uniform_order(layer, expert_ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, list[int]]:
    """A mixture of experts' routing on fake tensors, which hold no values: the assignments in their own order,
    shared out evenly over the experts (torch.chunk's split of tokens x top_k), the same on every rank. Stands in
    for MoE.order_by_expert; the run says so."""
    assignments = tokens * layer.top_k
    counts = [chunk_rows(assignments, layer.n_experts, e) for e in range(layer.n_experts)]
    return torch.arange(assignments, device=expert_ids.device), counts


def meta_gpt(cfg: GPTConfig) -> torch.nn.Module:
    """The model `cfg` describes (the GPT, or the transformers model it carries) on the meta device: shapes only."""
    with torch.device("meta"):
        return build_model(cfg, 0)


def run_rank_in(environment: dict, cfg, layout: Layout, work: Workload, rank: int) -> dict:
    """run_rank in this process's environment at the call (the fork server's is the one it started with)."""
    take_environment(environment)
    return run_rank(cfg, layout, work, rank)


def run_ranks(cfg, layout: Layout, work: Workload, ranks: list[int], show_progress: bool) -> list[dict]:
    """Each rank in a worker process of its own, as many at once as there are cores: torch keeps process-wide
    caches of meshes and their groups (DTensor's sharding cache handed a rank the groups of the rank before it,
    measured), so one process plays one rank. A worker that takes longer than --dist_timeout_s fails the run.
    The workers are forked from a fork server that has imported torch and this module once: a spawned worker paid
    ~3 s of imports for each rank (measured), and the server runs nothing, so each rank still starts clean."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed.tensor", "accelerate", "planning.fake_ranks"])
    workers = min(len(ranks), os.cpu_count() or 1)
    limit_s = cfg.dist_timeout_s * math.ceil(len(ranks) / workers)
    pool = ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1)
    environment = dict(os.environ)
    futures = {pool.submit(run_rank_in, environment, cfg, layout, work, rank): rank for rank in ranks}
    bar = tqdm(total=len(futures), desc="at_scale ranks", disable=not show_progress, leave=False)
    finished = False
    try:
        results = []
        for future in as_completed(futures, timeout=limit_s):
            results.append(future.result())
            bar.update()
        finished = True
    except TimeoutError:
        late = [rank for future, rank in futures.items() if not future.done()]
        raise UsageError(f"rank {late[0]} did not finish within --dist_timeout_s {cfg.dist_timeout_s:g} ({limit_s:g} s for "
                         f"{len(ranks)} rank(s) on {workers} worker(s)); ranks {late} were still running and are ended: "
                         "raise --dist_timeout_s") from None  # fmt: skip
    finally:
        bar.close()
        # Ends the workers at once on a timeout or Ctrl-C (a pool's exit would wait for every rank to finish;
        # the executor has no public way to stop a running task). Not when every rank finished: an idle worker
        # killed while it held the task queue's lock left the pool's shutdown waiting for ever (measured: 4
        # ranks on 2 workers, each worker replaced after its rank)
        if not finished:
            for process in list(getattr(pool, "_processes", {}).values()):
                process.kill()
        pool.shutdown(wait=True, cancel_futures=True)
    return sorted(results, key=lambda r: r["rank"])
