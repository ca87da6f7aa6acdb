"""Mixture-of-experts MLP: top-k router, dropless grouped experts, optional shared experts.

The block routes, sorts tokens by expert, runs `experts(x_sorted, counts)` (counts: a tensor of
rows per expert) and scatters the weighted results back. Expert parallelism wraps `experts` from
outside (all-to-all there and back around the same call), so this file holds no communication.

Load balancing, both optional:
  * an auxiliary loss, computed per sequence (DeepSeek-V3's sequence-wise form):
      aux = mean_b sum_e f_be · P_be,   f_be = E/(k·s) · #tokens of b routed to e,
      P_be = mean over b's tokens of the router probability of e.
    Per-sequence statistics make the loss a plain mean over sequences, so splitting the batch
    across data-parallel ranks or micro-batches changes nothing. Its gradient is attached to the
    block output (the value returned is unchanged), so it works through pipeline stages too.
  * the auxiliary-loss-free bias (DeepSeek-V3): a per-expert bias added to the scores for
    *selection only*, nudged after each step towards under-loaded experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelSpec
from fivefold.model.mlp import SwiGLU


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, also feeds d(scale·aux)/d(aux) = scale into `aux`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, grad_aux, None


class Router(nn.Module):
    """Scores every expert per token and picks the top k."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k = spec.experts_per_token
        self.score = spec.router_score
        self.normalize = spec.router_norm_topk
        self.weight = nn.Parameter(torch.empty(spec.experts, spec.hidden))
        # selection-only bias of the auxiliary-loss-free scheme; saved with the model
        self.register_buffer("expert_bias", torch.zeros(spec.experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (weights [tokens, k], experts [tokens, k], probs [tokens, E])."""
        logits = F.linear(x, self.weight).float()
        probs = torch.sigmoid(logits) if self.score == "sigmoid" else logits.softmax(dim=-1)
        _, chosen = torch.topk(probs + self.expert_bias.float(), self.top_k, dim=-1)
        weights = probs.gather(-1, chosen)
        if self.normalize:  # as HF does, also for top-1 (whose weight then is 1: no LM-loss gradient)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen, probs


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights; input rows arrive sorted by expert.

    Weights are [E, out, in] like nn.Linear per expert, so expert parallelism shards dim 0 and
    tensor parallelism can shard the ffn dim, both from outside.
    """

    def __init__(self, experts: int, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))
        self.up_proj = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted: [n, hidden], rows grouped by expert; counts: [E] rows of each expert."""
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        if x_sorted.is_cuda and torch.is_autocast_enabled("cuda"):
            # autocast does not cover torch's grouped matmul: cast as autocast would for each
            # expert's matmul, so bf16 autocast over fp32 masters takes the grouped kernel too
            low = torch.get_autocast_dtype("cuda")
            x_sorted, weights = x_sorted.to(low), tuple(w.to(low) for w in weights)
        if grouped_mm_fits(x_sorted, weights[0]):
            return swiglu_grouped_mm(x_sorted, counts, *weights)
        return swiglu_per_expert(x_sorted, counts, *weights)


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: on CUDA, bf16 on both sides (autocast
    does not cover it), rows and weights 16-byte aligned. Elsewhere the per-expert loop runs."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == weight.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0
        and weight.shape[1] % 8 == 0
    )


def swiglu_grouped_mm(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """All experts in one grouped matmul per projection: group e is rows offsets[e-1]:offsets[e]."""
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    hidden = F.silu(torch._grouped_mm(x, gate.transpose(-2, -1), offs=offsets))
    hidden = hidden * torch._grouped_mm(x, up.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(hidden, down.transpose(-2, -1), offs=offsets)


def swiglu_per_expert(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """One matmul per expert on its contiguous rows."""
    outputs = []
    for e, rows in enumerate(x.split(counts.tolist(), dim=0)):
        hidden = F.silu(rows @ gate[e].t()) * (rows @ up[e].t())
        outputs.append(hidden @ down[e].t())
    # an expert with no rows still joins the graph (empty matmul), so its gradient is zeros, not None
    return torch.cat(outputs, dim=0)


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_experts = spec.experts
        self.top_k = spec.experts_per_token
        self.aux_loss_coef = spec.aux_loss_coef
        self.bias_rate = spec.router_bias_rate
        self.gate = Router(spec)
        self.experts = GroupedExperts(spec.experts, spec.hidden, spec.expert_ffn_hidden)
        self.shared_expert = (
            SwiGLU(spec.hidden, spec.expert_ffn_hidden * spec.shared_experts) if spec.shared_experts else None
        )
        # set by the training loop: the factor its loss applies per micro-batch (1 / accumulation)
        self.aux_loss_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        self.register_buffer("tokens_per_expert", torch.zeros(spec.experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        weights, chosen, probs = self.gate(flat)
        counts_t = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert += counts_t.to(self.tokens_per_expert.dtype)
        order = torch.argsort(chosen.reshape(-1), stable=True)
        token_of_row = order // self.top_k
        expert_out = self.experts(flat[token_of_row], counts_t)
        expert_out = expert_out * weights.reshape(-1, 1)[order]
        out = torch.zeros_like(flat).index_add_(0, token_of_row, expert_out).view(b, s, h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.training and self.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = self.sequence_aux_loss(probs.view(b, s, -1), chosen.view(b, s, -1))
            self.last_aux_loss = aux.detach()
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_coef * self.aux_loss_scale)
        return out

    def sequence_aux_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """probs: [b, s, E], chosen: [b, s, k] -> scalar mean over sequences."""
        b, s, k = chosen.shape
        counts = torch.zeros(b, self.num_experts, device=probs.device).scatter_add_(
            1, chosen.reshape(b, -1), torch.ones(b, s * k, device=probs.device)
        )
        load = counts * (self.num_experts / (k * s))
        return (load * probs.mean(dim=1)).sum(dim=-1).mean()

    @torch.no_grad()
    def update_bias(self, global_counts: torch.Tensor | None = None) -> None:
        """Auxiliary-loss-free balancing step; `global_counts` are counts summed over data ranks."""
        counts = self.tokens_per_expert if global_counts is None else global_counts
        if self.bias_rate > 0 and counts.sum() > 0:
            self.gate.expert_bias += self.bias_rate * torch.sign(counts.mean() - counts)
        self.tokens_per_expert.zero_()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The training loop divides each micro-batch loss by `1/scale`; the aux loss must follow."""
    for m in moe_layers(model):
        m.aux_loss_scale = scale
