"""ep: expert parallelism for a mixture-of-experts GPT (common/moe.py). Each MoE block's experts are split over
the --ep ranks (E / ep each, a DTensor split on dim 0: a checkpoint holds every expert whole, by name, and any
layout reads it); each token goes to the rank of its expert and back:

  1. every rank sorts its (token, expert) assignments by expert and counts them per expert;
  2. the counts are exchanged (all_to_all_single, equal splits: E / ep counts to each peer): each rank learns how
     many tokens every peer sends to each of its experts;
  3. the tokens are dispatched (all_to_all_single, UNEVEN splits: to peer j the assignments of j's experts),
     regrouped by local expert, run through it, put back in arrival order;
  4. the outputs return by the reverse all-to-all (the splits swapped) and are combined by the router's
     weights where they came from (common/moe.py).
The all-to-alls are torch's autograd-aware functional ones: in backward each sends the gradients back the way
its tokens came. The ep ranks are data-parallel ranks (each reads its own share of the data): the rest of the
model is averaged over them as over any data-parallel rank (strategies/layout.py); an expert's gradient already
sums every ep rank's tokens (the all-to-all's backward brought them), so it is all-reduced only over the ranks
that hold the same experts (the other data-parallel ranks) and divided by all of them. FSDP and DDP leave the
experts alone (`ignored_params`, DDP's params-to-ignore): FSDP2 cannot shard a tensor already split over a
dimension of its own mesh. torchtitan shards its experts again over dp_shard / ep (its efsdp): not built here,
the experts are whole on each rank of their ep group (DeepSpeed-MoE's expert data parallelism).

With or without ep, every data-parallel layout sums each step's tokens per expert over the data-parallel ranks
(`global_counts`): the auxiliary loss's f_i and the balancing bias's loads are the GLOBAL batch's, as one
process computes them, else the ranks' routers drift apart.

Under a capacity (--capacity_factor) the data-parallel ranks count it over the global micro-batch: each learns
what the ranks before it sent every expert (one all-reduce of a (ranks, experts) table), so the tokens dropped
are those one process drops.

Theory, per step and MoE block on a rank: the counts' all-to-all (E x 8 bytes) per forward; the dispatch
(kept assignments x d_model x the activation's bytes) and the combine (what came in, back) per forward, each
again in backward; the aux loss's all-reduce of E floats per forward when its coefficient is > 0; under a
capacity, the all-reduce of dp x E int64 counts per forward. The
dispatch's bytes depend on where the router sent the tokens: the closed form is evaluated on the routing
counts each block records for the step (`routing`), and the comm counter's count must equal it. On the wire a
rank puts every row but those it sends itself: with uneven routing that is not the even split's (ep - 1) / ep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from common import moe
from common.config import flag, require
from common.device import device_time
from common.moe import moe_layers, recomputing, run_experts
from strategies.layout import Layout, Mistake, Traffic, chunk_rows, stream_dtype, submesh
from strategies.piece import Context, HooksTheStep, Measures, Piece, Plan, SplitsParameters, Theory

# ep's all-to-alls wait in every MoE block (exposed, as tp's); its all-reduces (the experts' gradients over their
# replicas, the balancing counts) are priced with the data parallel ones (Traffic.term)
DATA_PARALLEL = "ep_data_parallel"

MISTAKES = {  # each: what it is, and the runs under which it is one
    "combine_without_router_weights": Mistake.of(
        "ep", "the experts' outputs summed as they come back, not weighted by the router"
    ),
    "reverse_all_to_all_with_forward_splits": Mistake.of(
        "ep", "the outputs sent back with the dispatch's splits, not swapped"
    ),
    "experts_initialised_per_rank": Mistake.of(
        "ep", "each ep rank draws its own experts' weights (a seed per rank)"
    ),
    "balance_on_local_tokens": Mistake.of(
        "ep", "the balancing counts (aux loss, bias) of each rank's own tokens only"
    ),
    # tp ranks route the same tokens (tp.py leaves a MoE whole): their expert gradients are copies, not more data
    "expert_gradients_summed_over_tp": Mistake(
        "the experts' gradients also summed over the tensor-parallel ranks, as if they had routed other tokens",
        lambda plan: plan.engine_stage is None and plan.layout.ep > 1 and plan.layout.tp > 1,
    ),
    # cp ranks hold other tokens of the same sequences: the experts' gradients must be averaged over them too
    "experts_averaged_without_cp": Mistake(
        "the experts' gradients summed and averaged over the data-parallel ranks only, as if cp ranks held copies",
        lambda plan: plan.engine_stage is None and plan.layout.ep > 1 and plan.layout.cp > 1,
    ),
    # a mistake wherever the data-parallel ranks' tokens meet one capacity: ep or not
    "capacity_per_rank": Mistake(
        "each rank's expert capacity counted over its own tokens, not the global micro-batch's",
        lambda plan: plan.engine_stage is None and plan.layout.dp > 1 and plan.work.model.capacity_factor > 0,
    ),
}
EXPERT_WEIGHTS = ("w_in", "w_gate", "w_out")


@dataclass
class Flags:
    ep: int = flag(0, "expert-parallel degree: data-parallel ranks that also split each MoE block's experts, tokens "
                   "sent to their experts and back by all-to-all (needs --n_experts; 0, 1: off)")  # fmt: skip


def refuse(plan: Plan) -> None:
    layout, work = plan.layout, plan.work
    experts = work.model.n_experts
    require(
        layout.ep == 1 or experts,
        f"--ep {layout.ep}: expert parallelism splits experts; the model has none (--n_experts N)",
    )
    require(layout.ep == 1 or experts % layout.ep == 0,
            f"--n_experts {experts} with --ep {layout.ep}: each ep rank holds n_experts / ep experts; pick a "
            "divisor")  # fmt: skip
    if not experts:
        return
    # a capacity keeps each expert's first tokens in one process's order (row by row), which a cp rank's chunks
    # of every row do not follow
    require(
        layout.cp == 1 or work.model.capacity_factor == 0,
        f"--n_experts with --cp {layout.cp} and --capacity_factor: not built (the capacity's token order is one "
        "process's, row by row; a cp rank holds chunks of every row)",
    )
    # the balancing loss and a capacity count each forward's tokens: a pipeline's forward is one of its
    # micro-batches, which the one-process reference (and the global micro-batch) does not cut
    require(
        layout.pp == 1 or (work.model.aux_loss_coef == 0 and work.model.capacity_factor == 0),
        f"--n_experts with --pp {layout.pp} and --aux_loss_coef or --capacity_factor: not built (each counts "
        "one forward's tokens, and a pipeline's forward is a micro-batch); balance with --bias_update_rate",
    )
    require(not plan.engine_stage, "--n_experts under a DeepSpeed accelerate config: not built")
    require(
        layout.ep == 1 or not {"recomputes_blocks", "compiled"} & plan.traits,
        "--ep with --activation_checkpointing full or --compile: not built (a block's recompute would send the "
        "tokens again; selective checkpointing keeps what the all-to-alls return)",
    )


def is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS and ".mlp." in name


def split(name: str, layout: Layout) -> bool:
    """Whether parameter `name` is split by expert parallelism (then left alone by FSDP and DDP)."""
    return layout.ep > 1 and is_expert(name)


def local_shape(name: str, shape, layout: Layout) -> list[int]:
    shape = list(shape)
    if split(name, layout):
        shape[0] //= layout.ep
    return shape


class AllToAll:
    """The MoE block's `exchange` under expert parallelism (steps 1-4 of the module's docstring); it records each
    forward's routing (what it sent and received) for the theory."""

    def __init__(self, group, ep: int, wrong_variant: str):
        self.group, self.ep = group, ep
        self.swap_back = wrong_variant != "reverse_all_to_all_with_forward_splits"
        self.routing: list[dict] = []
        self.assume_same_routing = False  # experiments/at_scale.py's fake tensors: every rank routes alike
        self.seconds = 0.0  # in the forward's all-to-alls (training forwards)

    def __call__(self, moe, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local_experts = moe.n_experts // self.ep
        started = device_time(routed.device)
        sent_counts = torch.tensor(counts, device=routed.device)
        # each peer's counts for this rank's experts, (peer, local expert); tolist() waits for them
        counts_in = self.counts_from_peers(sent_counts)
        # fake tensors (experiments/at_scale.py) hold no counts: there every rank routes alike (uniform)
        counts_in = counts if self.assume_same_routing else counts_in.tolist()
        send = [sum(counts[j * local_experts : (j + 1) * local_experts]) for j in range(self.ep)]
        receive = [sum(counts_in[j * local_experts : (j + 1) * local_experts]) for j in range(self.ep)]
        per_local_expert = [
            sum(counts_in[j * local_experts + e] for j in range(self.ep)) for e in range(local_experts)
        ]
        arrived = self.rows_from_peers(routed, receive, send)
        waited = device_time(routed.device) - started
        # arrived in (peer, local expert) order: regrouped by local expert, stable, then put back
        expert_of = torch.arange(local_experts, device=routed.device).repeat(self.ep)
        arrivals = torch.tensor(counts_in, device=routed.device)
        by_expert = torch.argsort(
            expert_of.repeat_interleave(arrivals, output_size=sum(receive)), stable=True
        )
        outputs = run_experts(moe, arrived[by_expert], per_local_expert)
        back = torch.empty_like(outputs).index_copy(0, by_expert, outputs)
        started = device_time(routed.device)
        returned = self.rows_from_peers(back, *((send, receive) if self.swap_back else (receive, send)))
        if torch.is_grad_enabled() and not recomputing():
            self.seconds += waited + device_time(routed.device) - started
            # the rows a rank sends itself (send[me] = receive[me]) cross no wire
            self.routing.append({"sent_rows": sum(send), "received_rows": sum(receive),
                                 "own_rows": send[self.rank()],
                                 "row_bytes": routed.shape[-1] * (routed.element_size() + back.element_size()),
                                 "experts": moe.n_experts})  # fmt: skip
        return returned

    # the process group's part, apart: planning/compute_ops traces the rest of the exchange without one
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def counts_from_peers(self, sent_counts: torch.Tensor) -> torch.Tensor:
        return funcol.all_to_all_single(sent_counts, None, None, self.group)

    def rows_from_peers(self, rows: torch.Tensor, receive: list[int], send: list[int]) -> torch.Tensor:
        """`send[j]` of the rows to peer j, `receive[j]` from it (autograd sends the gradients back)."""
        arrived = funcol.all_to_all_single_autograd(rows, receive, send, self.group)
        return arrived.wait() if hasattr(arrived, "wait") else arrived


def apply(model, ep_mesh, data_group, layout: Layout, rank: int, args) -> list[AllToAll]:
    """Each MoE block's counts summed over `data_group` (the data-parallel ranks) and its capacity counted over
    their tokens; under ep its experts split over `ep_mesh` and its exchange made an all-to-all. Returns the
    exchanges (their routing is the theory's)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    exchanges = []
    for layer in moe_layers(model):
        if args.wrong_variant != "balance_on_local_tokens":
            layer.global_counts = lambda counts, group=data_group: summed(counts, group)
        if args.wrong_variant != "capacity_per_rank":
            layer.earlier_assignments = lambda counts, group=data_group: earlier_assignments(
                counts, group, layout.dp_rank(rank), layout.dp
            )
        layer.weigh_outputs = args.wrong_variant != "combine_without_router_weights"
        if layout.ep == 1:
            continue
        for name in EXPERT_WEIGHTS:
            weight = getattr(layer, name)
            if weight is None:
                continue
            split_weight = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)])
            if args.wrong_variant == "experts_initialised_per_rank":
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(1000 + rank)
                    torch.nn.init.normal_(split_weight.to_local(), std=0.02)
            setattr(layer, name, torch.nn.Parameter(split_weight))
        layer.exchange = AllToAll(ep_mesh.get_group(), layout.ep, args.wrong_variant)
        exchanges.append(layer.exchange)
    return exchanges


def earlier_assignments(counts: torch.Tensor, group, data_rank: int, ranks: int) -> tuple[torch.Tensor, int]:
    """What the data-parallel ranks before `data_rank` sent each expert in this forward (rank 0's rows come first
    in the global micro-batch), and how many data-parallel ranks there are: every rank puts its counts in its own
    row of a (ranks, experts) table, one all-reduce fills it."""
    table = counts.new_zeros(ranks, counts.shape[0])
    table[data_rank] = counts
    table = summed(table, group)
    return table[:data_rank].sum(0), ranks


def summed(counts: torch.Tensor, group) -> torch.Tensor:
    """`counts` summed over `group`: a functional all-reduce, whose result selective checkpointing keeps for the
    recompute (strategies/activation_checkpointing.SAVED_BY_SELECTIVE) rather than sending again."""
    total = funcol.all_reduce(counts, "sum", group)
    return total.wait() if hasattr(total, "wait") else total


def expert_parameters(model) -> list:
    return [p for layer in moe_layers(model) for p in (layer.w_in, layer.w_gate, layer.w_out)
            if p is not None and hasattr(p, "to_local")]  # fmt: skip


def reduce_gradients(model, replicas_group, data_ranks: int, tp_group=None) -> None:
    """The experts' gradients (each already the sum over its ep group's tokens) summed over the ranks that hold
    the same experts and divided by every data-parallel rank: the mean gradient one process computes. The tp
    ranks of a data-parallel rank routed the same tokens: their gradients are already equal, and are not summed
    (`tp_group`: only the mistake expert_gradients_summed_over_tp sums them)."""
    for param in expert_parameters(model):
        if param.grad is None:
            continue
        grad = param.grad.to_local()
        if replicas_group is not None:
            dist.all_reduce(grad, group=replicas_group)
        if tp_group is not None:
            dist.all_reduce(grad, group=tp_group)
        grad.div_(data_ranks)


def sent(t: Theory) -> list[Traffic]:
    """One step's traffic of the MoE blocks on a rank, from the routing its exchanges recorded in that step
    (`t.counted["routing"]`, every forward's: rows sent and received, bytes of a row there and back)."""
    layout, work, routing = t.layout, t.work, t.counted.get("routing", [])
    expert_bytes = sum(math.prod(shape) * 4 for name, shape in t.held if split(name, layout))
    traffic = []
    moe = work.model
    calls = moe.n_layer * work.micro_batches  # MoE forwards a step
    token_ranks = layout.dp * layout.cp  # the ranks whose tokens make the batch (`apply`'s data group)
    if moe.n_experts and moe.aux_loss_coef > 0 and token_ranks > 1:
        traffic.append(
            Traffic("all_reduce", calls * moe.n_experts * 4, token_ranks, "ep", term=DATA_PARALLEL)
        )
    # under a capacity: the (ranks, experts) table of int64 counts (refused under cp)
    if moe.n_experts and moe.capacity_factor > 0 and layout.dp > 1:
        traffic.append(
            Traffic("all_reduce", calls * layout.dp * moe.n_experts * 8, layout.dp, "ep", term=DATA_PARALLEL)
        )
    if layout.ep == 1:
        return traffic
    a2a = wire = 0
    for record in routing:
        a2a += record["experts"] * 8  # the counts
        # dispatch: sent rows forward, received rows' gradients back; combine: received rows forward, sent back
        rows = record["sent_rows"] + record["received_rows"]
        a2a += rows * record["row_bytes"]
        # on the wire: the counts for the other ep ranks, and every row but those a rank sends itself (each way)
        wire += record["experts"] * 8 * (layout.ep - 1) / layout.ep
        wire += (rows - 2 * record["own_rows"]) * record["row_bytes"]
    traffic.append(Traffic("all_to_all", a2a, layout.ep, "ep", wire=wire))
    if token_ranks > layout.ep:  # the experts' gradients over the ranks that hold the same experts
        traffic.append(
            Traffic("all_reduce", expert_bytes, token_ranks // layout.ep, "ep", term=DATA_PARALLEL)
        )
    return traffic


def uniform_routing(layout: Layout, work, args, rank: int, blocks: int) -> list[dict]:
    """The routing records a rank's exchanges make in one step when every rank routes uniformly (what
    experiments/at_scale.py assumes on fake tensors, planning/fake_ranks.uniform_order, and the planner prices):
    each forward's tokens x top_k assignments shared out over the experts as torch.chunk shares them, the same
    on every rank, so a rank receives what it sends. `blocks`: the MoE blocks the rank holds."""
    cfg = work.model
    if layout.ep == 1 or not cfg.n_experts:
        return []
    m = args.pp_microbatches if layout.pp > 1 else 1
    assignments = work.rows // m * cfg.block_size // layout.cp * cfg.top_k
    per_expert = [chunk_rows(assignments, cfg.n_experts, e) for e in range(cfg.n_experts)]
    local_experts, me = cfg.n_experts // layout.ep, layout.coordinate(rank, "ep")
    own_rows = sum(per_expert[me * local_experts : (me + 1) * local_experts])
    # a row goes out in the residual stream's dtype and comes back in the experts' (their matmuls' output)
    stream = stream_dtype(layout, work).itemsize
    expert_out = 2 if work.mixed_precision == "bf16" else 4
    record = {"sent_rows": assignments, "received_rows": assignments, "own_rows": own_rows,
              "row_bytes": cfg.d_model * (stream + expert_out), "experts": cfg.n_experts}  # fmt: skip
    return [dict(record) for _ in range(blocks * m * work.micro_batches)]


def forget_routing(exchanges: list[AllToAll]) -> None:
    for exchange in exchanges:
        exchange.routing.clear()


class ExpertParallel(Piece, SplitsParameters, HooksTheStep, Measures):
    """The piece of a mixture of experts, on whenever the model has experts: its counts summed over the
    data-parallel ranks (any layout), its experts split over ep (ep > 1), its loads reported."""

    name = dim = "ep"
    Flags = Flags
    MISTAKES = MISTAKES

    def is_on(self, plan: Plan) -> bool:
        return bool(plan.work.model.n_experts)

    def traits(self, plan: Plan) -> set[str]:
        # every MoE routes each token by its own micro-batch's loads; ep > 1 sends the tokens to other ranks' experts
        return {"routes_tokens"} | ({"tokens_sent_to_experts"} if plan.layout.ep > 1 else set())

    def refuse(self, plan: Plan) -> None:
        refuse(plan)

    def apply(self, stages: list, ctx: Context) -> list:
        for stage in stages:  # the balancing loss's gradient divided over the micro-batches, as the loss's is
            for layer in moe_layers(stage):
                layer.aux_loss_scale = 1 / ctx.work.micro_batches
        layout = ctx.layout
        # the ranks whose tokens make the step's batch: the data-parallel ones and the cp ranks (each holds
        # chunks of the sequences), over which the counts are summed and the experts' gradients averaged
        data_dims = tuple(d for d in ("dp_replicate", "dp_shard", "ep", "cp") if getattr(layout, d) > 1)
        state = ctx.runtime[self.name] = {
            "exchanges": [],
            "replicas": None,
            "balance_history": [],
            "tp": None,
            "token_ranks": layout.dp * layout.cp,  # what the experts' summed gradients are divided by
        }
        if ctx.args.wrong_variant == "expert_gradients_summed_over_tp":
            state["tp"] = ctx.mesh["tp"].get_group()
        if not data_dims:  # one data-parallel rank: its counts are the global ones
            return stages
        data_group = submesh(ctx.mesh, data_dims).get_group()
        for stage in stages:
            if moe_layers(stage):
                ep_mesh = ctx.mesh["ep"] if layout.ep > 1 else None
                state["exchanges"] += apply(stage, ep_mesh, data_group, layout, ctx.rank, ctx.args)
        # the ranks that hold the same experts (the data-parallel ranks of other ep coordinates' peers: not ep)
        replica_dims = tuple(d for d in data_dims if d != "ep")
        if ctx.args.wrong_variant == "experts_averaged_without_cp":
            replica_dims = tuple(d for d in replica_dims if d != "cp")
            state["token_ranks"] = layout.dp
        if state["exchanges"] and replica_dims:
            state["replicas"] = submesh(ctx.mesh, replica_dims).get_group()
        return stages

    def claims(self, stage, ctx: Context) -> list:
        return expert_parameters(stage)

    def local_shape(self, name: str, shape: list[int], t: Theory) -> list[int]:
        return local_shape(name, shape, t.layout)

    def claims_name(self, name: str, t: Theory) -> bool:
        return split(name, t.layout)

    def sent(self, t: Theory) -> list[Traffic]:
        return sent(t)

    def before_micro_batch(self, job) -> None:
        forget_routing(job.state(self)["exchanges"])

    def after_backward(self, job) -> None:
        state = job.state(self)
        if state["exchanges"] and job.accelerator.sync_gradients:
            reduce_gradients(job.model, state["replicas"], state["token_ranks"], state["tp"])

    def before_clip(self, job) -> None:
        """The step's loads (summed over the data-parallel ranks) move the balancing bias."""
        job.state(self)["balance_history"].append(moe.balance(job.model))

    def assumed_inputs(self, t: Theory) -> dict:
        """A uniform routing's records (what experiments/at_scale.py assumes, the planner prices)."""
        return (
            {"routing": uniform_routing(t.layout, t.work, t.args, t.rank, t.blocks)}
            if t.layout.ep > 1
            else {}
        )

    def theory_inputs(self, job) -> dict:
        """What this rank's exchanges sent and received in the last forward."""
        return {
            "routing": [record for exchange in job.state(self)["exchanges"] for record in exchange.routing]
        }

    def step_figures(self, job) -> dict:
        """A step's load imbalance (max / mean tokens per expert, the blocks' mean) and dropped share."""
        history = job.state(self)["balance_history"]
        if not history:
            return {}
        last = history[-1]
        return {
            "expert_imbalance": last["imbalance"].mean(),
            "expert_dropped_fraction": last["dropped_fraction"],
        }

    def report(self, job, session) -> None:
        state = job.state(self)
        # the forward's all-to-all seconds twice (the backward's send the same bytes back; not timed apart)
        # over the forward and backward seconds of every step (this rank's)
        trained = sum(
            t.get("forward", 0) + t.get("backward", 0) for t in getattr(job.instruments, "step_times", [])
        )
        a2a = sum(exchange.seconds for exchange in state["exchanges"])
        moe.report(
            session, state["balance_history"], 2 * a2a / trained if state["exchanges"] and trained else None
        )


PIECE = ExpertParallel()
