"""A mixture-of-experts MLP for common/gpt.py's blocks (GPTConfig.n_experts > 0), readable top to bottom.

Each token's router scores every expert (softmax, or sigmoid as DeepSeek-V3); the token goes to its top_k
experts, and their outputs come back weighted by its scores of them: the raw scores (torchtitan's default,
Switch Transformer's top-1), or, with route_norm, renormalised over the k chosen (Mixtral, DeepSeek-V3). At
top_k 1 a renormalised weight is exactly 1: the router would get no gradient from the language-model loss.
Dropless by default: every expert takes every token sent to it. With
capacity_factor c > 0 each expert takes at most ceil(c x tokens x k / experts) of one forward's tokens, the
rest dropped (their residual stream passes unchanged; the fraction reported). The tokens are the GLOBAL
micro-batch's, every data-parallel rank's, in the order one process sees them (rank 0's rows first): each rank
learns how many assignments the ranks before it sent to each expert (`earlier_assignments`), so that the same
tokens are dropped as one process would drop.

Load balancing, the field's two kinds:
- the auxiliary loss (Switch Transformer, Megatron): aux_loss_coef x experts x sum_i f_i P_i, f_i the share of
  the k x tokens assignments expert i was sent (before any capacity drops them, as Megatron counts), P_i its
  mean router probability (a sigmoid router's scores normalised over the experts first). f_i counts the GLOBAL
  batch's tokens (every data-parallel rank's), so that data parallelism's averaged gradient equals one
  process's; the term's gradient is added to the router's in backward without changing the reported loss
  (Megatron's MoEAuxLossAutoScaler), scaled like the language-model loss's under gradient accumulation
  (`aux_loss_scale`, 1 / the accumulation steps): the GPT's loss stays the language-model loss;
- auxiliary-loss-free balancing (DeepSeek-V3, torchtitan): a per-expert bias added to the scores only to choose
  the experts (not to weigh them), moved after each optimizer step by bias_update_rate x sign(mean load - load),
  from the step's global token counts.

Shared experts (DeepSeek-MoE, DeepSeek-V3; n_shared_experts > 0): always-on experts beside the routed ones,
one dense MLP n x hidden wide that every token goes through, its output added to the routed experts' unweighted.

Expert parallelism (strategies/ep.py) splits the experts over ranks: the `exchange` hook sends each token to
the rank of its expert and back (all-to-all). The experts' weights are stacked (experts, in, out), so that a
split over ranks is a split of dim 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ROUTERS = ("softmax", "sigmoid")


class AttachAuxLoss(torch.autograd.Function):
    """Returns `output` unchanged; in backward, also backpropagates `aux_loss` (gradient `scale`: 1, or 1 / k
    under k micro-batches of accumulation, as the language-model loss is divided), so that the balancing term
    trains the router without being part of the loss the run reports (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def recomputing() -> bool:
    """A forward run again inside the backward (activation checkpointing's recompute of a MoE block, full or
    selective): its tokens were counted, and its routing recorded, when it first ran."""
    return torch._C._current_graph_task_id() != -1


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (this rank's experts of a stacked weight under expert parallelism, FSDP2's shard,
    tensor parallelism's), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def expert_dtype(tokens: torch.Tensor) -> torch.dtype:
    """The experts' compute dtype: the tokens', or autocast's for the tokens' own device type (a GPU run's is
    cuda's). Under FSDP's bf16 policy the tokens are bf16 while ep's experts, which FSDP leaves alone, stay float32;
    autocast does not cast _grouped_mm's inputs (measured, torch 2.13)."""
    device_type = tokens.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else tokens.dtype


def run_experts(moe: MoE, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Tokens grouped by expert (counts[e] rows for this rank's e-th expert, in order) through their experts: three
    grouped GEMMs (torch._grouped_mm, one kernel for every expert's rows), or, with expert_matmul "loop" or where
    the grouped kernel cannot run, the per-expert loop it is checked against (tests/test_moe.py: equal)."""
    w_in, w_out = local(moe.w_in), local(moe.w_out)
    w_gate = local(moe.w_gate) if moe.w_gate is not None else None
    dtype = expert_dtype(tokens)
    w_in, w_out = w_in.to(dtype), w_out.to(dtype)
    w_gate = w_gate.to(dtype) if w_gate is not None else None
    rows = tokens.to(dtype)
    if moe.expert_matmul == "grouped" and can_group(rows, w_in):
        offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        hidden = torch._grouped_mm(rows, w_in, offs=offsets)
        gate = None if w_gate is None else torch._grouped_mm(rows, w_gate, offs=offsets)
        hidden = F.gelu(hidden) if gate is None else F.silu(gate) * hidden
        return torch._grouped_mm(hidden, w_out, offs=offsets)
    outputs = []
    for e, expert_rows in enumerate(rows.split(counts)):
        hidden = expert_rows @ w_in[e]
        hidden = F.gelu(hidden) if w_gate is None else F.silu(expert_rows @ w_gate[e]) * hidden
        outputs.append(hidden @ w_out[e])
    return torch.cat(outputs) if outputs else rows.new_zeros(0, w_out.shape[-1])


def can_group(tokens: torch.Tensor, w_in: torch.Tensor) -> bool:
    """torch._grouped_mm's limits on CPU (torch 2.13, measured): every row 16-byte aligned (d_model and the
    hidden width multiples of 8 in bf16, of 4 in float32); on fake tensors (experiments/at_scale.py) bf16 only:
    its meta kernel refuses float32."""
    from torch._subclasses.fake_tensor import FakeTensor

    aligned = all(width * tokens.dtype.itemsize % 16 == 0 for width in w_in.shape[1:])
    if isinstance(tokens, FakeTensor) or tokens.device.type != "cpu":
        return aligned and tokens.dtype == torch.bfloat16  # CUDA's kernel is bf16's (torchtitan's experts)
    return aligned


class LocalExchange:
    """No expert parallelism: every expert is here, the tokens go straight to them."""

    def __call__(self, moe: MoE, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return run_experts(moe, routed, counts)


class MoE(nn.Module):
    # buffers DDP must not broadcast from rank 0 in every forward (strategies/replicate.py): each rank's own
    # token counts, and the bias, which every rank moves alike from the summed counts
    rank_local_buffers = ("expert_bias", "tokens_per_expert", "dropped")

    def __init__(self, cfg, shared: nn.Module | None = None):
        super().__init__()
        d, hidden, experts = cfg.d_model, cfg.hidden, cfg.n_experts
        self.n_experts, self.top_k, self.router_kind = experts, cfg.top_k, cfg.router
        self.route_norm = cfg.route_norm
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.bias_update_rate = cfg.bias_update_rate
        self.expert_matmul = cfg.expert_matmul
        self.router = nn.Linear(d, experts, bias=False)
        # DeepSeek's shared experts: n always-on experts beside the routed ones, one dense MLP n x hidden wide
        # (no biases, as the routed experts); data-parallel like the rest of the model, never sent anywhere
        if (shared is not None) != bool(cfg.n_shared_experts):  # the model that builds it makes them
            raise ValueError(f"n_shared_experts {cfg.n_shared_experts} needs the shared experts handed in "
                             "(common/gpt.shared_experts), and only then")  # fmt: skip
        self.shared = shared
        self.w_in = nn.Parameter(torch.empty(experts, d, hidden))
        self.w_gate = nn.Parameter(torch.empty(experts, d, hidden)) if cfg.mlp == "swiglu" else None
        self.w_out = nn.Parameter(torch.empty(experts, hidden, d))
        # the balancing bias is state, not a parameter (no gradient): in checkpoints, moved by `balance`
        self.register_buffer("expert_bias", torch.zeros(experts))
        # this step's tokens per expert (this rank's), and the dropped assignments, summed by `balance`
        self.register_buffer("tokens_per_expert", torch.zeros(experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        # hooks: expert parallelism's all-to-all (strategies/ep.py); the data-parallel ranks' counts summed (ep.py)
        self.exchange = LocalExchange()
        self.global_counts = lambda counts: counts
        # (assignments per expert that the data-parallel ranks before this one made in this forward, the ranks)
        self.earlier_assignments = lambda counts: (torch.zeros_like(counts), 1)
        self.weigh_outputs = True  # False only for ep.py's wrong variant combine_without_router_weights
        # the aux loss's gradient: 1 / the accumulation steps (strategies/ep.py sets it)
        self.aux_loss_scale = 1.0
        self.order = self.order_by_expert

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen experts (N, k), their weights (N, k), every expert's score (N, E)) of N tokens (N, d)."""
        logits = self.router(flat).float()
        scores = logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()
        # the bias only chooses (the weights are the scores themselves)
        chosen = (scores.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / weights.sum(-1, keepdim=True) if self.route_norm else weights, scores

    def keep_within_capacity(self, expert_ids: torch.Tensor, tokens: int) -> torch.Tensor:
        """Which of the flattened assignments each expert takes: all (dropless), or each expert's first
        ceil(capacity_factor x global tokens x k / E) in the global micro-batch's token order (this rank's
        `tokens` after the earlier data-parallel ranks' and before the later ones')."""
        if self.capacity_factor <= 0:
            return torch.ones_like(expert_ids, dtype=torch.bool)
        one_hot = F.one_hot(expert_ids, self.n_experts)
        earlier, ranks = self.earlier_assignments(one_hot.sum(0))
        # 2 ranks x 128 tokens x top-2 over 4 experts at c = 1.25: ceil(1.25 x 256 x 2 / 4) = 160 per expert
        capacity = math.ceil(self.capacity_factor * tokens * ranks * self.top_k / self.n_experts)
        place_in_expert = (one_hot.cumsum(0) * one_hot).sum(-1)  # 1 for an expert's first token here, 2 ...
        return place_in_expert + earlier[expert_ids] <= capacity

    def order_by_expert(self, expert_ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, list[int]]:
        """The kept assignments in expert order (indices into the flattened (token, choice) pairs) and how many
        each expert got; a forward with gradients adds them to the step's counts (what `balance` sums)."""
        kept = self.keep_within_capacity(expert_ids, tokens)
        assignment = torch.argsort(expert_ids.masked_fill(~kept, self.n_experts), stable=True)
        counts = torch.bincount(expert_ids[kept], minlength=self.n_experts)
        if torch.is_grad_enabled() and not recomputing():  # a training forward's tokens (not an evaluation's)
            self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
            self.dropped += (~kept).sum()
        counts = counts.tolist()
        return assignment[: sum(counts)], counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        flat = x.reshape(-1, width)
        chosen, weights, scores = self.route(flat)
        expert_ids = chosen.flatten()  # assignment j = token j // k's (j % k)-th expert
        # a hook: experiments/at_scale.py, whose fake tensors hold no routing, puts a uniform one here
        assignment, counts = self.order(expert_ids, flat.shape[0])
        token_of = assignment // self.top_k
        outputs = self.exchange(self, flat[token_of], counts)  # (kept assignments, d), in expert order
        weighted = (
            outputs * weights.flatten()[assignment].unsqueeze(-1).to(outputs.dtype)
            if self.weigh_outputs
            else outputs
        )
        combined = torch.zeros_like(flat).index_add(0, token_of, weighted.to(flat.dtype))
        if self.shared is not None:  # every token, unweighted (DeepSeek-V3: output = shared + routed)
            combined = combined + self.shared(flat)
        if self.aux_loss_coef > 0 and self.training and torch.is_grad_enabled():
            sent = torch.bincount(expert_ids, minlength=self.n_experts)  # f_i before any capacity drops
            combined = AttachAuxLoss.apply(combined, self.aux_loss(sent, scores), self.aux_loss_scale)
        return combined.view(batch, time, width)

    def aux_loss(self, counts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """coef x E x sum_i f_i P_i: f_i from every data-parallel rank's counts of assignments sent (no gradient),
        P_i over this rank's tokens (averaged over the ranks by data parallelism's gradient average). P_i is a
        probability: a sigmoid router's scores are normalised over the experts first (they need not sum to 1)."""
        global_counts = self.global_counts(counts.float())
        share = global_counts / global_counts.sum()
        probabilities = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        return self.aux_loss_coef * self.n_experts * (share * probabilities.mean(0)).sum()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def balance(model: nn.Module) -> dict:
    """After a step's backward (every rank, each step): each MoE layer's step counts summed over the data-parallel
    ranks (its `global_counts` hook), the bias moved by bias_update_rate x sign(mean - load) when the rate is > 0,
    the counts reset.
    Returns the step's figures: max / mean tokens per expert (1 = balanced) per layer, the dropped share, and the
    loads themselves (layer, expert), as tensors on the model's device: read where they are logged (a GPU run waits
    for the device at each read; every step here would make the step wait)."""
    imbalance, loads, lost = [], [], []
    for layer in moe_layers(model):
        # the step's loads and dropped assignments, summed over the data-parallel ranks in one all-reduce
        summed = layer.global_counts(torch.cat([layer.tokens_per_expert, layer.dropped.reshape(1)]))
        counts = summed[:-1]
        if layer.bias_update_rate > 0:
            layer.expert_bias += layer.bias_update_rate * torch.sign(counts.mean() - counts)
        imbalance.append(counts.max() / counts.mean().clamp(min=1e-9))
        loads.append(counts)
        lost.append(summed[-1])
    forget_counts(model)
    loads_, dropped = torch.stack(loads), torch.stack(lost).sum()
    return {"imbalance": torch.stack(imbalance), "loads": loads_,
            "dropped_fraction": dropped / (loads_.sum() + dropped).clamp(min=1.0)}  # fmt: skip


@torch.no_grad()
def forget_counts(model: nn.Module) -> None:
    """Every MoE layer's counts of the step so far (tokens per expert, assignments dropped) back to zero."""
    for layer in moe_layers(model):
        layer.tokens_per_expert.zero_()
        layer.dropped.zero_()


def init_experts(model: nn.Module, n_layer: int) -> None:
    """GPT-2's init for the experts' stacked weights: N(0, 0.02), the output projection scaled by depth."""
    for layer in moe_layers(model):
        for weight in (layer.w_in, layer.w_gate):
            if weight is not None:
                nn.init.normal_(weight, mean=0.0, std=0.02)
        nn.init.normal_(layer.w_out, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def moe_parameter_count(cfg) -> int:
    """The MoE MLP's parameters (router and every expert): replaces the dense MLP's in parameter_count."""
    matrices = 3 if cfg.mlp == "swiglu" else 2
    routed_and_shared = cfg.n_experts + cfg.n_shared_experts
    return cfg.d_model * cfg.n_experts + routed_and_shared * matrices * cfg.d_model * cfg.hidden


def active_parameter_count(cfg, total: int) -> int:
    """Parameters a token uses: all but the routed experts it is not sent to (the shared ones it always uses)."""
    if not cfg.n_experts:
        return total
    matrices = 3 if cfg.mlp == "swiglu" else 2
    unused = cfg.n_layer * (cfg.n_experts - cfg.top_k) * matrices * cfg.d_model * cfg.hidden
    return total - unused


def report(session, history: list[dict], all_to_all_share: float | None) -> None:
    """What a user of a mixture of experts watches (main process): tokens per expert per step as max / mean (1 =
    balanced; mean over the blocks), first and last steps, the dropped share, in the summary and a PNG."""
    if not session.is_main or not history:
        return
    # one read of the device, at the end
    per_step = torch.stack([h["imbalance"].mean() for h in history]).tolist()
    window = max(1, len(per_step) // 10)
    first, last = sum(per_step[:window]) / window, sum(per_step[-window:]) / window
    dropped = torch.stack([h["dropped_fraction"] for h in history]).mean().item()
    session.metrics["moe"] = {"imbalance_per_step": per_step, "imbalance_first": first, "imbalance_last": last,
                              "dropped_fraction": dropped, "loads_first_step": history[0]["loads"].tolist(),
                              "loads_last_step": history[-1]["loads"].tolist(),
                              "all_to_all_share_of_step": all_to_all_share}  # fmt: skip
    share = f"; all-to-all {100 * all_to_all_share:.0f}% of the step" if all_to_all_share is not None else ""
    session.print(f"experts: tokens per expert max / mean {first:.2f} (first {window} steps) -> {last:.2f} (last "
                  f"{window}), {100 * dropped:.1f}% of assignments dropped{share}")  # fmt: skip
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to leave behind

    figure = Figure(figsize=(6, 3.2))
    axes = figure.add_subplot()
    axes.plot(range(1, len(per_step) + 1), per_step)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xlabel("step")
    axes.set_ylabel("tokens per expert, max / mean")
    axes.set_title("expert load imbalance (mean over blocks)")
    figure.savefig(f"{session.output_dir}/moe_balance.png", dpi=100, bbox_inches="tight")
