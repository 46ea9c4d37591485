"""Fault tolerance of the replicated dimension (torchft), a mode of train_gpt: --fault_tolerant.

Each replica group is one train_gpt launch (its ranks shard or split the model inside the group: --dp_shard,
--tp), and torchft replicates across the groups, as torchtitan's FaultTolerantTrainer wires it: a Manager on every
rank, whose process group (rank r of every live group) is the replicate dimension, a lighthouse that forms a quorum
of the live groups before every step, `should_commit` gating the optimizer step, and a group that falls behind (a
replacement) healing from a live peer's state over torchft's checkpoint transport, never from disk.

What a step is here: step s trains the SAME global batch whatever groups are alive (samples s x B ... s x B + B - 1
of the run's one stream; B = per-rank rows x accumulation x the group's data-parallel ranks x --replica_groups). Its
units (a micro-batch of every data-parallel rank of a group) are shared out among the groups in the quorum, and the
Job's exact accumulation (strategies/job.py) adds each micro-batch's gradient in float64; the groups' sums are
all-reduced (SUM) in float64 and rounded to float32 once. So the gradient does not depend on how many groups shared
the step or which computed what, and a step a failure interrupts is not committed and is redone with the same
batch: failures change the time, never the result (train_gpt's matches_single_process, 0.0 apart for replicas and
FSDP inside a group).

--ft_algorithm diloco is torchft's DiLoCo instead: --sync_every inner AdamW steps on the group's own share of each
batch, then an outer Nesterov step on the groups' averaged parameter change. Another algorithm: it is not compared
with one process (the check says why).

Theory: nothing held beyond the group's own layout; across the groups every attempt all-reduces the rank's float64
gradient sum and 4 float64 tallies (rows, the sums of their stream positions and squares, the loss), outside the
forward and backward that communication_volume counts (experiments/fault_tolerance.py checks those bytes).
Not built: context parallelism, a mixture of experts or a pipeline inside a group (exact accumulation needs each micro-batch's
gradient on its own; refused in one line), DeepSpeed's engine, a resume from a checkpoint (the groups heal from
each other instead).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common.config import MAX_TIMEOUT_S, flag, require
from common.device import backend_for
from common.moe import local
from strategies.layout import Mistake
from strategies.piece import Context, GatesSteps, Measures, Piece, Plan, RunsTheStep, having

ALGORITHMS = ("ddp", "diloco")


def _ddp(plan) -> bool:
    return bool(plan.args.fault_tolerant) and plan.args.ft_algorithm == "ddp"


MISTAKES = {
    "own_data_position": Mistake(
        "torchft's own loop: each group reads its own data, a batch per attempt, whatever was committed: a failed "
        "step's batch is skipped, and a replacement reads from the first batch",
        _ddp,
    ),
    "average_over_groups": Mistake(
        "torchft's default all-reduce (AVG) of gradients whose losses are already divided by the whole batch: "
        "every step's gradient divided by the number of live groups",
        _ddp,
    ),
    "replacement_hangs": Mistake(
        "a replacement takes its place and hangs before its first quorum: the group never comes back",
        lambda plan: bool(plan.args.fault_tolerant and plan.args.ft_replacement),
    ),
}


@dataclass
class Flags:
    fault_tolerant: bool = flag(False, "train as one replica group of a fault-tolerant run (torchft): the groups "
                                "replicate the model across a lighthouse's quorum, a lost group is replaced while "
                                "the others go on (experiments/fault_tolerance.py runs a whole one)")  # fmt: skip
    replica_groups: int = flag(1, "with --fault_tolerant: the replica groups a global batch is shared among (B = "
                               "per-rank rows x accumulation x the group's data-parallel ranks x this)")  # fmt: skip
    replica_id: int = flag(0, "with --fault_tolerant: this group's index, 0 .. --replica_groups - 1 (its name in "
                           "the quorum; DiLoCo's share of each batch)")  # fmt: skip
    lighthouse: str = flag(
        "", "with --fault_tolerant: torchft's lighthouse address (default: $TORCHFT_LIGHTHOUSE)"
    )
    ft_algorithm: str = flag("ddp", "with --fault_tolerant: ddp (gradients all-reduced every step, exactly) or "
                             "diloco (torchft's DiLoCo)", choices=ALGORITHMS)  # fmt: skip
    sync_every: int = flag(10, "with --ft_algorithm diloco: inner steps between the groups' syncs (H)")
    outer_lr: float = flag(
        0.7, "with --ft_algorithm diloco: the outer Nesterov SGD's learning rate (DiLoCo's 0.7)"
    )
    ft_timeout_s: float = flag(5.0, "with --fault_tolerant: torchft's timeout of a quorum, a collective and a state "
                               "transfer: how long survivors wait for a dead peer before a new quorum")  # fmt: skip
    ft_replacement: bool = flag(False, "with --fault_tolerant: this group replaces a lost one: it never trains from the "
                                "start alone, it waits for a peer to heal from")  # fmt: skip
    ft_start_file: str = flag("", "with --fault_tolerant: a hot spare: start up, write <this>.<rank>.ready, then wait "
                              "for this file (holding the group's index) before joining the quorum")  # fmt: skip


def refuse(plan: Plan) -> None:
    args, layout = plan.args, plan.layout
    if not args.fault_tolerant:
        used = [
            f"--{name}" for name in ("ft_replacement", "ft_start_file", "lighthouse") if getattr(args, name)
        ]
        require(not used and args.replica_groups == 1, f"{', '.join(used) or '--replica_groups'} is for a "
                "fault-tolerant run: add --fault_tolerant")  # fmt: skip
        return
    require(args.replica_groups >= 1, f"--replica_groups must be >= 1, got {args.replica_groups}")
    require(0 <= args.replica_id < args.replica_groups,
            f"--replica_id {args.replica_id}: must be in [0, {args.replica_groups - 1}] (--replica_groups)")  # fmt: skip
    require(args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"),
            "--fault_tolerant needs torchft's lighthouse: pass --lighthouse HOST:PORT or set TORCHFT_LIGHTHOUSE")  # fmt: skip
    require(0 < args.ft_timeout_s <= MAX_TIMEOUT_S, f"--ft_timeout_s must be in (0, {MAX_TIMEOUT_S}], got "
            f"{args.ft_timeout_s}")  # fmt: skip
    require(args.sync_every >= 1 and args.outer_lr > 0,
            f"--sync_every ({args.sync_every}) and --outer_lr ({args.outer_lr}) must be positive")  # fmt: skip
    require(plan.engine_stage is None, "--fault_tolerant with DeepSpeed's engine: not built (use --dp_shard)")
    require(layout.dp_replicate == 1, f"--dp_replicate {layout.dp_replicate} with --fault_tolerant: torchft owns the "
            "replicated dimension (the groups: --replica_groups); shard inside a group with --dp_shard")  # fmt: skip
    require(not getattr(args, "resume_from_checkpoint", ""), "--resume_from_checkpoint with --fault_tolerant: "
            "not built; a lost group heals from a live peer instead")  # fmt: skip
    inside = sorted(plan.traits & {"collectives_in_attention", "routes_tokens"})
    whole_step = [p.name for p in having(plan.on, RunsTheStep)]
    require(not inside and not whole_step, f"--fault_tolerant with {', '.join(inside + whole_step)} inside a group: "
            "not built (exact accumulation takes each micro-batch's gradient on its own); use --dp_shard and --tp")  # fmt: skip


def share_of(units: int, groups: int, index: int) -> range:
    """A group's contiguous units of a step: as even as can be, the first groups one more."""
    per, extra = divmod(units, groups)
    start = index * per + min(index, extra)
    return range(start, start + per + (index < extra))


class FaultTolerance:
    """A rank's torchft Manager and what it does each step: the quorum (and a heal), the group's share of the
    step's units, the all-reduce across the groups, the commit. Its events go, a line each and flushed (a SIGKILL
    cuts at most the last), to <run folder>/ft_events/rank<r>.jsonl."""

    def __init__(self, ctx: Context):
        self.ctx, self.args = ctx, ctx.args
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.manager = None
        self.sent: list[int] = []  # bytes of every all-reduce across the groups
        self.attempts = self.redone = 0  # steps tried (the own_data_position mistake reads its batch by it)
        self.waiting = False  # a replacement alone in its quorum, said once
        self.replacement = self.args.ft_replacement  # until it has healed from a peer
        self.group = self.args.replica_id
        self.synced = self.inner = 0  # DiLoCo: the syncs seen, the inner steps since the last
        folder = os.path.join(ctx.accelerator.project_dir or ".", "ft_events")
        os.makedirs(folder, exist_ok=True)
        self.events = open(os.path.join(folder, f"rank{self.rank}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def say(self, event: str, **fields) -> None:
        line = {"event": event, "group": self.group, "rank": self.rank, "pid": os.getpid(), "t": time.time()}
        self.events.write(json.dumps({**line, **fields}) + "\n")

    # ---------------------------------------------------------------------------------------- start
    def start(self, job) -> None:
        """Once, before the first quorum: a hot spare waits to be placed; the Manager (rank 0 of the group serves
        the group's quorum to the lighthouse)."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        args = self.args
        if args.ft_start_file:
            open(f"{args.ft_start_file}.{self.rank}.ready", "w").close()
            while not (os.path.exists(args.ft_start_file) and open(args.ft_start_file).read().strip()):
                time.sleep(0.01)
            self.group = int(open(args.ft_start_file).read())
        logging.getLogger("torchft").setLevel(
            logging.ERROR
        )  # it logs every peer a failure took: expected here
        timeout = timedelta(seconds=args.ft_timeout_s)
        device = self.ctx.device
        pg = (ProcessGroupNCCL if backend_for(device) == "nccl" else ProcessGroupGloo)(timeout=timeout)
        allreduce = pg.allreduce

        def counted_allreduce(tensors, opts):
            self.sent.extend(t.numel() * t.element_size() for t in tensors)
            return allreduce(tensors, opts)

        pg.allreduce = counted_allreduce
        if (
            self.world > 1
        ):  # the group's own store (its rank 0's, which torch.distributed made): torchtitan's way
            address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            address, port = "127.0.0.1", self.store.port
        model, optimizer = job.model, job.optimizer
        self.manager = Manager(pg=pg, load_state_dict=lambda state: load_local_state(model, optimizer, state),
                               state_dict=lambda: local_state(model, optimizer), min_replica_size=1,
                               use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
                               connect_timeout=timeout, store_addr=address, store_port=port, rank=self.rank,
                               world_size=self.world, lighthouse_addr=args.lighthouse or None,
                               replica_id=f"group{self.group}", quorum_retries=1_000_000)  # fmt: skip
        self.say("started", replacement=args.ft_replacement)
        while args.wrong_variant == "replacement_hangs" and args.ft_replacement:
            time.sleep(1)  # the mistake: alive, silent, never in a quorum
        if args.ft_algorithm == "diloco":
            from torchft.local_sgd import DiLoCo

            outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True)
            inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper steps the real one
            self.diloco = DiLoCo(self.manager, [model], inner, outer, sync_every=args.sync_every)
            self.diloco.__enter__()

    def begin(self, job, step: int) -> tuple[int, int] | None:
        """The step this group trains now and the global batch it reads, after the quorum (a group behind heals
        there: its step moves to its peer's); None: no quorum now (a peer died in it), ask again."""
        if self.manager is None:
            self.start(job)
        manager = self.manager
        if self.args.ft_algorithm == "diloco":
            # inner step i after sync s reads global batch s x H + i: a healed group reads on where its peer is, and a
            # window whose sync failed is trained again on the same batches
            if manager.current_step() != self.synced:
                self.synced, self.inner = manager.current_step(), 0
            at = self.synced * self.args.sync_every + self.inner % self.args.sync_every
            return at, at
        before = manager.current_step()
        try:
            manager.start_quorum()
        except Exception as error:
            # torchft 0.2.0 keeps the failed quorum's future and re-raises its error from every later start_quorum
            # (measured: 4 million times in 90 s, the group never back): it is dropped
            manager._quorum_future = None
            self.say("quorum_failed", step=manager.current_step(), error=str(error).splitlines()[0][:200])
            time.sleep(0.1)
            return None
        step = manager.current_step()
        if step != before:
            self.say("healed", step=step, behind=step - before)  # a peer's state, live: no checkpoint read
        elif self.replacement and step == 0:  # alone, no peer to heal from: never train from scratch
            if not self.waiting:
                self.say("waiting_for_a_peer")
            self.waiting = True
            time.sleep(0.1)
            return None
        self.replacement = False
        batch = self.attempts if self.args.wrong_variant == "own_data_position" else step
        self.attempts += 1
        self.step, self.batch = step, batch
        return step, batch

    @property
    def full_quorum(self) -> bool:
        """Whether every replica group trained the step just tried (the step its theory describes)."""
        return self.manager.num_participants() == self.args.replica_groups

    def share(self, units: int) -> range:
        """This group's units of the step: by its place in the quorum (DiLoCo: its index, as if all were alive)."""
        if self.args.ft_algorithm == "diloco":
            return share_of(units, self.args.replica_groups, self.group)
        index = self.manager.participating_rank()
        return share_of(units, self.manager.num_participants(), index) if index is not None else range(0)

    def reduce(
        self, job, gradients: torch.Tensor, units: range, unit_rows: int, loss_sum: torch.Tensor
    ) -> torch.Tensor:
        """The groups' float64 gradient sums, summed (the mistake: averaged), with the tallies every_sample_once
        reads: the rows trained, the sums of their stream positions and squares, and the loss. Returns the tally."""
        from torch.distributed.distributed_c10d import ReduceOp

        rows = torch.tensor([u * unit_rows + i for u in units for i in range(unit_rows)], dtype=torch.float64)
        positions = rows + self.batch * unit_rows * job.units_per_step
        tally = torch.stack([torch.tensor(float(len(rows)), dtype=torch.float64), positions.sum(),
                             (positions**2).sum(), loss_sum.double().cpu()]).to(gradients.device)  # fmt: skip
        average = self.args.wrong_variant == "average_over_groups"
        self.manager.allreduce(gradients, reduce_op=ReduceOp.AVG if average else ReduceOp.SUM).wait()
        self.manager.allreduce(tally, reduce_op=ReduceOp.SUM).wait()
        return tally

    def commit(self, tally: torch.Tensor) -> bool:
        """Whether every group of the quorum finished the step (else it is redone with the same batch)."""
        if self.manager.should_commit():
            count, position_sum, position_squares, loss = tally.tolist()
            self.say("commit", step=self.step, batch=self.batch, groups=self.manager.num_participants(),
                     count=count, position_sum=position_sum, position_squares=position_squares, loss=loss)  # fmt: skip
            return True
        self.redone += 1
        self.say("redo", step=self.step)
        return False

    def after_inner_step(self, loss: torch.Tensor) -> None:
        """DiLoCo: an inner step done (on every --sync_every-th the optimizer's hook synced the groups)."""
        self.inner += 1
        if self.manager.current_step() > self.synced:
            self.say("commit", step=self.synced, groups=self.manager.num_participants(), loss=loss.item())

    def finish(self, job) -> None:
        gradient_bytes = sum(local(p).numel() for p in job.model.parameters()) * 8
        self.say("finished", allreduce_bytes=self.sent, gradient_bytes=gradient_bytes)
        if getattr(self, "diloco", None) is not None:
            self.diloco.__exit__(None, None, None)
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        self.events.close()


def local_state(model, optimizer) -> dict:
    """This rank's shards as plain tensors: what the checkpoint transport sends to a peer's same rank."""
    from torch.utils._pytree import tree_map

    inner = getattr(optimizer, "optimizer", optimizer)
    return {
        "model": {k: local(v) for k, v in model.state_dict().items()},
        "optim": tree_map(local, inner.state_dict()),
    }


def load_local_state(model, optimizer, state: dict) -> None:
    """A peer's same rank's shards, into this rank's (the same layout: the same shapes)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for k, v in model.state_dict().items():
            local(v).copy_(state["model"][k])
    inner = getattr(optimizer, "optimizer", optimizer)
    parameters = [p for group in inner.param_groups for p in group["params"]]
    optim_state = {}
    for index, values in state["optim"]["state"].items():
        p = parameters[int(index)]
        optim_state[index] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                    stride=p.stride())
                              if isinstance(p, DTensor) and k != "step" else v for k, v in values.items()}  # fmt: skip
    inner.load_state_dict({**state["optim"], "state": optim_state})


# --------------------------------------------------------------- the events a group writes, read back
def progress(events: list[dict]) -> int:
    """Committed steps (or DiLoCo syncs) so far: the most any group has logged."""
    return max((e["step"] + 1 for e in events if e["event"] == "commit"), default=0)


def has(events: list[dict], pid: int, *kinds: str) -> bool:
    return any(e["pid"] == pid and e["event"] in kinds for e in events)


def read_events(run_dirs: str) -> list[dict]:
    """The events of the train_gpt runs in `run_dirs` (a glob), in time order: a file a rank, a line an event (a
    last line a kill cut short is not one)."""
    events = []
    for path in glob.glob(os.path.join(run_dirs, "ft_events", "*.jsonl")):
        with open(path) as handle:
            events += [json.loads(line) for line in handle if line.endswith("\n")]
    return sorted(events, key=lambda e: e["t"])


def pace(
    events: list[dict], kills: list[dict], start: float, seconds: float, groups: int, samples: int
) -> dict:
    """A fault-tolerant run's figures from its groups' events (rank 0's speak for a group) and the `kills` (each a
    group and a time): each kill's recover_s (to its group's next committed step), the steps redone, the
    effective training time (the share of the wall time from `start` to the last commit spent in steps that
    committed with no failure and no redone attempt inside them), and the throughput (`samples` a commit) over
    the run's `seconds`, with all `groups` in the quorum and with fewer."""
    commits = [e for e in events if e["event"] == "commit" and e["rank"] == 0]
    troubles = [e["t"] for e in events if e["event"] == "redo" and e["rank"] == 0] + [k["t"] for k in kills]
    first: dict[int, dict] = {}
    for e in commits:
        first.setdefault(e["step"], e)
    recover_s = []
    for k in kills:
        again = [e["t"] for e in commits if e["group"] == k["group"] and e["t"] > k["t"]]
        recover_s.append(round(min(again) - k["t"], 2) if again else None)
    steps = [first[s] for s in sorted(first)]
    spans = [(b["t"] - a["t"], b["groups"], not any(a["t"] < t <= b["t"] for t in troubles))
             for a, b in zip(steps, steps[1:], strict=False) if b["step"] == a["step"] + 1]  # fmt: skip
    figures = {"recover_s": recover_s, "committed_steps": len(first), "samples_per_s": round(len(first) * samples / seconds, 1),
               "steps_redone": sum(e["event"] == "redo" and e["rank"] == 0 for e in events),
               "effective_training_time": round(sum(span for span, _, clean in spans if clean) /
                                                (steps[-1]["t"] - start), 3) if len(steps) > 1 else None}  # fmt: skip
    for name, keep in (("full", lambda g: g == groups), ("degraded", lambda g: g < groups)):
        kept = [span for span, g, _ in spans if keep(g)]
        figures[f"samples_per_s_{name}"] = round(len(kept) * samples / sum(kept), 1) if kept else None
        figures[f"{name}_steps"] = sum(keep(e["groups"]) for e in first.values())
    return figures


def steps_not_once(events: list[dict], steps: int, global_batch_size: int) -> list[int]:
    """The steps of `steps` that no group committed, or whose commit's tally (its row count and the sums of its
    samples' stream positions and of their squares) is not its global batch's samples, each exactly once."""
    wrong = []
    for step in range(steps):
        positions = torch.arange(global_batch_size, dtype=torch.float64) + step * global_batch_size
        expected = (global_batch_size, positions.sum().item(), (positions**2).sum().item())
        tallies = [(e["count"], e["position_sum"], e["position_squares"]) for e in events
                   if e["event"] == "commit" and e["step"] == step]  # fmt: skip
        if not tallies or any(tally != expected for tally in tallies):
            wrong.append(step)
    return wrong


class FaultTolerant(Piece, GatesSteps, Measures):
    """Applied last: nothing of the model changes; the Job asks it for each step (it gates steps)."""

    name = "fault_tolerant"
    Flags = Flags
    MISTAKES = MISTAKES

    def is_on(self, plan: Plan) -> bool:
        return bool(getattr(plan.args, "fault_tolerant", False))

    def traits(self, plan: Plan) -> set[str]:
        # ddp: each micro-batch's gradient reduced on its own, in float64 (strategies/job.py's exact accumulation)
        return {"exact_accumulation"} if plan.args.ft_algorithm == "ddp" else set()

    def refuse(self, plan: Plan) -> None:
        refuse(plan)

    def apply(self, stages: list, ctx: Context) -> list:
        ctx.runtime[self.name] = FaultTolerance(ctx)
        return stages

    def launches(self, plan: Plan) -> int:
        return plan.args.replica_groups

    def unlike_one_process(self, plan: Plan) -> str:
        """Why this run is not compared with one process ('' where it is)."""
        if plan.args.ft_algorithm == "diloco":
            return ("DiLoCo is another algorithm (local steps, an outer optimizer): it is not one process's training, "
                    "failures or not")  # fmt: skip
        return ""

    def report(self, job, session) -> None:
        ft = job.state(self)
        session.metrics.update(ft_steps_redone=ft.redone, ft_allreduce_bytes=sum(ft.sent), ft_group=ft.group)
        ft.finish(job)


PIECE = FaultTolerant()
