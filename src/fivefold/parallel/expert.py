"""Expert parallelism: each rank of the `ep` group owns E/ep experts of every MoE layer.

`ep` folds onto the data-parallel ranks (it divides fsdp×cp), so every rank still routes its own
tokens. Around the unchanged `experts(x_sorted, counts)` call of the MoE block:

  1. exchange per-expert row counts over `ep` (all_to_all_single of the [E] counts);
  2. send each row to the rank owning its expert (all_to_all_single_autograd: its backward is
     the reverse all-to-all), regroup the received rows by local expert, run the local experts;
  3. send the results back the same way; the block's weighting and scatter stay as they are.

Expert weights are DTensors sharded on dim 0 over the `ep` mesh (each materialises as that slice
of the single-process init); the model's FSDP leaves them out. After the all-to-alls, an expert's
gradient on its owner already sums the contributions of the whole ep group; `reduce_expert_grads`
sums it over the other ranks holding the same experts (expert_fsdp, then dp) and divides by the
number of data ranks, giving the gradient of the global mean loss that FSDP gives the rest.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard

from fivefold.errors import FivefoldError
from fivefold.model.moe import GroupedExperts, moe_layers

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def apply_expert_parallel(model: nn.Module, runtime_mesh: Any) -> list[nn.Parameter]:
    """Shard every MoE layer's experts over `ep` (in place); returns the expert parameters."""
    ep_mesh = runtime_mesh.get("ep")
    ep_group = _dispatch_group(runtime_mesh)
    sharded: list[nn.Parameter] = []
    for moe in moe_layers(model):
        experts = moe.experts
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            if full.shape[0] % ep_mesh.size():
                raise FivefoldError(f"--ep {ep_mesh.size()} must divide the {full.shape[0]} experts")
            local = full.detach().chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()]
            param = nn.Parameter(DTensor.from_local(local.contiguous(), ep_mesh, [Shard(0)], run_check=False))
            setattr(experts, name, param)
            sharded.append(param)
        experts.rows_received = 0  # rows this rank's experts computed: the dispatch's byte count
        experts.forward = types.MethodType(_make_dispatch(ep_group, ep_mesh.size()), experts)
    return sharded


def _dispatch_group(runtime_mesh: Any) -> dist.ProcessGroup:
    """The ep group, or a copy of it where its ranks are also another dim's group.

    When ep spans all of fsdp×cp, its group has the same ranks as `fsdp` and the ledger would
    credit the token all-to-alls to fsdp; a process group of its own keeps them on `ep`.
    """
    group = runtime_mesh.group("ep")
    if runtime_mesh.axis_of(group) == "ep":
        return group
    own, _ = dist.new_subgroups_by_enumeration(runtime_mesh.info.dims["ep"].groups)
    runtime_mesh.group_axes[own] = "ep"
    return own


def _make_dispatch(group: dist.ProcessGroup, ranks: int):
    def forward(self: GroupedExperts, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return _dispatch(self, x_sorted, counts, group, ranks)

    return forward


def _dispatch(
    experts: GroupedExperts, x_sorted: torch.Tensor, counts: list[int], group: dist.ProcessGroup, ranks: int
) -> torch.Tensor:
    local_experts = len(counts) // ranks
    send_counts = torch.tensor(counts, dtype=torch.int64, device=x_sorted.device)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # [source rank, local expert]
    recv = recv_counts.view(ranks, local_experts).tolist()
    send_splits = send_counts.view(ranks, local_experts).sum(dim=1).tolist()
    recv_splits = [sum(row) for row in recv]
    rows = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group)
    # received rows come by source rank, then local expert: regroup them by local expert
    starts, offset = [], 0
    for row in recv:
        starts.append([offset + sum(row[:e]) for e in range(local_experts)])
        offset += sum(row)
    order = [
        i
        for e in range(local_experts)
        for r in range(ranks)
        for i in range(starts[r][e], starts[r][e] + recv[r][e])
    ]
    order_t = torch.tensor(order, dtype=torch.long, device=x_sorted.device)
    per_expert = [sum(recv[r][e] for r in range(ranks)) for e in range(local_experts)]
    experts.rows_received += len(order)
    out = _local_experts(experts, rows.index_select(0, order_t), per_expert)
    back = torch.empty_like(out).index_copy_(0, order_t, out)  # source-rank order again
    return all_to_all_single_autograd(back, send_splits, recv_splits, group)


def _local_experts(experts: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    # FSDP's bf16 policy does not reach the experts it ignores: compute in the rows' dtype
    gate, up, down = (getattr(experts, n).to_local().to(x.dtype) for n in EXPERT_WEIGHTS)
    outputs = []
    for e, rows in enumerate(x.split(counts, dim=0)):
        outputs.append((F.silu(rows @ gate[e].t()) * (rows @ up[e].t())) @ down[e].t())
    return torch.cat(outputs, dim=0)


def shard_experts(model: nn.Module, runtime_mesh: Any, zero: int, policy: Any) -> None:
    """FSDP over `expert_fsdp`: each MoE layer's experts (already split over ep) become one FSDP unit
    of their own on the (expert_fsdp, ep) mesh, applied before the model's FSDP, which then skips
    them. FSDP reduce-scatters (averages) their gradients over expert_fsdp; `reduce_expert_grads`
    is left with the dp replicas and the 1/ep of the mean (gloo has no pre-scaled reduce op for
    FSDP's own divide factor).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = runtime_mesh.get("expert_fsdp")
    for moe in moe_layers(model):
        fully_shard(moe.experts, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=policy)
        moe.experts.fsdp_reduced = True


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, runtime_mesh: Any) -> None:
    """Sum expert gradients over the ranks holding the same experts; divide by the data ranks.

    Experts FSDP-sharded over expert_fsdp (`shard_experts`) arrive averaged over expert_fsdp by
    FSDP: only the dp replicas and the ep share of the mean remain.
    """
    for moe in moe_layers(model):
        by_fsdp = getattr(moe.experts, "fsdp_reduced", False)
        dims = ("dp",) if by_fsdp else ("expert_fsdp", "dp")
        groups = [runtime_mesh.group(d) for d in dims if runtime_mesh.size(d) > 1]
        divide = runtime_mesh.size("dp") * (
            runtime_mesh.size("ep") if by_fsdp else runtime_mesh.size("fsdp_cp")
        )
        for name in EXPERT_WEIGHTS:
            grad = getattr(moe.experts, name).grad
            if grad is None:
                continue
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            for group in groups:
                dist.all_reduce(local, group=group)
            if divide > 1:
                local.div_(divide)


def reduce_after_backward(runner: Any) -> Any:
    """Make `runner.forward_backward` finish the expert gradients before clipping sees them."""
    forward_backward = runner.forward_backward

    def with_expert_grads(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = forward_backward(inputs, labels)
        reduce_expert_grads(runner.model, runner.mesh)
        return loss

    runner.forward_backward = with_expert_grads
    return runner
