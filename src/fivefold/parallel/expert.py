"""Expert parallelism: each rank of the `ep` group owns E/ep experts of every MoE layer.

`ExpertParallel` is a torch `ParallelStyle`, applied to each MoE layer's `GroupedExperts` from
outside with `parallelize_module`, as the tensor-parallel styles are. Through `distribute_module`:

  * partition_fn: the expert weights become DTensors sharded on dim 0 over the `ep` mesh (each
    materialises as that slice of the single-process init);
  * input_fn (a forward pre-hook) dispatches: an all-to-all of the per-expert row counts, then the
    rows to the ranks owning their experts (all_to_all_single_autograd: its backward is the reverse
    all-to-all); the received rows, ordered by source rank then local expert, are regrouped by
    local expert with one index_select, and the experts run on this rank's slice of the weights;
  * output_fn (a forward hook) combines: the results back in source-rank order, then the reverse
    all-to-all to the ranks that routed them. The MoE block's weighting and scatter are unchanged.

`ep` folds onto the data-parallel ranks (it divides fsdp×cp), so every rank routes its own tokens.
In generation the replicas sharing experts meet in every MoE layer, so they decode in lockstep
(`ExpertPeers`, at the end).

Gradients: an expert's gradient on its owner sums the contributions of the whole ep group's tokens
(the dispatch brought them all in), while the loss is the mean over data ranks: the ep share of
that mean is divided out in backward, on the weights' local views. What is left is the average over
the other ranks holding the same experts: FSDP's reduce-scatter over expert_fsdp (`shard_experts`)
when fsdp is used, and `reduce_expert_replicas` for the rest, from the runners' gradient
finalisation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from fivefold.errors import FivefoldError
from fivefold.model.moe import GroupedExperts, moe_layers

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class ExpertParallel(ParallelStyle):
    """Shard a `GroupedExperts` on dim 0 over a 1-D mesh and move its rows there and back.

    One instance per module: it keeps the split sizes and the regrouping of the forward under way
    between its pre-hook and its hook. `group` is the process group the rows travel on (the mesh's
    by default; see `_dispatch_group`).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self._pending: tuple | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, GroupedExperts):
            raise FivefoldError(f"expert parallelism applies to GroupedExperts, not {type(module).__name__}")
        ranks = device_mesh.size()
        experts = module.gate_proj.shape[0]
        if experts % ranks:
            raise FivefoldError(f"--ep {ranks} must divide the {experts} experts")
        if self.group is None:
            self.group = device_mesh.get_group()
        module.dispatch_group = self.group  # for callers that must meet the dispatch (serve's lockstep)
        module.rows_received = 0  # rows this rank's experts computed: the dispatch's byte count
        # rows of each forward in call order, while a measurement asks (None: not kept, so that a long
        # training run does not grow a list): what the activations of each micro-batch hold
        module.rows_log = None
        return distribute_module(
            module, device_mesh, partition_fn=_shard_dim0, input_fn=self._dispatch, output_fn=self._combine
        )

    def _dispatch(self, module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x, counts = inputs
        ranks = device_mesh.size()
        with torch.no_grad():
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv = recv_counts.view(ranks, -1)  # [source rank, local expert]
        send_splits = counts.view(ranks, -1).sum(dim=1).tolist()
        recv_splits = recv.sum(dim=1).tolist()
        rows = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        order = _by_local_expert(recv, sum(recv_splits))
        module.rows_received += order.numel()
        if module.rows_log is not None:
            module.rows_log.append(order.numel())
        self._pending = (send_splits, recv_splits, order, _use_local_weights(module, x.dtype, ranks))
        return rows.index_select(0, order), recv.sum(dim=0)

    def _combine(self, module: nn.Module, out: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        assert self._pending is not None, "combine without a dispatch"
        send_splits, recv_splits, order, weights = self._pending
        self._pending = None
        module._parameters.update(weights)  # the parameters again, for FSDP's hooks and the optimizer
        back = out.index_select(0, _inverse(order))  # source-rank order again
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


def _shard_dim0(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Each expert weight [E, out, in] as a DTensor sharded on the expert dim (no communication:
    every rank keeps its own chunk of the same tensor, or of the same meta tensor)."""
    if not isinstance(module, GroupedExperts):
        return
    for weight in EXPERT_WEIGHTS:
        full = getattr(module, weight)
        local = distribute_tensor(full.detach(), mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(weight, nn.Parameter(local, requires_grad=full.requires_grad))


def _use_local_weights(module: nn.Module, dtype: torch.dtype, ranks: int) -> dict[str, nn.Parameter]:
    """For this forward, let the unchanged expert code see this rank's slice as plain tensors (the
    rows it receives are not a DTensor: their count per rank is data-dependent), as FSDP swaps its
    gathered parameters in and out around a forward. Returns the parameters to put back.

    The view divides its gradient by ep: the loss is the mean over data ranks, and this rank's
    experts got the rows of all ep ranks. It is cast to the rows' dtype: FSDP's bf16 policy does
    not reach experts it leaves out (without expert_fsdp).
    """
    saved = {}
    for name in EXPERT_WEIGHTS:
        param = module._parameters[name]
        saved[name] = param
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.requires_grad and torch.is_grad_enabled():
            local = local.view_as(local)
            local.register_hook(lambda grad: grad / ranks)
        module._parameters[name] = local.to(dtype)  # type: ignore[assignment]
    return saved


def _by_local_expert(recv: torch.Tensor, total: int) -> torch.Tensor:
    """The received rows, ordered (source rank, local expert), as indices ordered (local expert,
    source rank): `recv[r, e]` rows per segment; all on the device, no loop over rows."""
    sizes = recv.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(recv).t().reshape(-1)  # where each segment lies
    by_expert = recv.t().reshape(-1)  # segment sizes in the new order
    segment = torch.repeat_interleave(
        torch.arange(by_expert.numel(), device=recv.device), by_expert, output_size=total
    )
    first = torch.cumsum(by_expert, 0) - by_expert  # each segment's first row in the new order
    return starts[segment] + torch.arange(total, device=recv.device) - first[segment]


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def apply_expert_parallel(model: nn.Module, runtime_mesh: Any) -> list[nn.Parameter]:
    """`ExpertParallel` on every MoE layer's experts (in place); returns the expert parameters."""
    ep_mesh = runtime_mesh.get("ep")
    group = _dispatch_group(runtime_mesh)
    sharded: list[nn.Parameter] = []
    for moe in moe_layers(model):
        parallelize_module(moe.experts, ep_mesh, ExpertParallel(group))
        sharded += [getattr(moe.experts, name) for name in EXPERT_WEIGHTS]
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


def shard_experts(model: nn.Module, runtime_mesh: Any, zero: int, policy: Any) -> None:
    """FSDP over `expert_fsdp`: each MoE layer's experts (already split over ep) become one FSDP unit
    of their own on the (expert_fsdp, ep) mesh, applied before the model's FSDP, which then skips
    them. FSDP reduce-scatters (averages) their gradients over expert_fsdp.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = runtime_mesh.get("expert_fsdp")
    for moe in moe_layers(model):
        fully_shard(moe.experts, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=policy)


@torch.no_grad()
def reduce_expert_replicas(model: nn.Module, runtime_mesh: Any) -> None:
    """Average expert gradients over the ranks that hold the same experts and that FSDP does not
    reduce: `dp`, and `expert_fsdp` where the experts are not FSDP-sharded over it.

    These stay a hand-written all-reduce, once a step after the last micro-batch: FSDP2's HSDP
    needs a 2-D (dp, expert_fsdp) mesh sharing the root, and torch does not slice one from it
    (expert_fsdp exists only as an unflattening of the flattened fsdp_cp; unflattening dp_fsdp_cp
    instead would give one only where dp lies outside fsdp and cp in the order), nor the
    (dp, expert_fsdp) replicas of a layout without fsdp; DDP takes no DTensor. Where dp alone is
    left (ep spans fsdp×cp), torch's `replicate` over dp could take them; one path serves every
    case instead. The ep share of the mean was divided out in backward (`_use_local_weights`).
    """
    for moe in moe_layers(model):
        by_fsdp = isinstance(moe.experts, FSDPModule)
        dims = ("dp",) if by_fsdp else ("expert_fsdp", "dp")
        groups = [runtime_mesh.group(d) for d in dims if runtime_mesh.size(d) > 1]
        divide = 1
        for d in dims:
            divide *= runtime_mesh.size(d)
        for name in EXPERT_WEIGHTS:
            grad = getattr(moe.experts, name).grad
            if grad is None or not groups:
                continue
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            for group in groups:
                dist.all_reduce(local, group=group)
            local.div_(divide)


class ExpertPeers:
    """The lockstep of the replicas that share experts (`fivefold.model.generate.Lockstep`).

    Every MoE layer's dispatch is a collective of the ep group, so each replica must run each MoE
    layer as often as its peers, even once its own rows are done. Each step the peers agree, with
    one all-reduce (max) of a flag over the ep group, whether any still decodes; a replica that is
    done then runs only its chunk's experts, in layer order, on no rows of its own: its dispatch
    sends nothing and its experts compute the rows the peers send them.
    """

    def __init__(self, chunk: Any, device: torch.device) -> None:
        self.layers = [moe.experts for moe in moe_layers(chunk)]
        self.experts = chunk.spec.experts
        self.group = self.layers[0].dispatch_group
        self.dtype = next(chunk.parameters()).dtype
        self.hidden = chunk.spec.hidden
        self.device = device
        self.ledger: Any = None
        self.asked = False  # the first flag goes with the prefill
        self.idle_steps: list[int] = []  # the ledger's steps in which this replica only idled

    def busy(self, mine: bool) -> bool:
        flag = torch.tensor([int(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if self.ledger is not None and self.asked:  # the ledger's steps end here, not in StageStep
            self.ledger.next_step()
        self.asked = True
        return bool(flag.item())

    def idle(self) -> None:
        if self.ledger is not None:
            self.idle_steps.append(len(self.ledger.steps) - 1)
        none = torch.empty(0, self.hidden, dtype=self.dtype, device=self.device)
        counts = torch.zeros(self.experts, dtype=torch.long, device=self.device)
        for experts in self.layers:
            # the combine's output has no rows, so nothing reads it: wait for it, as a read would
            wait_tensor(experts(none, counts))
