"""at_scale: what one rank of a 1,024- or 16,384-GPU job holds, sends and costs, on a laptop, by the real code.

One process plays, one after another, each rank of an N-rank job whose work differs (PyTorch's fake process
group: every collective returns at once, nothing is sent), on fake tensors (shapes and dtypes, no memory): the
project's GPT at a published shape, the same `parallelize` train_gpt runs (strategies/), one whole optimizer
step. What each rank holds and sends is measured as train_gpt measures it and checked against the same closed
forms, to the byte; the step is predicted on a hardware profile (planning/cost_model.py: a prediction, labelled
as one).

    python experiments/at_scale.py                         # GPT-3 175B on 1,024 ranks: pp 16 x dp_shard 8 x tp 8
    python experiments/at_scale.py --model llama3_405b --world_size 16384 --dp_shard 128 --tp 8 --pp 16
    python experiments/at_scale.py --model llama3_8b --world_size 64 --dp_shard 8 --tp 8 --hardware a100_80gb
    python experiments/at_scale.py --model custom --n_layer 4 --d_model 64 --n_head 4 --vocab_size 512 \\
        --block_size 64 --world_size 8 --dp_shard 2 --tp 2 --pp 2
    python experiments/at_scale.py --model olmoe_1b_7b --world_size 256 --dp_shard 32 --ep 8 --per_rank_batch_size 1

A mixture of experts (olmoe_1b_7b) routes its tokens by values fake tensors do not hold: at scale every rank's
routing is assumed uniform (said in its report), and its step is not predicted (the cost model is the dense GPT's).

Per rank run (by default the first rank of each pipeline stage whose theory differs, and the world's last):
  1. the GPT built on the meta device and parallelized there (tensor parallelism, FSDP, the pipeline cut: the
     meshes hold real rank numbers), then its parameters made fake (to_empty under FakeTensorMode);
  2. the step's micro-batches in the pipeline schedule's order: 1F1B runs min(p - s, m) forwards on stage s
     before its first backward, GPipe all m; FSDP told which backward is the step's last, as the schedule tells
     it. The schedule itself cannot run on fake tensors (its warm-up vote reads a value), so the pipeline's
     point-to-point sends are the theory's, not counted;
  3. AdamW's step.
Measured: the bytes of parameters, gradients and AdamW state at the step's end, and of the parameters held while
the micro-batches run (FSDP's gathered copies); the bytes each micro-batch's forward keeps for backward
(common/activations.py) and the most in flight at once; the gradients FSDP accumulates unsharded over a
pipeline's micro-batches; every collective (common/comm_counter.py). Peak = those at the moment they coexist
(the first backward). Not measured: transient buffers (an all-gather's staging copy, the loss's softmax):
torch's memory trackers refuse a pipeline's several forwards before a backward, and FSDPMemTracker counted
AdamW's state of sharded parameters at 129x its size (measured here; docs/at_scale.md).

Checks, on every rank run: memory_per_rank (parameters, gradients, AdamW state, gathered parameters equal the
theory, to the byte) and communication_volume (each kind of collective's bytes equal the theory, to the byte).
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("at_scale.py")

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore
from tqdm import tqdm

from common.activations import SavedActivations
from common.comm_counter import CollectiveCounter
from common.config import RunArgs, UsageError, flag, parse_config, require, run_cli
from common.gpt import GPT, GPTConfig, adamw, lm_loss, parameter_count
from common.moe import moe_layers
from planning.cost_model import (
    activation_bytes,
    hardware_names,
    load_hardware,
    memory_estimate,
    model_flops_per_token,
    predict_step,
)
from planning.published import MODELS, PUBLISHED_RUNS, model_named
from strategies import ParallelArgs, ep, pp, tp
from strategies.job import Instruments, local_bytes, unique_tensors
from strategies.layout import DIMS, Layout, Workload, chunk_rows
from strategies.parallelize import parallelize, quiet
from strategies.theory import gathered_bytes, held_bytes, sent_bytes

EXPERIMENT = "at_scale"
DEFAULT_LAYOUT = {"pp": 16, "dp_shard": 8, "tp": 8}  # no layout given: 1,024 ranks
SHAPE_FLAGS = ("vocab_size", "block_size", "n_layer", "n_head", "d_model")
P2P_KINDS = ("send", "recv", "broadcast")  # a pipeline's, by theory only (the module docstring)


@dataclass
class Config(RunArgs, ParallelArgs):
    model: str = flag("gpt3_175b", "a published shape (planning/published.py): " + ", ".join(MODELS) + "; custom: "
                      "the shape flags alone")  # fmt: skip
    world_size: int = flag(0, "ranks of the job (0: the degrees' product); with no degree given, pp 16 x dp_shard "
                           "8 x tp 8 on 1,024")  # fmt: skip
    vocab_size: int = flag(0, "vocabulary (0: the model's)")
    block_size: int = flag(0, "sequence length in tokens (0: the model's)")
    n_layer: int = flag(0, "blocks (0: the model's)")
    n_head: int = flag(0, "attention heads (0: the model's)")
    d_model: int = flag(0, "width (0: the model's)")
    per_rank_batch_size: int = flag(0, "sequences per data-parallel rank per step (0: the model's published batch / "
                                    "the data-parallel ranks, at least one per pipeline stage)")  # fmt: skip
    pp_microbatches: int = flag(0, "with --pp: micro-batches per step (0: one sequence each)")
    mixed_precision: str = flag("bf16", "bf16 (autocast; under dp_shard FSDP's bf16 policy) or no (float32)",
                                choices=("no", "bf16"))  # fmt: skip
    hardware: str = flag(
        "h100_sxm", "the profile the memory and step are set against: " + ", ".join(hardware_names())
    )
    ranks: str = flag("", "ranks to run, comma-separated (default: the first of each pipeline stage whose theory "
                      "differs, and the world's last)")  # fmt: skip

    def validate(self) -> None:
        super().validate()
        require(self.model == "custom" or self.model in MODELS,
                f"--model {self.model!r} is not a shape this project knows; known: {', '.join(MODELS)}, custom")  # fmt: skip
        for name in (*SHAPE_FLAGS, "world_size", "per_rank_batch_size", "pp_microbatches"):
            require(getattr(self, name) >= 0, f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.model == "custom":
            for name in SHAPE_FLAGS:
                require(
                    getattr(self, name) > 0, f"--model custom needs --{name} > 0 (and the other shape flags)"
                )
        shape = self.model_config()
        require(
            shape.d_model % shape.n_head == 0,
            f"--n_head {shape.n_head} must divide --d_model {shape.d_model}",
        )
        if not self.world_size and all(getattr(self, dim) <= 1 for dim in DIMS) and self.strategy == "auto":
            for dim, degree in DEFAULT_LAYOUT.items():
                setattr(self, dim, degree)
        given = math.prod(max(1, getattr(self, dim)) for dim in DIMS)
        layout = self.resolve_layout(self.world_size or given)
        self.world_size = layout.world_size
        require(layout.pp == 1 or self.pp_schedule in ("gpipe", "1f1b"),
                f"--pp_schedule {self.pp_schedule} at scale: not built (one stage per rank: gpipe or 1f1b)")  # fmt: skip
        self.refuse_layout(layout, self.workload(), 0.0)
        load_hardware(self.hardware)
        for rank in self.rank_list():
            require(0 <= rank < layout.world_size, f"--ranks: {rank} is not a rank of {layout.world_size}")

    def model_config(self) -> GPTConfig:
        base = GPTConfig(1, 1, 1, 1, 1) if self.model == "custom" else model_named(self.model).shape
        return GPTConfig(
            **{**base.__dict__, **{n: getattr(self, n) for n in SHAPE_FLAGS if getattr(self, n)}}
        )

    def layout(self) -> Layout:
        return Layout(**{dim: max(1, getattr(self, dim)) for dim in DIMS})

    def workload(self) -> Workload:
        """Rows per data-parallel rank (the published batch shared out by default); the pipeline's micro-batches
        (one sequence each by default) written back into the flags, as config.json records what ran."""
        layout, published = self.layout(), MODELS[self.model].global_batch if self.model in MODELS else 1
        rows = self.per_rank_batch_size or max(published // layout.dp, layout.pp if layout.pp > 1 else 1)
        if layout.pp > 1 and not self.pp_microbatches:
            self.pp_microbatches = rows
        return Workload(self.model_config(), rows, 1, self.mixed_precision)

    def rank_list(self) -> list[int]:
        return [int(r) for r in self.ranks.replace(" ", "").split(",") if r] if self.ranks.strip() else []


def ranks_that_differ(reference, layout: Layout, args, work: Workload) -> list[int]:
    """The first rank of each pipeline stage whose theory (what it holds and sends) differs from the stages'
    before it, and the world's last rank if its theory differs too (the last piece of every split: an uneven
    split leaves it less)."""
    seen, ranks = set(), []
    for rank in [*(layout.rank_at(pp=stage) for stage in range(layout.pp)), layout.world_size - 1]:
        theory = (str(held_bytes(reference, layout, rank, args, work)),
                  str(sent_bytes(reference, layout, rank, args, work)["by_kind"]))  # fmt: skip
        if theory not in seen:
            seen.add(theory)
            ranks.append(rank)
    return ranks


@contextlib.contextmanager
def playing(rank: int, world_size: int):
    """This process as rank `rank` of `world_size`: torch's fake process group (its collectives return at once
    and move nothing), for as long as the rank runs."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class HeldAtStepEnd(Instruments):
    """The job's instruments: the bytes held when AdamW has stepped (gradients still there)."""

    def __init__(self):
        self.held: dict = {}

    def after_step(self, job, loss, grad_norm) -> None:
        self.held = job.measure_held()


def schedule_order(schedule: str, pp_size: int, stage: int, m: int) -> str:
    """The forwards (F) and backwards (B) of one stage's step: 1F1B's warm-up of p - s - 1 forwards, then one
    forward and one backward in turn, then the rest of the backwards; GPipe's m forwards then m backwards."""
    if schedule == "gpipe" or pp_size == 1:
        return "F" * m + "B" * m
    warmup = min(pp_size - stage - 1, m)
    return "F" * warmup + "FB" * (m - warmup) + "B" * warmup


def run_rank(cfg: Config, layout: Layout, work: Workload, rank: int) -> dict:
    """One rank of the job, one optimizer step, on fake tensors: what it holds, keeps and sends."""
    from accelerate import Accelerator

    started = time.perf_counter()
    # this worker's own Accelerator, one process: it prepares the optimizer and autocasts as in train_gpt
    accelerator = Accelerator(cpu=True, mixed_precision="no" if layout.shard_dims else cfg.mixed_precision)
    with playing(rank, layout.world_size), quiet():
        with torch.device("meta"):
            gpt = GPT(work.model)
        job = parallelize(gpt, layout, cfg, work, accelerator, lambda p: adamw(p, 3e-4, 0.1), 0.0)
        job.instruments = instruments = HeldAtStepEnd()
        for layer in moe_layers(job.model):  # fake tensors hold no routing: every rank routes uniformly
            layer.order = functools.partial(uniform_order, layer)
            if isinstance(layer.exchange, ep.AllToAll):
                layer.exchange.assume_same_routing = True
        stage = job.stages[0]  # gpipe and 1f1b: one stage per rank
        stage_index = layout.coordinate(rank, "pp")
        first, last = stage_index == 0, stage_index == layout.pp - 1
        m = cfg.pp_microbatches if layout.pp > 1 else 1
        rows, tokens = work.rows // m, work.model.block_size
        with FakeTensorMode(allow_non_fake_inputs=True):
            job.model.to_empty(device=accelerator.device)
            in_flight, kept, live, peak_live, most_in_flight, gathered, accumulated = (
                [],
                [],
                0,
                0,
                0,
                None,
                None,
            )
            with CollectiveCounter() as counter:
                for action in schedule_order(cfg.pp_schedule, layout.pp, stage_index, m):
                    if action == "F":
                        ids = torch.randint(
                            0, work.model.vocab_size, (rows, tokens), device=accelerator.device
                        )
                        x, y = job.split_batch(ids, ids)
                        if not first:  # the previous stage's output, as the schedule hands it over
                            x = torch.empty(*x.shape, work.model.d_model, dtype=pp.activation_dtype(layout, work),
                                            requires_grad=True)  # fmt: skip
                        with SavedActivations() as saved, accelerator.autocast():
                            out = stage(x)
                            out = lm_loss(out, y) / m if last else out
                        in_flight.append(out)
                        most_in_flight = max(most_in_flight, len(in_flight))
                        kept.append(saved.bytes)
                        live += saved.bytes
                        peak_live = max(peak_live, live)
                        gathered = job.measure_window() if gathered is None else gathered
                    else:
                        done = len(kept) - len(in_flight)  # backwards done so far
                        last_backward = done == m - 1
                        if isinstance(stage, FSDPModule):  # as the schedule tells FSDP (and replicate)
                            stage.set_is_last_backward(last_backward)
                            stage.set_reshard_after_backward(last_backward or layout.pp == 1)
                            stage.set_requires_gradient_sync(last_backward)
                        out = in_flight.pop(0)
                        out.backward() if last else out.backward(torch.empty_like(out))
                        live -= kept[done]
                        if accumulated is None and not last_backward:  # FSDP's unsharded sums, until the last
                            accumulated = unsharded_gradient_bytes(job.model, job.stages)
                if job.exchanges:  # the experts' gradients over their replicas, as Job.forward_backward does
                    ep.reduce_gradients(job.model, job.expert_replicas, layout.dp)
                if job.pipeline:
                    if layout.tp > 1:
                        tp.align_gradients(job.model)
                    job.pipeline.after_backward()  # the m micro-batches' mean, the tied gradient's all-reduce
            job.step(None)
        routing = job.routing()  # what the MoE blocks sent and received in the step: ep's theory's input
    moe = bool(work.model.n_experts)
    reference = meta_gpt(work.model)
    held, theory = instruments.held, held_bytes(reference, layout, rank, cfg, work)
    holding = pp.holding(layout, rank, cfg, work.model.n_layer, work.model.tie_weights)
    return {
        "rank": rank,
        "coordinates": {d: layout.coordinate(rank, d) for d in DIMS if getattr(layout, d) > 1},
        "blocks": len(holding.blocks),
        "held": {**held, "params_gathered": gathered},
        "theory": {
            **{k: theory[k] for k in ("params", "grads", "optimizer")},
            "params_gathered": gathered_bytes(reference, layout, rank, cfg, work),
        },  # fmt: skip
        "activations_per_microbatch": max(kept),
        "activations_peak": peak_live,
        # the cost model's estimates are the dense GPT's: none for a mixture of experts
        "activations_estimate": None
        if moe
        else round(activation_bytes(work, layout, cfg, len(holding.blocks), first, last)),
        "peak_estimate": None if moe else round(memory_estimate(reference, layout, cfg, work, rank)["peak"]),
        "in_flight": most_in_flight,
        "grads_accumulated_unsharded": accumulated or 0,
        "counted": {"calls": dict(counter.calls), "bytes": dict(counter.bytes)},
        "sent_theory": sent_bytes(reference, layout, rank, cfg, work, routing),
        "seconds": time.perf_counter() - started,
    }


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


def meta_gpt(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def peak_bytes(r: dict) -> int:
    """The bytes that coexist at the first backward: parameters (at rest and gathered), AdamW's state, the
    activations in flight, and the gradients: FSDP's unsharded sums under a pipeline, else the step's."""
    held = r["held"]
    gathered_extra = max(0, held["params_gathered"] - held["params"])
    grads = r["grads_accumulated_unsharded"] or held["grads"]
    return held["params"] + gathered_extra + held["optimizer"] + grads + r["activations_peak"]


def gb(size: float) -> str:  # GiB
    return f"{size / 2**30:,.2f}"


def estimate(size: float | None) -> str:
    return "–" if size is None else gb(size)


def run(cfg: Config) -> int:
    layout, work, hardware = cfg.layout(), cfg.workload(), load_hardware(cfg.hardware)
    reference = meta_gpt(work.model)
    with start_session(cfg) as session:
        ranks = cfg.rank_list() or ranks_that_differ(reference, layout, cfg, work)
        session.print(f"{cfg.model}: {parameter_count(work.model):,} parameters, {layout.describe()}, "
                      f"{work.rows} x {work.model.block_size} tokens per data-parallel rank per step"
                      + (f" in {cfg.pp_microbatches} micro-batches ({cfg.pp_schedule})" if layout.pp > 1 else "")
                      + f"; running ranks {ranks} on fake tensors")  # fmt: skip
        results = run_ranks(cfg, layout, work, ranks, session.is_main)
        check_ranks(session, results, layout)
        report(session, cfg, layout, work, hardware, reference, results)
    return session.exit_code


def run_ranks(
    cfg: Config, layout: Layout, work: Workload, ranks: list[int], show_progress: bool
) -> list[dict]:
    """Each rank in a worker process of its own, as many at once as there are cores: torch keeps process-wide
    caches of meshes and their groups (DTensor's sharding cache handed a rank the groups of the rank before it,
    measured), so one process plays one rank. A worker that takes longer than --dist_timeout_s fails the run."""
    context = multiprocessing.get_context("spawn")
    workers = min(len(ranks), os.cpu_count() or 1)
    limit_s = cfg.dist_timeout_s * math.ceil(len(ranks) / workers)
    pool = ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1)
    futures = {pool.submit(run_rank, cfg, layout, work, rank): rank for rank in ranks}
    bar = tqdm(total=len(futures), desc="at_scale ranks", disable=not show_progress, leave=False)
    try:
        results = []
        for future in as_completed(futures, timeout=limit_s):
            results.append(future.result())
            bar.update()
    except TimeoutError:
        late = [rank for future, rank in futures.items() if not future.done()]
        raise UsageError(f"rank {late[0]} did not finish within --dist_timeout_s {cfg.dist_timeout_s:g} ({limit_s:g} s for "
                         f"{len(ranks)} rank(s) on {workers} worker(s)); ranks {late} were still running and are ended: "
                         "raise --dist_timeout_s") from None  # fmt: skip
    finally:
        bar.close()
        # Ends the workers at once on a timeout or Ctrl-C (a pool's exit would wait for every rank to finish;
        # the executor has no public way to stop a running task)
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=True, cancel_futures=True)
    return sorted(results, key=lambda r: r["rank"])


def start_session(cfg: Config):
    from common.run import start_run

    # FSDP's bf16 is its policy's (strategies/shard.py), autocast the rest's: as train_gpt
    return start_run(
        cfg, EXPERIMENT, mixed_precision="no" if cfg.layout().shard_dims else cfg.mixed_precision
    )


def check_ranks(session, results: list[dict], layout: Layout) -> None:
    """Each rank run against its theory, to the byte: what it holds, and what it sends but the pipeline's sends."""
    wrong_memory = [f"rank {r['rank']}: " + ", ".join(f"{k} {r['held'][k]:,}/{r['theory'][k]:,}" for k in r["theory"])
                    for r in results if any(r["held"][k] != r["theory"][k] for k in r["theory"])]  # fmt: skip
    session.check("memory_per_rank", not wrong_memory,
                  "; ".join(wrong_memory) if wrong_memory else f"{len(results)} ranks: parameters, gradients, AdamW "
                  "state and the parameters gathered during the step equal their theory, to the byte")  # fmt: skip
    wrong_comm = []
    for r in results:
        expected = {
            k: v for k, v in r["sent_theory"]["by_kind"].items() if not (layout.pp > 1 and k in P2P_KINDS)
        }
        kinds = sorted(set(expected) | set(r["counted"]["bytes"]))
        if any(r["counted"]["bytes"].get(k, 0) != expected.get(k, 0) for k in kinds):
            wrong_comm.append(f"rank {r['rank']}: " + ", ".join(
                f"{k} {r['counted']['bytes'].get(k, 0):,}/{expected.get(k, 0):,}" for k in kinds))  # fmt: skip
    p2p = " (the pipeline's sends: by theory)" if layout.pp > 1 else ""
    session.check("communication_volume", not wrong_comm,
                  "; ".join(wrong_comm) if wrong_comm else f"{len(results)} ranks: every kind of collective's bytes "
                  f"per step equal their theory, to the byte{p2p}")  # fmt: skip


def report(
    session, cfg: Config, layout: Layout, work: Workload, hardware, reference, results: list[dict]
) -> None:
    """Per rank: the bytes by category and the peak against the hardware's memory; the predicted step; a
    published run of this model and layout beside it."""
    capacity = hardware.memory_bytes
    session.print(f"{'rank':>6} {'stage':>5} {'blocks':>6} {'params GiB':>10} {'grads GiB':>9} {'AdamW GiB':>9} "
                  f"{'gathered':>9} {'act/mb GiB':>10} {'(estimate)':>10} {'in flight':>9} {'peak GiB':>9} {'(estimate)':>10}  "
                  f"fits {hardware.name}")  # fmt: skip
    rows = []
    for r in results:
        peak = peak_bytes(r)
        rows.append({"rank": r["rank"], "stage": r["coordinates"].get("pp", 0), "blocks": r["blocks"],
                     "peak_bytes": peak, "fits": peak <= capacity})  # fmt: skip
        session.print(f"{r['rank']:>6} {rows[-1]['stage']:>5} {r['blocks']:>6} {gb(r['held']['params']):>10} "
                      f"{gb(r['grads_accumulated_unsharded'] or r['held']['grads']):>9} "
                      f"{gb(r['held']['optimizer']):>9} {gb(r['held']['params_gathered']):>9} "
                      f"{gb(r['activations_per_microbatch']):>10} {estimate(r['activations_estimate']):>10} "
                      f"{r['in_flight']:>9} {gb(peak):>9} {estimate(r['peak_estimate']):>10}  "
                      f"{'yes' if peak <= capacity else 'NO'} ({gb(capacity)} GiB)")  # fmt: skip
    session.metrics.update(model=cfg.model, parameters=parameter_count(work.model), layout=layout.degrees(),
                           ranks=results, memory=rows, hardware=hardware.name, fits=all(row["fits"] for row in rows))  # fmt: skip
    if work.model.n_experts:  # the cost model's FLOPs and activations are the dense GPT's
        a2a = max(r["counted"]["bytes"].get("all_to_all", 0) for r in results)
        session.print(f"a mixture of experts, routing assumed uniform (fake tensors hold none): all-to-all "
                      f"{gb(a2a)} GiB a rank per step (counted = theory); PREDICTED: not modelled for a mixture "
                      "of experts")  # fmt: skip
        session.metrics.update(prediction=None, published=[], all_to_all_bytes_per_rank=a2a)
        return
    calls = results[0]["counted"]["calls"]
    prediction = predict_step(reference, layout, cfg, work, hardware, calls)
    flops = (
        model_flops_per_token(work.model) * prediction["global_tokens"]
    )  # model FLOPs: no recompute counted
    tflops = flops / prediction["step_s"] / layout.world_size / 1e12
    precision = "bf16" if cfg.mixed_precision == "bf16" else "fp32"
    mfu = tflops * 1e12 / hardware.peak_flops[precision]
    terms = ", ".join(f"{k} {v:.3g}" for k, v in prediction["terms_s"].items() if v)
    session.print(f"PREDICTED on {hardware.name} ({precision}): step {prediction['step_s']:.3g} s ({terms} s), "
                  f"{prediction['tokens_per_s']:,.0f} tokens/s, {tflops:.0f} TFLOP/s per GPU, MFU {mfu:.0%}")  # fmt: skip
    published = [p for p in PUBLISHED_RUNS if p.model == cfg.model and p.world_size == layout.world_size and
                 {d: n for d, n in layout.degrees().items() if n > 1} == p.degrees]  # fmt: skip
    for p in published:  # in the paper's own count of FLOPs
        theirs = model_flops_per_token(work.model, p.recompute_counted) * prediction["global_tokens"]
        ours = theirs / prediction["step_s"] / layout.world_size / 1e12
        session.print(f"PUBLISHED ({p.source}): {p.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {p.mfu:.0%}; predicted in "
                      f"its count {ours:.0f} TFLOP/s: predicted / published {ours / p.tflops_per_gpu:.2f}")  # fmt: skip
    session.metrics.update(prediction=prediction | {"tflops_per_gpu": tflops, "mfu": mfu},
                           published=[p.__dict__ for p in published])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
