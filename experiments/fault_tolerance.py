"""fault_tolerance: can training lose a replica group, go on without restarting anyone, and end where a run without
failures ends?

torchft (PyTorch's per-step fault tolerance of the replicated dimension) keeps the healthy replica groups stepping
while a failed one is replaced; the replacement takes its state live from a healthy peer (torchft's checkpoint
transport), never from disk. One command starts everything on this machine:
  - torchft's lighthouse (LighthouseServer), which forms a quorum of the live groups before every step;
  - --replica_groups groups training the GPT of common/gpt.py under torchft Managers: each one process (plain
    replicas), or --dp_shard processes that shard it with FSDP2 inside the group while torchft replicates across
    the groups (fault-tolerant HSDP, as torchtitan wires it: one Manager per rank, rank r of every group all-reducing
    its shard's gradients with rank r of the others);
  - a fault injector that SIGKILLs a random group --failures times at random moments (every second failure while
    the previous one's replacement is still recovering) and hands the group's place to a hot spare, which joins
    the next quorum and heals from a peer.
No survivor restarts. What goes beyond torchft's own promise (a failed step's samples are never trained there, so
the result depends on when failures happen): every committed step trains the SAME global batch (step s: samples
s x B ... s x B + B - 1 of one seeded stream), cut into fixed micro-batches of --micro_batch_size rows that the
groups in the quorum share; each micro-batch's gradient is added in float64, the groups' sums all-reduced (SUM) in
float64, and only then rounded to float32. A sum of a few float32 numbers in float64 is exact, so the gradient
does not depend on how many groups shared the step or who computed what. (Under FSDP a unit of --dp_shard
micro-batches, one per rank, is reduce-scattered in float64 and reaches each shard rounded once: the reference
rounds each unit alike.) A step a failure interrupts is not committed and is redone with the same batch. So
failures change the time, not the result: the final parameters equal one process that accumulates the same
micro-batches (gradient accumulation): 0.0 apart in every run here.

Checks (each has a --wrong_variant that fails it; tests/test_fault_tolerance.py):
- matches_one_process  every finished group's parameters after --max_steps equal one process on the same global
                       batches (--param_atol);
- every_sample_once    every committed step trained its B samples exactly once: the groups all-reduce their row
                       count and the sums of their samples' stream positions (and squares) beside the gradients;
- failures_survived    failures injected = failures survived (the group back, healed from a peer, training on),
                       no survivor restarted, no group given up on.
With --algorithm diloco (torchft's DiLoCo: --sync_every inner AdamW steps on each group's share, then an outer
Nesterov step on the groups' averaged parameter change) the run is another algorithm: it is not compared with one
process (the check says why); its bytes are set against DDP's for the same tokens, its val_loss beside DDP's.

Run it (CPU, over gloo):
    python experiments/fault_tolerance.py --replica_groups 3 --failures 4
    python experiments/fault_tolerance.py --replica_groups 3 --dp_shard 2 --failures 4     # FSDP inside each group
    python experiments/fault_tolerance.py --replica_groups 2 --failures 2 --seed 2
    python experiments/fault_tolerance.py --algorithm diloco --sync_every 10
On a cluster the same roles run as jobs: `torchft_lighthouse --min_replicas 1 ...` once, then one `torchrun` job
per replica group with TORCHFT_LIGHTHOUSE set (torchft's README); the injector is this file's only addition.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("fault_tolerance.py")

import torch

from common.config import (
    MAX_TIMEOUT_S,
    RunArgs,
    UsageError,
    flag,
    parse_config,
    require,
    require_positive,
    run_cli,
)
from common.data import iterate_sample_stream
from common.device import backend_for, process_device
from common.gpt import GPTConfig, adamw, build_gpt, lm_loss, parameter_count, refuse_gpt
from common.moe import local  # a DTensor's local shard (a view: writing it writes it), else the tensor
from common.run import start_run
from common.text import load_corpus, require_vocabulary

EXPERIMENT = "fault_tolerance"
WRONG_VARIANTS = {
    "own_data_position": "torchft's own loop: each group reads its own data, a batch per attempt, whatever was "
    "committed: a failed step's batch is skipped, and a replacement reads from the first batch",
    "average_over_groups": "torchft's default all-reduce (AVG) of gradients whose losses are already divided by the "
    "whole batch: every step's gradient divided by the number of live groups",
    "replacement_hangs": "a replacement takes its place and hangs before its first quorum: the group never comes "
    "back; after --rejoin_timeout_s it is given up on, named, and the survivors carry on",
}


@dataclass
class Config(RunArgs):
    sweep_metrics = ("val_loss", "samples_per_s")
    replica_groups: int = flag(3, "replica groups (each a process here; a torchrun job on a cluster)")
    failures: int = flag(4, "groups killed (SIGKILL) at random moments, each replaced by a hot spare")
    algorithm: str = flag("ddp", "ddp: gradients all-reduced every step; diloco: torchft's DiLoCo",
                          choices=("ddp", "diloco"))  # fmt: skip
    sync_every: int = flag(10, "with --algorithm diloco: inner steps between the groups' syncs (H)")
    max_steps: int = flag(200, "committed optimizer steps (ddp) or inner steps (diloco)")
    global_batch_size: int = flag(12, "samples every committed step trains, whatever groups are alive")
    micro_batch_size: int = flag(2, "rows of a micro-batch: the fixed unit the live groups share (B / this of "
                                 "them, so at most that many groups)")  # fmt: skip
    dp_shard: int = flag(1, "processes per replica group, sharding the model with FSDP2 inside the group; torchft "
                         "replicates across the groups (fault-tolerant HSDP). 1: plain replicas")  # fmt: skip
    block_size: int = flag(32, "tokens per sample")
    vocab_size: int = flag(512, "BPE vocabulary trained on the corpus")
    d_model: int = flag(64, "model width")
    n_layer: int = flag(2, "transformer blocks")
    n_head: int = flag(2, "attention heads")
    lr: float = flag(3e-3, "AdamW learning rate (DiLoCo's inner optimizer's)")
    outer_lr: float = flag(
        0.7, "with --algorithm diloco: the outer Nesterov SGD's learning rate (DiLoCo's 0.7)"
    )
    lighthouse_port: int = flag(0, "the lighthouse's port (0: a free one)")
    step_timeout_s: float = flag(5.0, "torchft's timeout of a quorum, a collective and a checkpoint transfer: how "
                                 "long survivors wait for a dead peer before a new quorum")  # fmt: skip
    rejoin_timeout_s: float = flag(60.0, "a group silent this long (a replacement not healed, a survivor stuck) is "
                                   "given up on, named, and failures_survived fails; the others carry on")  # fmt: skip
    param_atol: float = flag(
        1e-4, "largest |parameter - one process| after --max_steps (train_gpt's tolerance)"
    )
    wrong_variant: str = flag("", "a deliberate mistake a check must catch: " + ", ".join(WRONG_VARIANTS))

    def validate(self) -> None:
        super().validate()
        # the model through train_gpt's own checks, first: nothing starts on a GPT no model can have
        require_vocabulary(self.vocab_size)
        refuse_gpt(self.model_config(self.vocab_size))
        require_positive(self, "replica_groups", "dp_shard", "max_steps", "global_batch_size", "micro_batch_size",
                         "sync_every", "lr", "outer_lr", "step_timeout_s", "rejoin_timeout_s", "param_atol")  # fmt: skip
        for name in ("step_timeout_s", "rejoin_timeout_s"):  # a timedelta, a deadline: bounded (a week)
            require(
                getattr(self, name) <= MAX_TIMEOUT_S,
                f"--{name} must be <= {MAX_TIMEOUT_S}, got {getattr(self, name)}",
            )
        require(self.failures >= 0, f"--failures must be >= 0, got {self.failures}")
        require(self.replica_groups >= 2 or self.failures == 0,
                f"--failures {self.failures} with --replica_groups {self.replica_groups}: a failure needs a healthy "
                "group to recover from (>= 2 groups)")  # fmt: skip
        steps = self.max_steps // self.sync_every if self.algorithm == "diloco" else self.max_steps
        require(self.failures <= steps // 4, f"--failures {self.failures}: at most {steps // 4} in {steps} "
                f"{'syncs' if self.algorithm == 'diloco' else 'steps'} (a failure needs steps around it to be "
                "survived and seen); raise --max_steps")  # fmt: skip
        require(self.global_batch_size % self.micro_batch_size == 0, f"--global_batch_size "
                f"{self.global_batch_size} must be a multiple of --micro_batch_size {self.micro_batch_size}")  # fmt: skip
        micro_batches = self.global_batch_size // self.micro_batch_size
        require(micro_batches % self.dp_shard == 0, f"--dp_shard {self.dp_shard} must divide the {micro_batches} "
                "micro-batches of a global batch (each of a group's ranks takes one of every unit)")  # fmt: skip
        units = micro_batches // self.dp_shard
        require(self.replica_groups <= units, f"--replica_groups {self.replica_groups}: at most {units}, the units "
                f"a global batch splits into for the groups to share ({self.global_batch_size} rows / "
                f"--micro_batch_size {self.micro_batch_size} / --dp_shard {self.dp_shard})")  # fmt: skip
        require(self.algorithm == "ddp" or self.dp_shard == 1, f"--algorithm {self.algorithm} with --dp_shard "
                f"{self.dp_shard}: DiLoCo runs plain replicas here (--dp_shard 1)")  # fmt: skip
        require(
            0 <= self.lighthouse_port < 65536,
            f"--lighthouse_port must be in [0, 65535], got {self.lighthouse_port}",
        )
        processes, devices = (
            (self.replica_groups + self.failures) * self.dp_shard,
            torch.accelerator.device_count(),
        )
        require(not torch.accelerator.is_available() or processes <= devices, f"{processes} processes (--replica_groups "
                f"{self.replica_groups} + a spare a failure, x --dp_shard {self.dp_shard}) need a GPU each (NCCL takes "
                f"one process a GPU); this machine has {devices}")  # fmt: skip
        require(self.wrong_variant in ("", *WRONG_VARIANTS),
                f"--wrong_variant {self.wrong_variant!r}: known: {', '.join(WRONG_VARIANTS)}")  # fmt: skip

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size, self.block_size, self.n_layer, self.n_head, self.d_model)


def micro_batches_of(micro_batches: int, groups: int, rank: int) -> range:
    """A group's contiguous micro-batches of a step: as even as can be, the first groups one more."""
    per, extra = divmod(micro_batches, groups)
    start = rank * per + min(rank, extra)
    return range(start, start + per + (rank < extra))


def accumulate(model, parameters, x, y, micro: range, cfg: Config) -> tuple[torch.Tensor, float]:
    """The float64 sums of the gradients and losses of micro-batches `micro` of a global batch (x, y). Each
    micro-batch's loss is its summed token losses / the batch's B x T tokens, so the sum over every micro-batch is
    the batch's mean loss and its gradient, whoever computes which. Under FSDP each rank of a group passes its own
    micro-batches, and the sums are of its shards (FSDP has summed the group's ranks into them)."""
    device = parameters[0].device
    total = torch.zeros(sum(local(p).numel() for p in parameters), dtype=torch.float64, device=device)
    loss_sum = 0.0
    for m in micro:
        for p in parameters:
            local(p.grad).zero_()
        rows = slice(m * cfg.micro_batch_size, (m + 1) * cfg.micro_batch_size)
        logits = model(x[rows].to(device))
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), y[rows].to(device).flatten(), reduction="sum"
        )
        loss = loss / (cfg.global_batch_size * cfg.block_size)
        loss.backward()
        total += torch.cat([local(p.grad).reshape(-1) for p in parameters]).double()
        loss_sum += loss.item()
    return total, loss_sum


def batch_of(corpus: dict, cfg: Config, step: int):
    """Step `step`'s global batch: samples step x B ... step x B + B - 1 of one seeded stream."""
    return next(
        iterate_sample_stream(*corpus["train"], cfg.global_batch_size, cfg.seed, step * cfg.global_batch_size)
    )


# ------------------------------------------------------------------------------------------- a replica group
def replica_group(
    spare: int, rank: int, cfg: Config, lighthouse: str, run_dir: str, launcher_pid: int
) -> None:
    """A replica group's process (started by the Injector): it ends when the launcher does, however the launcher
    ends (a SIGKILL included: it would otherwise wait for its go-file or retry torchft's quorum forever); under the
    GPU rehearsal when the run is one."""
    from common.processes import end_with
    from common.rehearsal import rehearse_if_asked

    end_with(launcher_pid)
    with rehearse_if_asked():
        run_replica(spare, rank, cfg, lighthouse, run_dir)


def run_replica(spare: int, rank: int, cfg: Config, lighthouse: str, run_dir: str) -> None:
    """One process's life: get ready (imports, data, model, its group's FSDP ranks: the seconds a cold start
    costs), wait for the injector to give its spare a group's place (<run_dir>/spare<k>.go), join the quorum, heal
    from a peer if behind, train committed steps to the end. Its events go to events/group<g>.<rank>-<pid>.jsonl
    (a line each, flushed: a SIGKILL cuts at most its last one), its output to processes/<pid>.log, the group's
    final parameters (from its rank 0) to group<g>.pt."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ReduceOp
    from torch.utils._pytree import tree_map  # as common/comm_counter.py uses torch's pytree
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    # a Ctrl-C is the launcher's to handle: it ends every process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = open(os.path.join(run_dir, "processes", f"{os.getpid()}.log"), "w", buffering=1)  # noqa: SIM115
    # this process's own output (torchft's HTTP log, c10d's timeouts) in its own file
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    logging.getLogger("torchft").setLevel(logging.ERROR)  # it logs every peer a failure took: expected here
    torch.set_num_threads(1)
    # this process's device: a GPU of its own where there are GPUs (refused up front if too few), else the CPU
    device = process_device(spare * cfg.dp_shard + rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    timeout = timedelta(seconds=cfg.step_timeout_s)
    # the group's own store: its FSDP ranks' rendezvous, and its torchft Managers' (rank 0 serves the quorum)
    address = os.path.join(run_dir, f"spare{spare}.store")
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with open(address + ".tmp", "w") as handle:
            handle.write(str(store.port))
        os.replace(address + ".tmp", address)
    else:
        while not os.path.exists(address):
            time.sleep(0.01)
        store = TCPStore("127.0.0.1", int(open(address).read()), is_master=False, timeout=timeout)
    corpus = load_corpus("", cfg.vocab_size, cfg.block_size, 0.1, cfg.dist_timeout_s)
    model = build_gpt(cfg.model_config(corpus["vocab_size"]), cfg.seed).to(device)
    if cfg.dp_shard > 1:
        dist.init_process_group(backend_for(device), store=PrefixStore("fsdp", store), rank=rank,
                                world_size=cfg.dp_shard, timeout=timedelta(seconds=cfg.dist_timeout_s))  # fmt: skip
        shard(model, cfg.dp_shard, device.type)
    optimizer = adamw(model.parameters(), cfg.lr, 0.1)
    parameters = list(model.parameters())
    # gradients exist from the start: a group that heals before its first backward has them
    for p in parameters:
        p.grad = torch.zeros_like(p)
    open(os.path.join(run_dir, f"spare{spare}.{rank}.ready"), "w").close()
    go = os.path.join(run_dir, f"spare{spare}.go")
    while not (os.path.exists(go) and open(go).read().strip()):
        time.sleep(0.01)
    group = int(open(go).read())
    # a file per process: a SIGKILL can cut its last line, never a line another process writes after it
    name = os.path.join(run_dir, "events", f"group{group}.{rank}-{os.getpid()}.jsonl")
    events = open(name, "w", buffering=1)  # noqa: SIM115

    def say(event: str, **fields) -> None:
        line = {"event": event, "group": group, "rank": rank, "pid": os.getpid(), "t": time.time(), **fields}
        events.write(json.dumps(line) + "\n")

    sent: list[int] = []  # bytes of every all-reduce this process made across the groups

    def state_dict() -> dict:  # this rank's shards, as plain tensors: what the checkpoint transport sends
        return {"model": {k: local(v) for k, v in model.state_dict().items()},
                "optim": tree_map(local, optimizer.state_dict())}  # fmt: skip

    def load_state_dict(state: dict) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                local(v).copy_(state["model"][k])
        optimizer.load_state_dict(like_parameters(state["optim"], optimizer))

    # this rank and the same rank of every other group: torchft's group of the device's backend (NCCL on GPUs)
    pg = (ProcessGroupNCCL if backend_for(device) == "nccl" else ProcessGroupGloo)(timeout=timeout)
    allreduce = pg.allreduce

    def counted_allreduce(tensors, opts):
        sent.extend(t.numel() * t.element_size() for t in tensors)
        return allreduce(tensors, opts)

    pg.allreduce = counted_allreduce
    # quorum_retries: a lighthouse call that failed (a peer died in it) is tried again
    manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
                      use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      store_addr="127.0.0.1", store_port=store.port, rank=rank, world_size=cfg.dp_shard,
                      lighthouse_addr=lighthouse, replica_id=f"group{group}", quorum_retries=1_000_000)  # fmt: skip
    say("started", replacement=spare >= cfg.replica_groups)
    while cfg.wrong_variant == "replacement_hangs" and spare >= cfg.replica_groups:
        time.sleep(1)  # the mistake: alive, silent, never in a quorum
    try:
        if cfg.algorithm == "diloco":
            train_diloco(cfg, manager, model, optimizer, corpus, say, group)
        else:
            train_ddp(
                cfg, manager, model, optimizer, parameters, corpus, say, ReduceOp, spare >= cfg.replica_groups
            )
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({k: v.cpu() for k, v in full.items()}, os.path.join(run_dir, f"group{group}.pt"))
        gradient_bytes = sum(local(p).numel() for p in parameters) * 8
        say("finished", allreduce_bytes=sent, gradient_bytes=gradient_bytes)
    finally:
        manager.shutdown(wait=False)


def shard(model, dp_shard: int, device_type: str) -> None:
    """FSDP2 over the group's ranks: each block, then the root. Gradients are reduce-scattered in float64 and
    summed, not averaged (divide factor 1): a unit of dp_shard micro-batches (one per rank) reaches each rank's
    shard as float32(the float64 sum of its micro-batches' gradients), what the one-process reference computes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh, policy = (
        init_device_mesh(device_type, (dp_shard,)),
        MixedPrecisionPolicy(reduce_dtype=torch.float64),
    )
    for module in [*model.blocks.values(), model]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
        module.set_gradient_divide_factor(1.0)


def like_parameters(optim_state: dict, optimizer) -> dict:
    """A peer's optimizer state (plain local tensors) made DTensors again where the parameter is one (the state's
    indices count the parameters group by group)."""
    from torch.distributed.tensor import DTensor

    parameters, state = [p for group in optimizer.param_groups for p in group["params"]], {}
    for index, values in optim_state["state"].items():
        p = parameters[int(index)]
        state[index] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                              stride=p.stride())
                        if isinstance(p, DTensor) and k != "step" else v for k, v in values.items()}  # fmt: skip
    return {**optim_state, "state": state}


def write_gradients(parameters, gradients: torch.Tensor) -> None:
    """Each parameter's gradient (its local shard, in place) from the flat float64 sum, rounded to float32 once."""
    offset = 0
    for p in parameters:
        shard = local(p.grad)
        shard.copy_(gradients[offset : offset + shard.numel()].view_as(shard))
        offset += shard.numel()


def clip_gradients(parameters, max_norm: float = 1.0) -> None:
    """clip_grad_norm_, with the norm summed in float64 over the group's shards: the same coefficient, to the bit,
    as the one-process reference's (torch's float32 sums of shard norms would differ in their last bits)."""
    import torch.distributed as dist

    squares = sum(local(p.grad).double().pow(2).sum() for p in parameters)
    if dist.is_initialized():
        dist.all_reduce(squares)
    coefficient = torch.tensor(max_norm / (squares.sqrt().item() + 1e-6)).clamp(max=1.0).float()
    for p in parameters:
        local(p.grad).mul_(coefficient)


def train_ddp(
    cfg: Config, manager, model, optimizer, parameters, corpus, say, ReduceOp, replacement: bool
) -> None:
    """Each committed step: the quorum (a group behind heals from a peer there), this group's units of the step's
    global batch (one micro-batch per FSDP rank each), their float64 gradient sum all-reduced across the groups with
    the rows' count and stream-position sums, then the optimizer only if every group of the quorum committed; else
    the same step again, with the same batch."""
    import torch.distributed as dist

    rank, R = dist.get_rank() if dist.is_initialized() else 0, cfg.dp_shard
    # attempts: the steps this process has tried (the data position of the own_data_position mistake)
    attempts, waited, units = 0, 0, cfg.global_batch_size // cfg.micro_batch_size // R
    while manager.current_step() < cfg.max_steps:
        before = manager.current_step()
        if not join_quorum(manager, say):
            continue
        step = manager.current_step()
        if step != before:
            say("healed", step=step, behind=step - before)  # state taken live from a peer: no checkpoint read
        elif replacement and step == 0:  # alone in its quorum, no peer to heal from: never train from scratch
            waited += 1
            if waited == 1:
                say("waiting_for_a_peer")
            time.sleep(0.1)
            continue
        replacement = False
        batch = attempts if cfg.wrong_variant == "own_data_position" else step
        attempts += 1
        groups, group_rank = manager.num_participants(), manager.participating_rank()
        shares = micro_batches_of(units, groups, group_rank) if group_rank is not None else range(0)
        micro = [unit * R + rank for unit in shares]
        x, y = batch_of(corpus, cfg, batch)
        gradients, loss_sum = accumulate(model, parameters, x, y, micro, cfg)
        rows = torch.tensor(
            [m * cfg.micro_batch_size + i for m in micro for i in range(cfg.micro_batch_size)]
        )
        positions = rows.double() + batch * cfg.global_batch_size
        tally = torch.stack([torch.tensor(float(len(rows)), dtype=torch.float64), positions.sum(),
                             (positions**2).sum(), torch.tensor(loss_sum, dtype=torch.float64)])  # fmt: skip
        tally = tally.to(gradients.device)  # all-reduced with the gradients: on the group's device
        if R > 1:
            dist.all_reduce(tally)  # the group's rows, from each of its ranks
        reduce_op = ReduceOp.AVG if cfg.wrong_variant == "average_over_groups" else ReduceOp.SUM
        manager.allreduce(gradients, reduce_op=reduce_op).wait()
        manager.allreduce(tally, reduce_op=ReduceOp.SUM).wait()
        write_gradients(parameters, gradients)
        clip_gradients(parameters)
        if manager.should_commit():
            optimizer.step()
            count, position_sum, position_squares, loss = tally.tolist()
            say("commit", step=step, batch=batch, groups=groups, rank_of_group=group_rank, count=count,
                position_sum=position_sum, position_squares=position_squares, loss=loss)  # fmt: skip
        else:
            say("redo", step=step)
        optimizer.zero_grad(set_to_none=False)


def join_quorum(manager, say) -> bool:
    """manager.start_quorum(), a failure said and retried a moment later. A quorum fails when a peer died in it (its
    lighthouse call or a healing source timed out). torchft 0.2.0 keeps the failed quorum's future and re-raises its
    error from every later start_quorum (measured: 4 million times in 90 s, the group never back): it is dropped."""
    try:
        manager.start_quorum()
        return True
    except Exception as error:
        manager._quorum_future = None
        say("quorum_failed", step=manager.current_step(), error=str(error).splitlines()[0][:200])
        time.sleep(0.1)
        return False


def train_diloco(cfg: Config, manager, model, inner, corpus, say, group: int) -> None:
    """torchft's DiLoCo: inner AdamW steps on this group's share of each step's batch (its share as if every group
    were alive), every --sync_every an outer Nesterov step on the groups' averaged parameter change. Inner step i
    after sync s reads global batch s x H + i: a healed group reads on where its peer is, and a window whose sync
    failed is trained again on the same batches."""
    from torchft.local_sgd import DiLoCo

    outer = torch.optim.SGD(model.parameters(), lr=cfg.outer_lr, momentum=0.9, nesterov=True)
    share = micro_batches_of(cfg.global_batch_size // cfg.micro_batch_size, cfg.replica_groups, group)
    rows = slice(share.start * cfg.micro_batch_size, share.stop * cfg.micro_batch_size)
    local_steps, synced = 0, 0
    with DiLoCo(manager, [model], inner, outer, sync_every=cfg.sync_every):
        while manager.current_step() * cfg.sync_every < cfg.max_steps:
            if manager.current_step() != synced:  # a sync happened (or this group healed to a later one)
                synced, local_steps = manager.current_step(), 0
            x, y = batch_of(corpus, cfg, synced * cfg.sync_every + local_steps % cfg.sync_every)
            device = next(model.parameters()).device
            loss = lm_loss(model(x[rows].to(device)), y[rows].to(device))
            loss.backward()
            inner.step()  # DiLoCo's hook: on every --sync_every-th, the quorum, the outer step
            inner.zero_grad()
            local_steps += 1
            if manager.current_step() > synced:
                say("commit", step=synced, groups=manager.num_participants(), loss=loss.item())


# ------------------------------------------------------------------------------------------------ the run
class Group:
    """The processes in one group's place (its FSDP ranks; one with --dp_shard 1). Its rank 0 speaks for it."""

    def __init__(self, processes: list):
        self.processes = processes

    @property
    def pid(self) -> int:
        return self.processes[0].pid

    def is_alive(self) -> bool:
        return any(p.is_alive() for p in self.processes)

    def kill(self) -> None:  # SIGKILL, the whole group
        for p in self.processes:
            p.kill()
        for p in self.processes:
            p.join()


class Injector:
    """Starts the replica groups and a hot spare per failure, kills a group (SIGKILL, every process of it) at each
    chosen moment, gives its place to a spare, gives up on a group that makes no progress, and waits for every
    group's last process to end. It reads the groups' progress from their event files (a killed process may have
    held a lock on anything shared: files are safe)."""

    def __init__(self, cfg: Config, lighthouse: str, run_dir: str):
        self.cfg, self.lighthouse, self.run_dir = cfg, lighthouse, run_dir
        # a fork server that has imported torch: each process starts in a fraction of a second, not the ~2 s of a
        # fresh interpreter (torchft is imported in each process: its Rust runtime must not be forked)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["torch", "torch.distributed", "common.gpt", "common.text"])
        self.spares: dict[int, Group] = {}  # spare number -> its processes (every one started)
        self.current: dict[int, Group] = {}  # group -> the processes in its place now
        self.free: list[int] = []  # spares started, no place yet
        # every spare given a group's place: group, pid (of rank 0), pids, t, why
        self.placed: list[dict] = []
        self.kills: list[dict] = []
        self.given_up: list[dict] = []
        self.grace_until = 0.0  # no group is given up on before this (the others' time after one was)
        self.started_pids: list[int] = []  # every process this run started, spares never placed included

    def start_spare(self) -> None:
        spare = len(self.spares)
        args = (self.cfg, self.lighthouse, self.run_dir, os.getpid())
        self.spares[spare] = Group([self.context.Process(target=replica_group, args=(spare, rank, *args))
                                    for rank in range(self.cfg.dp_shard)])  # fmt: skip
        for process in self.spares[spare].processes:
            process.start()
            self.started_pids.append(process.pid)
        self.free.append(spare)

    def is_ready(self, spare: int) -> bool:
        return all(
            os.path.exists(os.path.join(self.run_dir, f"spare{spare}.{r}.ready"))
            for r in range(self.cfg.dp_shard)
        )

    def place(self, group: int, why: str) -> None:
        """The oldest spare takes `group`'s place (waiting for it to be ready if a failure came too soon)."""
        spare = self.free.pop(0)
        self.wait(lambda events: self.is_ready(spare), f"spare {spare} getting ready")
        with open(os.path.join(self.run_dir, f"spare{spare}.go"), "w") as handle:
            handle.write(str(group))
        self.current[group] = self.spares[spare]
        self.placed.append({"group": group, "pid": self.spares[spare].pid, "t": time.time(), "why": why,
                            "pids": [p.pid for p in self.spares[spare].processes]})  # fmt: skip

    def last_progress(self, events: list[dict], pid: int) -> float:
        """When the group last moved on: its placement, a heal, a committed step."""
        placed = next(p["t"] for p in self.placed if p["pid"] == pid)
        return max(
            [placed, *(e["t"] for e in events if e["pid"] == pid and e["event"] in ("healed", "commit"))]
        )

    def watch(self) -> list[dict]:
        """When a group has made no progress for --rejoin_timeout_s, give up on one (named; the others carry on)
        and give the others that long again: a live replica that never joins a quorum stalls everyone's (torchft's
        lighthouse waits for half of the heartbeating replicas). Fail the run when no group has committed a step
        for twice that long. Returns the events so far."""
        events, now = read_events(self.run_dir), time.time()
        alive = {g: p for g, p in self.current.items() if p.is_alive()}
        stuck = {g: now - self.last_progress(events, p.pid) for g, p in alive.items()}
        stuck = {g: seconds for g, seconds in stuck.items() if seconds > self.cfg.rejoin_timeout_s}
        # who to give up on: a replacement that never healed though it had time to (a survivor blocked by it has
        # trained before; its clock may run out first), else the stuck group silent longest
        placed = {p["pid"]: p["t"] for p in self.placed}
        silent = {g: now - max((e["t"] for e in events if e["pid"] == p.pid), default=placed[p.pid])
                  for g, p in alive.items()}  # fmt: skip
        never = [g for g, p in alive.items() if now - placed[p.pid] > self.cfg.step_timeout_s
                 and not any(e["pid"] == p.pid and e["event"] in ("healed", "commit") for e in events)]  # fmt: skip
        worst = max(never or stuck, key=silent.get) if stuck else None
        if worst is not None and now > self.grace_until:
            self.current[worst].kill()  # a group that never comes back: named, the survivors carry on
            waited = now - self.last_progress(events, self.current[worst].pid)
            self.given_up.append({"group": worst, "pid": self.current[worst].pid, "no_progress_s": round(waited, 1),
                                  "pids": [p.pid for p in self.current[worst].processes]})  # fmt: skip
            self.grace_until = now + self.cfg.rejoin_timeout_s
        commits = [e["t"] for e in events if e["event"] == "commit"] or [self.placed[0]["t"]]
        if now - max(*commits, self.grace_until - self.cfg.rejoin_timeout_s) > 2 * self.cfg.rejoin_timeout_s:
            raise TimeoutError(f"no group committed a step for {now - max(commits):.0f} s")
        return events

    def wait(self, until, what: str) -> None:
        """Until `until(events)` holds, the event files read once a round (and the groups watched, once placed)."""
        while not until(self.watch() if self.current else read_events(self.run_dir)):
            if self.current and not any(p.is_alive() for p in self.current.values()):
                raise TimeoutError(f"{what}: every group has ended")
            time.sleep(0.05)

    def run(self, say) -> None:
        cfg, rng = self.cfg, random.Random(self.cfg.seed)
        # the groups and a hot spare per failure, all started now: a replacement takes a place in a fraction of a
        # second (a cluster's hot spare) instead of a cold start's seconds, which at this model's ~25 ms a step
        # would outlast the run
        for _ in range(cfg.replica_groups + cfg.failures):
            self.start_spare()
        self.wait(
            lambda events: all(self.is_ready(spare) for spare in range(cfg.replica_groups)),
            "the groups getting ready",
        )
        for group in range(cfg.replica_groups):  # all at once: none trains the first steps alone
            self.place(group, "initial")
        total = cfg.max_steps // cfg.sync_every if cfg.algorithm == "diloco" else cfg.max_steps
        # the first failure after 5 % of the run, the others spread over its first 60 %
        at = max(1, total // 20)
        for index in range(cfg.failures):
            recovering = None  # the group whose replacement is healing when this failure hits
            if index % 2 == 1:  # the previous failure's replacement has its place, not yet healed
                recovering = self.kills[-1]["group"]
                self.wait(
                    lambda events, r=self.current[recovering].pid: has(events, r, "started"),
                    "a replacement's start",
                )
                time.sleep(rng.uniform(0, 0.1))  # in its quorum, or fetching a peer's state
                # the recovering group itself, or (3 groups or more: a healthy source stays) a healthy peer
                peers = sorted(g for g, p in self.current.items() if p.is_alive() and g != recovering)
                group = recovering if index % 4 == 1 or len(peers) < 2 else rng.choice(peers)
            else:  # every group back and training, then any moment of a step: quorum, forward, all-reduce
                at += rng.randint(1, max(1, total * 3 // (5 * cfg.failures)))
                self.wait(lambda events, a=at: progress(events) >= a and all(has(events, p.pid, "commit", "finished")
                          for p in self.current.values() if p.is_alive()), f"step {at}")  # fmt: skip
                time.sleep(rng.uniform(0, 0.05))
                group = rng.choice(sorted(g for g, p in self.current.items() if p.is_alive()))
            # was the recovering group still healing at the kill? (it may have been quicker than the injector)
            events = read_events(self.run_dir)
            healing = recovering is not None and not has(
                events, self.current[recovering].pid, "healed", "commit"
            )
            processes = self.current[group]
            processes.kill()
            self.kills.append({"group": group, "pid": processes.pid, "pids": [p.pid for p in processes.processes],
                               "t": time.time(), "step": progress(events), "during_recovery": healing})  # fmt: skip
            say(f"step {progress(events)}: killed group {group} (pid {processes.pid})"
                + (f" while group {recovering} was still recovering" if healing else ""))  # fmt: skip
            self.place(group, f"replaces group {group} (failure {index + 1})")
        while any(p.is_alive() for p in self.current.values()):
            self.watch()
            time.sleep(0.1)

    def end_all(self) -> None:
        """Every process this run started is gone when it ends (Ctrl-C, a timeout, a crash included)."""
        for spare in self.spares.values():
            for process in spare.processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=10)


def progress(events: list[dict]) -> int:
    """Committed steps (or DiLoCo syncs) so far: the most any group has logged."""
    return max((e["step"] + 1 for e in events if e["event"] == "commit"), default=0)


def has(events: list[dict], pid: int, *kinds: str) -> bool:
    return any(e["pid"] == pid and e["event"] in kinds for e in events)


def read_events(run_dir: str) -> list[dict]:
    events = []
    for name in sorted(os.listdir(os.path.join(run_dir, "events"))):
        # a last line a kill cut short is not an event
        with open(os.path.join(run_dir, "events", name)) as handle:
            events += [json.loads(line) for line in handle if line.endswith("\n")]
    return sorted(events, key=lambda e: e["t"])


@contextlib.contextmanager
def rust_log(level: str):
    """torchft's lighthouse and managers (Rust) log every quorum at INFO; RUST_LOG quiets them, for this run and the
    processes it starts (they inherit it), and is restored after."""
    saved = os.environ.get("RUST_LOG")
    os.environ["RUST_LOG"] = level
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RUST_LOG", None)
        else:
            os.environ["RUST_LOG"] = saved


def start_lighthouse(cfg: Config):
    """torchft's lighthouse: a quorum as soon as one group is there (min_replicas 1), waiting a moment for the others
    (join_timeout), and a group that stops sending heartbeats for a second is out of the next quorum."""
    from torchft.coordination import LighthouseServer

    try:
        return LighthouseServer(bind=f"[::]:{cfg.lighthouse_port}", min_replicas=1, join_timeout_ms=200,
                                quorum_tick_ms=20, heartbeat_timeout_ms=1000)  # fmt: skip
    except Exception as error:  # a port in use: the Rust server's bind error
        raise UsageError(f"--lighthouse_port {cfg.lighthouse_port}: the lighthouse cannot listen there "
                         f"({str(error).splitlines()[0][:200]}); pass another, or 0 for a free one") from None  # fmt: skip


def train_one_process(cfg: Config, corpus: dict) -> dict:
    """The reference: one process, the same initial weights, every step the same global batch's micro-batches
    accumulated (gradient accumulation): each unit of --dp_shard micro-batches summed in float64 and rounded to
    float32 (what FSDP's float64 reduce-scatter hands a shard), the units added in float64; clipped and stepped as
    the groups do."""
    device = process_device(0)  # the groups' kind of device: the same kernels, the same rounding
    model = build_gpt(cfg.model_config(corpus["vocab_size"]), cfg.seed).to(device)
    optimizer = adamw(model.parameters(), cfg.lr, 0.1)
    parameters = list(model.parameters())
    for p in parameters:
        p.grad = torch.zeros_like(p)
    for step in range(cfg.max_steps):
        x, y = batch_of(corpus, cfg, step)
        gradients = torch.zeros(sum(p.numel() for p in parameters), dtype=torch.float64, device=device)
        for unit in range(cfg.global_batch_size // cfg.micro_batch_size // cfg.dp_shard):
            micro = range(unit * cfg.dp_shard, (unit + 1) * cfg.dp_shard)
            gradients += accumulate(model, parameters, x, y, micro, cfg)[0].float().double()
        write_gradients(parameters, gradients)
        clip_gradients(parameters)
        optimizer.step()
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}


@torch.no_grad()
def validation_loss(cfg: Config, corpus: dict, state: dict) -> float:
    model = build_gpt(cfg.model_config(corpus["vocab_size"]), cfg.seed)
    model.load_state_dict(state)
    x, y = corpus["val"]
    losses = [
        lm_loss(model(x[i : i + 64]), y[i : i + 64]).item() * len(x[i : i + 64]) for i in range(0, len(x), 64)
    ]
    return sum(losses) / len(x)


def run(cfg: Config) -> int:
    torch.set_num_threads(1)
    # the token cache, built once
    corpus = load_corpus("", cfg.vocab_size, cfg.block_size, 0.1, cfg.dist_timeout_s)
    with rust_log("warn"):  # before the lighthouse starts: its logger reads RUST_LOG once
        lighthouse = start_lighthouse(cfg)  # first: a port in use is refused before anything is written
    try:
        with start_run(cfg, EXPERIMENT, data_identity=corpus["identity"]) as session, rust_log("warn"):
            for folder in ("processes", "events"):
                os.makedirs(os.path.join(session.output_dir, folder), exist_ok=True)
            injector = Injector(cfg, lighthouse.address(), session.output_dir)
            started = time.time()
            try:
                shards = f" of {cfg.dp_shard} FSDP ranks" if cfg.dp_shard > 1 else ""
                session.print(f"{cfg.replica_groups} replica groups{shards} ({cfg.algorithm}), {cfg.failures} "
                              f"failures to inject, lighthouse at {lighthouse.address()}")  # fmt: skip
                injector.run(session.print)
            except TimeoutError as error:
                raise UsageError(f"the run did not end: {error} (see {session.output_dir}/events)") from None
            finally:
                injector.end_all()
            report(session, cfg, corpus, injector, read_events(session.output_dir), time.time() - started)
    finally:
        lighthouse.shutdown()
    return session.exit_code


def report(
    session, cfg: Config, corpus: dict, injector: Injector, events: list[dict], seconds: float
) -> None:
    """The checks and metrics, from the groups' event files (their rank 0's speak for them) and final parameters."""
    finished = [e for e in events if e["event"] == "finished"]  # every rank's
    events = [e for e in events if e["rank"] == 0]
    commits = [e for e in events if e["event"] == "commit"]
    by_step: dict[int, list[dict]] = {}
    for e in commits:
        by_step.setdefault(e["step"], []).append(e)
    total = cfg.max_steps // cfg.sync_every if cfg.algorithm == "diloco" else cfg.max_steps
    # a failure survived: its group back (a later process of it healed or committed) and training went on
    back = [any(e["group"] == k["group"] and e["t"] > k["t"] and e["event"] in ("healed", "commit") for e in events)
            and any(e["t"] > k["t"] for e in commits) for k in injector.kills]  # fmt: skip
    ended = {pid for k in [*injector.kills, *injector.given_up] for pid in k["pids"]} | {
        f["pid"] for f in finished
    }
    on_their_own = [pid for p in injector.placed for pid in p["pids"] if pid not in ended]
    lost = [
        f"group {k['group']} (killed at step {k['step']})"
        for k, ok in zip(injector.kills, back, strict=True)
        if not ok
    ]
    session.check("failures_survived", sum(back) == len(injector.kills) == cfg.failures and not on_their_own
                  and not injector.given_up,
                  f"{cfg.failures} failures to inject, {len(injector.kills)} injected, {sum(back)} survived (the group "
                  f"back from a peer, training on); never back: {', '.join(lost) or 'none'}; given up on: "
                  f"{injector.given_up or 'none'}; processes that ended on their own: {on_their_own or 'none'}")  # fmt: skip
    recover_s = []
    for k in injector.kills:
        again = [e["t"] for e in commits if e["group"] == k["group"] and e["t"] > k["t"]]
        recover_s.append(round(min(again) - k["t"], 2) if again else None)
    session.metrics.update(failures_injected=len(injector.kills), failures_survived=sum(back),
                           survivor_restarts=len(injector.placed) - cfg.replica_groups - len(injector.kills),
                           steps_redone=sum(e["event"] == "redo" for e in events), recover_s=recover_s,
                           kills=injector.kills, processes=injector.placed, given_up=injector.given_up,
                           started_pids=injector.started_pids,
                           seconds=round(seconds, 1), committed_steps=len(by_step))  # fmt: skip
    samples_per_commit = cfg.global_batch_size * (cfg.sync_every if cfg.algorithm == "diloco" else 1)
    session.metrics["samples_per_s"] = round(len(by_step) * samples_per_commit / seconds, 1)
    # throughput from one step's first commit to the next's, with every group in the quorum and with fewer
    first = {step: min(by_step[step], key=lambda e: e["t"]) for step in by_step}
    paced = [
        (first[s + 1]["t"] - first[s]["t"], first[s + 1]["groups"]) for s in sorted(first) if s + 1 in first
    ]
    for name, keep in (
        ("full", lambda g: g == cfg.replica_groups),
        ("degraded", lambda g: g < cfg.replica_groups),
    ):
        spans = [span for span, groups in paced if keep(groups)]
        session.metrics[f"samples_per_s_{name}"] = (
            round(len(spans) * samples_per_commit / sum(spans), 1) if spans else None
        )
        session.metrics[f"{name}_steps"] = sum(keep(first[s]["groups"]) for s in first)
    states = {name: torch.load(os.path.join(session.output_dir, name)) for name in sorted(os.listdir(session.output_dir))
              if name.startswith("group") and name.endswith(".pt")}  # fmt: skip
    reference = train_one_process(cfg, corpus)
    parameters = parameter_count(cfg.model_config(corpus["vocab_size"]))
    sent = [sum(e["allreduce_bytes"]) for e in finished if e["rank"] == 0]
    session.metrics["allreduce_bytes_per_group"] = sent
    if cfg.algorithm == "ddp":
        wrong = [s for s in range(total) if s not in by_step or any((e["count"], e["position_sum"],
                 e["position_squares"]) != (cfg.global_batch_size, *position_sums(s, cfg)) for e in by_step[s])]  # fmt: skip
        session.check("every_sample_once", not wrong,
                      f"{total - len(wrong)} of {total} committed steps trained their global batch's "
                      f"{cfg.global_batch_size} samples exactly once (count and stream-position sums all-reduced "
                      "with the gradients)" + (f"; wrong or missing: steps {wrong[:10]}" if wrong else ""))  # fmt: skip
        worst = max((max((state[k] - reference[k]).abs().max().item() for k in reference) for state in states.values()),
                    default=math.inf)  # fmt: skip
        session.parity_check("matches_one_process", worst, cfg.param_atol,
                             f"{len(states)} finished groups' parameters after {cfg.max_steps} steps vs one process on "
                             "the same global batches, max |difference|")  # fmt: skip
        # every attempt all-reduces the float64 gradient sum (of the rank's shard) and 4 float64 tallies, nothing else
        session.metrics["allreduce_bytes_match_theory"] = bool(finished) and all(
            set(e["allreduce_bytes"]) <= {e["gradient_bytes"], 32} for e in finished
        )
    else:
        session.skip_check(
            "every_sample_once",
            "DiLoCo: a group killed mid-window loses its inner steps since the "
            "last sync with it (its replacement trains that window's batches again)",
        )
        session.skip_check("matches_one_process", "DiLoCo is another algorithm (local steps, an outer optimizer): it "
                           "is not one process's training, failures or not")  # fmt: skip
        # DDP (torch's, float32 gradients) sends one gradient all-reduce per step for the same tokens
        session.metrics["ddp_bytes_same_tokens"] = cfg.max_steps * parameters * 4
        if sent:
            session.metrics["bytes_vs_ddp"] = round(max(sent) / session.metrics["ddp_bytes_same_tokens"], 4)
        session.metrics["val_loss_ddp"] = validation_loss(cfg, corpus, reference)
    if states:
        session.metrics["val_loss"] = validation_loss(cfg, corpus, next(iter(states.values())))
    plot_timeline(cfg, events, injector, os.path.join(session.output_dir, "timeline.png"))
    session.print(f"{len(injector.kills)} failures injected, {sum(back)} survived (recovered in {recover_s} s), "
                  f"{session.metrics['steps_redone']} steps redone, {len(states)} groups finished, "
                  f"val_loss {session.metrics.get('val_loss', float('nan')):.4f}")  # fmt: skip


def position_sums(step: int, cfg: Config) -> tuple[float, float]:
    positions = torch.arange(cfg.global_batch_size, dtype=torch.float64) + step * cfg.global_batch_size
    return positions.sum().item(), (positions**2).sum().item()


def plot_timeline(cfg: Config, events: list[dict], injector: Injector, path: str) -> None:
    """The run as it happened: each committed step's loss and the groups in its quorum, each failure (a red line)
    and each heal (a green one), against seconds from the start."""
    from matplotlib.figure import Figure

    commits = [e for e in events if e["event"] == "commit"]
    if not commits:
        return
    start = injector.placed[0]["t"]
    figure = Figure(figsize=(10, 5), layout="constrained")
    loss_axis, groups_axis = figure.subplots(2, 1, sharex=True)
    loss_axis.plot([e["t"] - start for e in commits], [e["loss"] for e in commits], ".", markersize=2)
    shards = f" of {cfg.dp_shard} FSDP ranks" if cfg.dp_shard > 1 else ""
    loss_axis.set(ylabel="loss of the committed step", title=f"{cfg.replica_groups} replica groups{shards}, "
                  f"{len(injector.kills)} failures ({cfg.algorithm})")  # fmt: skip
    groups_axis.step([e["t"] - start for e in commits], [e["groups"] for e in commits], where="post")
    groups_axis.set(ylabel="groups in the quorum", xlabel="seconds from the first group's start",
                    ylim=(0, cfg.replica_groups + 0.5))  # fmt: skip
    for axis in (loss_axis, groups_axis):
        for k in injector.kills:
            axis.axvline(k["t"] - start, color="tab:red", linewidth=1)
        for e in (e for e in events if e["event"] == "healed"):
            axis.axvline(e["t"] - start, color="tab:green", linewidth=1, linestyle="--")
    groups_axis.plot([], [], color="tab:red", label="a group killed")
    groups_axis.plot([], [], color="tab:green", linestyle="--", label="a group healed from a peer")
    groups_axis.legend(loc="lower right", fontsize=8)
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
