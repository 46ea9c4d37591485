"""fault_tolerance: can training lose a replica group, go on without restarting anyone, and end where a run without
failures ends?

Each replica group is train_gpt with --fault_tolerant (strategies/ft.py: torchft's Manager owns the replicated
dimension, its should_commit gates each step, a lost group's replacement heals from a live peer's state, each global
batch is shared by the live groups and summed exactly, in float64), --dp_shard x --tp processes inside it. This file
is the experiment around them, on one machine: torchft's lighthouse; the groups and a hot spare per failure, all
started at once; a fault injector that SIGKILLs a random group --failures times at random moments (every second one
while the previous replacement is still recovering) and gives its place to a spare; and the report. A step a failure
interrupts is redone with the same batch: failures change the time, never the result.

Checks (docs/fault_tolerance.md; each fails on a --wrong_variant): matches_one_process (every finished group passed
train_gpt's matches_single_process), every_sample_once (each committed step trained its global batch's samples
exactly once), failures_survived (failures injected = survived, no survivor restarted, no group given up on).
Figures: recover_s (a kill to its group's next commit), effective_training_time (the wall time in steps committed
with no failure inside them; Llama 3: > 90 %), throughput with every group and with fewer. With --algorithm diloco
its bytes are set against DDP's for the same tokens, its val_loss beside one process's.

Run it (CPU, over gloo):
    python experiments/fault_tolerance.py --replica_groups 3 --failures 4
    python experiments/fault_tolerance.py --replica_groups 3 --dp_shard 2 --failures 4     # FSDP inside each group
    python experiments/fault_tolerance.py --replica_groups 3 --tp 2 --failures 4           # TP inside each group
    python experiments/fault_tolerance.py --algorithm diloco --sync_every 10
On a cluster: `torchft_lighthouse --min_replicas 1 ...` once, then one torchrun job per replica group running
`experiments/train_gpt.py --fault_tolerant --replica_groups G --replica_id g` with TORCHFT_LIGHTHOUSE set.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

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
from common.gpt import GPTConfig, refuse_gpt
from common.processes import RankGroup
from common.run import start_run
from common.text import require_vocabulary
from experiments import train_gpt
from strategies.ft import MISTAKES, has, pace, progress, read_events, steps_not_once

EXPERIMENT = "fault_tolerance"
# the piece's mistakes, made by the groups (replacement_hangs by the replacements only)
WRONG_VARIANTS = MISTAKES


@dataclass
class Config(RunArgs):
    sweep_metrics = ("val_loss", "samples_per_s")
    replica_groups: int = flag(3, "replica groups (each a train_gpt launch; a torchrun job on a cluster)")
    failures: int = flag(4, "groups killed (SIGKILL) at random moments, each replaced by a hot spare")
    algorithm: str = flag("ddp", "ddp: gradients all-reduced every step; diloco: torchft's DiLoCo",
                          choices=("ddp", "diloco"))  # fmt: skip
    sync_every: int = flag(10, "with --algorithm diloco: inner steps between the groups' syncs (H)")
    max_steps: int = flag(200, "committed optimizer steps (ddp) or inner steps (diloco)")
    global_batch_size: int = flag(12, "samples every committed step trains, whatever groups are alive")
    micro_batch_size: int = flag(2, "rows of a micro-batch of one rank (train_gpt's --per_rank_batch_size)")
    dp_shard: int = flag(1, "processes per group sharding the model with FSDP2 inside it (1: plain replicas)")
    tp: int = flag(1, "processes per group splitting each matrix (tensor parallelism) inside it")
    block_size: int = flag(32, "tokens per sample")
    vocab_size: int = flag(512, "BPE vocabulary trained on the corpus")
    d_model: int = flag(64, "model width")
    n_layer: int = flag(2, "transformer blocks")
    n_head: int = flag(2, "attention heads")
    lr: float = flag(3e-3, "AdamW learning rate (DiLoCo's inner optimizer's)")
    outer_lr: float = flag(0.7, "with --algorithm diloco: the outer Nesterov SGD's learning rate (DiLoCo's 0.7)")  # fmt: skip
    lighthouse_port: int = flag(0, "the lighthouse's port (0: a free one)")
    step_timeout_s: float = flag(5.0, "torchft's timeout of a quorum, a collective and a state transfer: how long "
                                 "survivors wait for a dead peer before a new quorum")  # fmt: skip
    rejoin_timeout_s: float = flag(60.0, "a group silent this long (a replacement not healed, a survivor stuck) is "
                                   "given up on, named, and failures_survived fails; the others carry on")  # fmt: skip
    wrong_variant: str = flag("", "a deliberate mistake a check must catch: " + ", ".join(WRONG_VARIANTS))

    def validate(self) -> None:
        super().validate()
        # the model through train_gpt's own checks, first: nothing starts on a GPT no model can have
        require_vocabulary(self.vocab_size)
        refuse_gpt(GPTConfig(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.d_model))
        require_positive(self, "replica_groups", "dp_shard", "tp", "max_steps", "global_batch_size",
                         "micro_batch_size", "sync_every", "lr", "outer_lr", "step_timeout_s", "rejoin_timeout_s")  # fmt: skip
        for name in ("step_timeout_s", "rejoin_timeout_s"):  # a timedelta, a deadline: bounded (a week)
            value = getattr(self, name)
            require(value <= MAX_TIMEOUT_S, f"--{name} must be <= {MAX_TIMEOUT_S}, got {value}")  # fmt: skip
        require(self.failures >= 0, f"--failures must be >= 0, got {self.failures}")
        require(self.replica_groups >= 2 or self.failures == 0, f"--failures {self.failures} with --replica_groups "
                f"{self.replica_groups}: a failure needs a healthy group to recover from (>= 2 groups)")  # fmt: skip
        steps = self.commits
        require(self.failures <= steps // 4, f"--failures {self.failures}: at most {steps // 4} in {steps} "
                f"{'syncs' if self.algorithm == 'diloco' else 'steps'} (a failure needs steps around it to be "
                "survived and seen); raise --max_steps")  # fmt: skip
        unit = self.micro_batch_size * self.dp_shard * self.replica_groups
        require(self.global_batch_size % unit == 0, f"--global_batch_size {self.global_batch_size} must be a multiple "
                f"of --micro_batch_size x --dp_shard x --replica_groups = {unit} (every group's ranks a micro-batch "
                "each, as many for every group)")  # fmt: skip
        require(0 <= self.lighthouse_port < 65536,
                f"--lighthouse_port must be in [0, 65535], got {self.lighthouse_port}")  # fmt: skip
        processes = self.group_size * (self.replica_groups + self.failures)  # a GPU each, where GPUs are
        require(not torch.accelerator.is_available() or processes <= torch.accelerator.device_count(), f"{processes} "
                f"processes (--replica_groups {self.replica_groups} + a spare a failure, x {self.group_size}) need a GPU "
                f"each; there are {torch.accelerator.device_count()}")  # fmt: skip
        require(self.algorithm == "ddp" or self.group_size == 1, f"--algorithm {self.algorithm} with {self.group_size} "
                "processes a group: DiLoCo runs plain replicas here (--dp_shard 1, --tp 1)")  # fmt: skip
        require(self.wrong_variant in ("", *WRONG_VARIANTS),
                f"--wrong_variant {self.wrong_variant!r}: known: {', '.join(WRONG_VARIANTS)}")  # fmt: skip

    @property
    def group_size(self) -> int:
        return self.dp_shard * self.tp

    @property
    def commits(self) -> int:
        """What the groups commit: steps (ddp), or syncs of --sync_every inner steps (diloco)."""
        return self.max_steps // self.sync_every if self.algorithm == "diloco" else self.max_steps

    @property
    def parity_steps(self) -> int:
        """Steps compared with one process: all where the sums are exact; train_gpt's 15 under tensor parallelism,
        whose split matmuls round apart from one process's (AdamW amplifies it; docs/train_gpt.md)."""
        return self.max_steps if self.tp == 1 else min(15, self.max_steps)

    def train_gpt_args(self, output_dir: str, groups: int, **more) -> list[str]:
        """train_gpt's flags for a run of this model and batch, `groups` replica groups sharing each batch."""
        accumulation = self.global_batch_size // (self.micro_batch_size * self.dp_shard * groups)
        flags = {"output_dir": output_dir, "report_to": "none", "seed": self.seed, "max_steps": self.max_steps,
                 "per_rank_batch_size": self.micro_batch_size, "gradient_accumulation_steps": accumulation,
                 "block_size": self.block_size, "vocab_size": self.vocab_size, "d_model": self.d_model,
                 "n_layer": self.n_layer, "n_head": self.n_head, "lr": self.lr, "warmup_steps": 0,
                 "min_loss_drop": 0.0, "sample_tokens": 0, "log_every": self.max_steps, "mixed_precision": "no",
                 "dist_timeout_s": self.dist_timeout_s, **more}  # fmt: skip
        return [f"--{k}={v}" for k, v in flags.items()]

    def group_args(self, lighthouse: str, spare: int, run_dir: str) -> list[str]:
        """train_gpt's flags for spare `spare` (a group from the start, or a replacement): every step compared."""
        replacement = spare >= self.replica_groups
        variant = self.wrong_variant if replacement or self.wrong_variant != "replacement_hangs" else ""
        argv = self.train_gpt_args(os.path.join(run_dir, "groups", f"spare{spare}"), self.replica_groups,
                                   parity_steps=self.parity_steps, dp_shard=self.dp_shard, tp=self.tp,
                                   replica_groups=self.replica_groups, lighthouse=lighthouse, ft_algorithm=self.algorithm,
                                   sync_every=self.sync_every, outer_lr=self.outer_lr, ft_timeout_s=self.step_timeout_s,
                                   ft_start_file=os.path.join(run_dir, f"spare{spare}.go"), wrong_variant=variant)  # fmt: skip
        return [*argv, "--fault_tolerant", *["--ft_replacement"] * replacement]


# ------------------------------------------------------------------------------------------------ the run
class Injector:
    """Starts the groups and a hot spare per failure (each a train_gpt launch, from a fork server that has imported
    torch: a start in a fraction of a second; torchft's Rust runtime, imported in each process, is never forked),
    kills a group (SIGKILL, every process of it) at each chosen moment, gives its place to a spare, gives up on a
    group that makes no progress. It reads the groups' progress from their event files (a killed process may have
    held a lock on anything shared: files are safe)."""

    def __init__(self, cfg: Config, lighthouse: str, run_dir: str):
        self.cfg, self.lighthouse, self.run_dir = cfg, lighthouse, run_dir
        self.groups = os.path.join(run_dir, "groups", "*")  # each spare's train_gpt run
        self.logs = os.path.join(run_dir, "processes")  # <name>.<rank>.log: each process's output
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["torch", "torch.distributed", "accelerate", "experiments.train_gpt"])  # fmt: skip
        self.spares: list[RankGroup] = []  # by spare number, every one started
        self.current: dict[int, RankGroup] = {}  # group -> the processes in its place now
        self.free: list[int] = []  # spares started, no place yet
        self.placed: list[dict] = []  # every spare given a group's place: group, pid (rank 0's), pids, t, why
        self.kills, self.given_up = [], []  # groups killed, given up on: group, pid, pids, spare, ...
        self.grace_until = 0.0  # no group is given up on before this (the others' time after one was)
        self.reference = None  # DiLoCo's: one process training the same batches

    def start_spare(self) -> None:
        spare, world = len(self.spares), self.cfg.group_size
        gpus = list(range(spare * world, (spare + 1) * world)) if torch.accelerator.is_available() else []
        argv = self.cfg.group_args(self.lighthouse, spare, self.run_dir)
        self.spares.append(RankGroup(self.context, train_gpt.main, argv, world, gpus, f"{self.logs}/spare{spare}"))  # fmt: skip
        self.free.append(spare)

    def is_ready(self, spare: int) -> bool:  # its every rank started up and waiting (strategies/ft.py)
        go = os.path.join(self.run_dir, f"spare{spare}.go")
        return all(os.path.exists(f"{go}.{r}.ready") for r in range(self.cfg.group_size))

    def place(self, group: int, why: str) -> None:
        """The oldest spare takes `group`'s place (waiting for it to be ready if a failure came too soon)."""
        spare = self.free.pop(0)
        self.wait(lambda events: self.is_ready(spare), f"spare {spare} getting ready")
        with open(os.path.join(self.run_dir, f"spare{spare}.go"), "w") as handle:
            handle.write(str(group))
        self.current[group] = self.spares[spare]
        self.placed.append({"group": group, "pid": self.spares[spare].pid, "t": time.time(), "why": why,
                            "pids": self.spares[spare].pids})  # fmt: skip

    def watch(self) -> list[dict]:
        """When a group has made no progress (its placement, a heal, a commit) for --rejoin_timeout_s, give up on one
        (named; the others carry on) and give the others that long again: a live replica that never joins a quorum
        stalls everyone's (torchft's lighthouse waits for half of the heartbeating replicas). Fail the run when no
        group has committed a step for twice that long. Returns the events so far."""
        events, now, placed = read_events(self.groups), time.time(), {p["pid"]: p["t"] for p in self.placed}
        alive = {g: p for g, p in self.current.items() if p.is_alive()}
        moved = {g: max([placed[p.pid], *(e["t"] for e in events if e["pid"] == p.pid and e["event"] in ("healed", "commit"))])
                 for g, p in alive.items()}  # fmt: skip
        stuck = [g for g in alive if now - moved[g] > self.cfg.rejoin_timeout_s]
        # who to give up on: a replacement that never healed though it had time to (a survivor blocked by it has
        # trained before; its clock may run out first), else the stuck group silent longest
        silent = {g: now - max((e["t"] for e in events if e["pid"] == p.pid), default=placed[p.pid])
                  for g, p in alive.items()}  # fmt: skip
        never = [g for g, p in alive.items() if now - placed[p.pid] > self.cfg.step_timeout_s
                 and not any(e["pid"] == p.pid and e["event"] in ("healed", "commit") for e in events)]  # fmt: skip
        worst = max(never or stuck, key=silent.get) if stuck else None
        if worst is not None and now > self.grace_until:
            group = self.current[worst]
            group.kill()  # a group that never comes back: named, the survivors carry on
            self.given_up.append({"group": worst, "pid": group.pid, "spare": self.spares.index(group), "no_progress_s":
                                  round(now - moved[worst], 1), "pids": group.pids})  # fmt: skip
            self.grace_until = now + self.cfg.rejoin_timeout_s
        commits = [e["t"] for e in events if e["event"] == "commit"] or [self.placed[0]["t"]]
        if now - max(*commits, self.grace_until - self.cfg.rejoin_timeout_s) > 2 * self.cfg.rejoin_timeout_s:
            raise TimeoutError(f"no group committed a step for {now - max(commits):.0f} s")
        return events

    def wait(self, until, what: str) -> None:
        """Until `until(events)` holds, the event files read once a round (and the groups watched, once placed)."""
        while not until(self.watch() if self.current else read_events(self.groups)):
            if self.current and not any(p.is_alive() for p in self.current.values()):
                raise TimeoutError(f"{what}: every group has ended")
            time.sleep(0.05)

    def run(self, say) -> None:
        cfg, rng = self.cfg, random.Random(self.cfg.seed)
        # the groups and a hot spare per failure, all started now: a replacement takes a place in a fraction of a
        # second (a cluster's hot spare) instead of a cold start's seconds, which would outlast the run
        for _ in range(cfg.replica_groups + cfg.failures):
            self.start_spare()
        if cfg.algorithm == "diloco":  # DDP's val_loss for the same batches: one process, no failures
            argv = cfg.train_gpt_args(os.path.join(self.run_dir, "groups", "reference"), 1, parity_steps=0)
            self.reference = RankGroup(self.context, train_gpt.main, argv, 1, [], f"{self.logs}/reference")
        groups = range(cfg.replica_groups)
        self.wait(lambda events: all(self.is_ready(s) for s in groups), "the groups getting ready")
        for group in range(cfg.replica_groups):  # all at once: none trains the first steps alone
            self.place(group, "initial")
        total = cfg.commits
        # the first failure after 5 % of the run, the others spread over its first 60 %
        at = max(1, total // 20)
        for index in range(cfg.failures):
            recovering = None  # the group whose replacement is healing when this failure hits
            if index % 2 == 1:  # the previous failure's replacement has its place, not yet healed
                recovering = self.kills[-1]["group"]
                pid = self.current[recovering].pid
                self.wait(lambda events, r=pid: has(events, r, "started"), "a replacement's start")
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
            events = read_events(self.groups)
            healing = recovering is not None and not has(events, self.current[recovering].pid, "healed", "commit")  # fmt: skip
            victim = self.current[group]
            victim.kill()
            self.kills.append({"group": group, "pid": victim.pid, "spare": self.spares.index(victim), "t": time.time(),
                               "step": progress(events), "during_recovery": healing, "pids": victim.pids})  # fmt: skip
            say(f"step {progress(events)}: killed group {group} (pid {victim.pid})"
                + (f" while group {recovering} was still recovering" if healing else ""))  # fmt: skip
            self.place(group, f"replaces group {group} (failure {index + 1})")
        while any(p.is_alive() for p in self.current.values()):
            self.watch()
            time.sleep(0.1)
        if self.reference is not None:
            self.reference.processes[0].join(timeout=self.cfg.dist_timeout_s)

    def every_group(self) -> list[RankGroup]:  # spares never placed included
        return [*self.spares, *([self.reference] if self.reference else [])]


def finished_groups(run_dir: str) -> dict[str, dict]:
    """The summary.json of every group's train_gpt run that finished, by its folder."""
    paths = sorted(Path(run_dir, "groups").glob("*/summary.json"))
    return {path.parent.name: json.loads(path.read_text()) for path in paths}


def run(cfg: Config) -> int:
    # torchft's lighthouse and managers (Rust) log every quorum at INFO: RUST_LOG quiets them and the processes this
    # run starts (they inherit it), restored after; set before the lighthouse starts (its logger reads it once)
    with mock.patch.dict(os.environ, {"RUST_LOG": "warn"}):
        from torchft.coordination import LighthouseServer

        try:  # a quorum waits up to a second for a late group (else it heals, skipping steps: docs/fault_tolerance.md);
            # a group silent for a second is out of the next. First: a port in use is refused before anything is written
            lighthouse = LighthouseServer(bind=f"[::]:{cfg.lighthouse_port}", min_replicas=1, join_timeout_ms=1000,
                                          quorum_tick_ms=20, heartbeat_timeout_ms=1000)  # fmt: skip
        except Exception as error:  # the Rust server's bind error
            raise UsageError(f"--lighthouse_port {cfg.lighthouse_port}: the lighthouse cannot listen there "
                             f"({str(error).splitlines()[0][:200]}); pass another, or 0 for a free one") from None  # fmt: skip
        try:
            with start_run(cfg, EXPERIMENT) as session:
                os.makedirs(os.path.join(session.output_dir, "processes"), exist_ok=True)
                injector, started = Injector(cfg, lighthouse.address(), session.output_dir), time.time()
                inside = " x ".join(f"--{d} {getattr(cfg, d)}" for d in ("dp_shard", "tp") if getattr(cfg, d) > 1)  # fmt: skip
                session.print(f"{cfg.replica_groups} replica groups{f' of {inside}' if inside else ''} ({cfg.algorithm}), "
                              f"{cfg.failures} failures to inject, lighthouse at {lighthouse.address()}")  # fmt: skip
                try:
                    injector.run(session.print)
                except TimeoutError as error:
                    raise UsageError(f"the run did not end: {error} (see {session.output_dir}/processes)") from None  # fmt: skip
                finally:  # every process this run started is gone when it ends (Ctrl-C, a timeout, a crash)
                    for group in injector.every_group():
                        group.kill(timeout_s=10)
                report(session, cfg, injector, read_events(injector.groups), time.time() - started)
        finally:
            lighthouse.shutdown()
    return session.exit_code


def report(session, cfg: Config, injector: Injector, events: list[dict], seconds: float) -> None:
    """The checks and metrics, from the groups' event files (their rank 0's speak for them) and their train_gpt
    runs' summaries (their own checks, their parameters against one process)."""
    finished = [e for e in events if e["event"] == "finished"]  # every rank's
    events = [e for e in events if e["rank"] == 0]
    commits = [e for e in events if e["event"] == "commit"]
    # a failure survived: its group back (a later process of it healed or committed) and training went on
    back = [any(e["group"] == k["group"] and e["t"] > k["t"] and e["event"] in ("healed", "commit") for e in events)
            and any(e["t"] > k["t"] for e in commits) for k in injector.kills]  # fmt: skip
    ended = {pid for k in [*injector.kills, *injector.given_up] for pid in k["pids"]} | {f["pid"] for f in finished}  # fmt: skip
    on_their_own = [pid for p in injector.placed for pid in p["pids"] if pid not in ended]
    lost = [f"group {k['group']} (killed at step {k['step']})" for k, ok in zip(injector.kills, back, strict=True)
            if not ok]  # fmt: skip
    session.check("failures_survived", sum(back) == len(injector.kills) == cfg.failures and not on_their_own
                  and not injector.given_up,
                  f"{cfg.failures} failures to inject, {len(injector.kills)} injected, {sum(back)} survived (the group "
                  f"back from a peer, training on); never back: {', '.join(lost) or 'none'}; given up on: "
                  f"{injector.given_up or 'none'}; processes that ended on their own: {on_their_own or 'none'}")  # fmt: skip
    plot_timeline(cfg, events, injector, os.path.join(session.output_dir, "timeline.png"))
    session.metrics.update(failures_injected=len(injector.kills), failures_survived=sum(back),
                           survivor_restarts=len(injector.placed) - cfg.replica_groups - len(injector.kills),
                           kills=injector.kills, processes=injector.placed, given_up=injector.given_up,
                           started_pids=[pid for g in injector.every_group() for pid in g.pids],
                           seconds=round(seconds, 1))  # fmt: skip
    samples_per_commit = cfg.global_batch_size * (cfg.sync_every if cfg.algorithm == "diloco" else 1)
    start = injector.placed[0]["t"] if injector.placed else time.time()
    session.metrics.update(pace(events, injector.kills, start, seconds, cfg.replica_groups, samples_per_commit))  # fmt: skip
    gone = {f"spare{k['spare']}" for k in [*injector.kills, *injector.given_up]}  # killed, given up on
    groups = {name: s for name, s in finished_groups(session.output_dir).items() if name not in {"reference", *gone}}  # fmt: skip
    session.metrics["group_checks"] = {name: {c: v["passed"] for c, v in s["checks"].items()}
                                       for name, s in groups.items()}  # fmt: skip
    own = {"matches_single_process", "grad_norm_is_global"}  # the parity, checked below
    failed = sorted({f"{name}: {c}" for name, s in groups.items() for c, v in s["checks"].items()
                     if c not in own and v["passed"] is False})  # fmt: skip
    session.check("groups_passed_their_checks", bool(groups) and not failed, f"{len(groups)} finished groups' train_gpt "
                  f"checks (bytes held and sent against theory, the loss falls): failed: {failed or 'none'}")  # fmt: skip
    sent = [sum(e["allreduce_bytes"]) for e in finished if e["rank"] == 0]
    session.metrics["allreduce_bytes_per_group"] = sent
    if groups:
        session.metrics["val_loss"] = next(iter(groups.values()))["metrics"]["val_loss"]
    if cfg.algorithm == "ddp":
        total = cfg.commits
        wrong = steps_not_once(commits, total, cfg.global_batch_size)
        session.check("every_sample_once", not wrong,
                      f"{total - len(wrong)} of {total} committed steps trained their global batch's "
                      f"{cfg.global_batch_size} samples exactly once (count and stream-position sums all-reduced "
                      "with the gradients)" + (f"; wrong or missing: steps {wrong[:10]}" if wrong else ""))  # fmt: skip
        parity = {name: s["checks"].get("matches_single_process", {}) for name, s in groups.items()}
        # a group that healed after the steps compared trained none of them: train_gpt skips its check, saying so
        compared = {name: p for name, p in parity.items() if not p.get("skipped")}
        worst = max((groups[name]["metrics"].get("param_max_abs_diff", math.inf) for name in compared),
                    default=math.inf)  # fmt: skip
        session.check("matches_one_process", bool(compared) and all(p.get("passed") for p in compared.values()),
                      f"{len(compared)} of {len(parity)} finished groups against one process on the same global batches "
                      f"over {cfg.parity_steps} steps (train_gpt's matches_single_process; the others healed after "
                      f"them): passed {[name for name, p in compared.items() if p.get('passed')]}, max |parameter - "
                      f"one process| = {worst:.2e}")  # fmt: skip
        # every attempt all-reduces the float64 gradient sum (of the rank's shard) and 4 float64 tallies, nothing else
        session.metrics["allreduce_bytes_match_theory"] = bool(finished) and all(
            set(e["allreduce_bytes"]) <= {e["gradient_bytes"], 32} for e in finished)  # fmt: skip
    else:
        session.skip_check("every_sample_once", "DiLoCo: a group killed mid-window loses its inner steps since the "
                           "last sync with it (its replacement trains that window's batches again)")  # fmt: skip
        session.skip_check("matches_one_process", "DiLoCo is another algorithm (local steps, an outer optimizer): it "
                           "is not one process's training, failures or not")  # fmt: skip
        # DDP (float32 gradients) sends one gradient all-reduce per step for the same tokens
        parameters = next(iter(groups.values()))["metrics"]["parameters"] if groups else 0
        session.metrics["ddp_bytes_same_tokens"] = cfg.max_steps * parameters * 4
        if sent and parameters:
            session.metrics["bytes_vs_ddp"] = round(max(sent) / session.metrics["ddp_bytes_same_tokens"], 4)
        reference = finished_groups(session.output_dir).get("reference", {})
        session.metrics["val_loss_ddp"] = reference.get("metrics", {}).get("val_loss")
    figures = session.metrics
    session.print(f"{len(injector.kills)} failures injected, {sum(back)} survived (recovered in {figures['recover_s']}"
                  f" s), {figures['steps_redone']} steps redone, effective training time "
                  f"{figures['effective_training_time']}, {len(groups)} groups finished, "
                  f"val_loss {figures.get('val_loss', float('nan')):.4f}")  # fmt: skip


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
    seconds = [e["t"] - start for e in commits]
    loss_axis.plot(seconds, [e["loss"] for e in commits], ".", markersize=2)
    shards = f" of {cfg.dp_shard} FSDP ranks" if cfg.dp_shard > 1 else ""
    loss_axis.set(ylabel="loss of the committed step", title=f"{cfg.replica_groups} replica groups{shards}, "
                  f"{len(injector.kills)} failures ({cfg.algorithm})")  # fmt: skip
    groups_axis.step(seconds, [e["groups"] for e in commits], where="post")
    groups_axis.set(ylabel="groups in the quorum", xlabel="seconds from the first group's start",
                    ylim=(0, cfg.replica_groups + 0.5))  # fmt: skip
    heals = [e for e in events if e["event"] == "healed"]
    for marks, color, style, label in ((injector.kills, "tab:red", "-", "a group killed"),
                                       (heals, "tab:green", "--", "a group healed from a peer")):  # fmt: skip
        for axis, mark in ((axis, mark) for axis in (loss_axis, groups_axis) for mark in marks):
            axis.axvline(mark["t"] - start, color=color, linewidth=1, linestyle=style)
        groups_axis.plot([], [], color=color, linestyle=style, label=label)
    groups_axis.legend(loc="lower right", fontsize=8)
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
