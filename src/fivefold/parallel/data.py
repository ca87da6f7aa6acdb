"""Data and sharded-data parallelism: DDP (+ ZeRO-1), FSDP2 per block (ZeRO-2/3), HSDP.

* `dp` only: torch DDP, gradients all-reduced in buckets while the backward still runs. With
  tensor parallelism underneath (DTensor weights, which DDP does not take), torch's FSDP2-based
  `replicate` does the same per block: all-reduce of each block's gradients over `dp`.
* `--zero 1`: the same DDP plus `ZeroRedundancyOptimizer`: each replica keeps the AdamW state of
  its share of the parameters, steps only those, and broadcasts them to the other replicas.
* `fsdp` (> 1): FSDP2 `fully_shard` on each block, on the embedding, on the final norm + head
  together, then on the root. Parameters, gradients and optimizer state are 1/N per rank (dim 0,
  padded up to a multiple of N). `--zero 2` keeps a block's gathered parameters from forward to
  backward; `--zero 3` re-shards after forward and gathers again in backward.
* `dp × fsdp`: HSDP, the same calls on the 2-D (dp, fsdp_cp) mesh: shard inside a replica group,
  all-reduce the reduced-scattered shard across replicas.
* bf16: FSDP2's MixedPrecisionPolicy computes in bf16 from fp32 master weights and reduces
  gradients in fp32 (the rule for every layout: `fivefold.parallel.precision`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fivefold.config import Layout, TrainSpec
from fivefold.parallel.precision import mp_policy


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, zero: int, train: TrainSpec, ignored: set[nn.Parameter] | None = None
) -> None:
    """FSDP2 units: each block, the embedding, norm + head, then the root (in place).

    `mesh` is 1-D (fsdp_cp) for FSDP or 2-D (dp, fsdp_cp) for HSDP; `ignored` parameters (experts
    sharded over ep) are neither sharded nor reduced by FSDP.
    """
    policy = mp_policy(train.dtype)
    reshard = zero == 3
    # Under tp without sp the embedding hands back DTensor.to_local()'s view of its replicated rows, and
    # FSDP2 warns that an in-place op on a view would skip its pre-backward hook. The blocks only add to
    # the residual stream out of place (x = x + ...), so the hook runs: the warning is not for this model
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor"
    )
    for unit in _units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored)
    # the root owns no parameters of its own; it drives the units (prefetch, final reduce wait)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored)


def apply_ddp(
    model: nn.Module, group: torch.distributed.ProcessGroup, ignored: set[nn.Parameter] | None = None
) -> DistributedDataParallel:
    """Wrap in torch DDP over `group`: bucketed gradient all-reduce overlapped with the backward
    (`ignored` parameters, experts sharded over ep, are left to the expert axis)."""
    if ignored:
        names = [n for n, p in model.named_parameters() if p in ignored]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    # buffers are deterministic (rotary tables) or per-rank statistics (MoE token counts): no broadcast
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is being renamed
        return DistributedDataParallel(model, process_group=group, broadcast_buffers=False)


def apply_replicate(
    model: nn.Module, mesh: DeviceMesh, train: TrainSpec, ignored: set[nn.Parameter] | None = None
) -> None:
    """Replicated data parallelism for tensor-parallel (DTensor) weights, in place.

    torch's FSDP2-based `replicate` on the same units as FSDP (each block, the embedding,
    norm + head, the root): each unit's gradients are all-reduced over `mesh` as soon as its
    backward is done, which is DDP's bucketing with one bucket per block.
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    policy = mp_policy(train.dtype)
    for unit in _units(model):
        replicate(unit, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    replicate(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)


def _units(model: nn.Module) -> list:
    """Embedding, each block, norm + head; a tied embedding and head share one unit."""
    decoder = model.model
    tail = [m for m in (decoder.norm, model.lm_head) if m is not None]
    tied = (
        decoder.embed_tokens is not None
        and model.lm_head is not None
        and model.lm_head.weight is decoder.embed_tokens.weight
    )
    if tied:
        return [[decoder.embed_tokens, *tail], *decoder.layers.values()]
    units: list = [decoder.embed_tokens] if decoder.embed_tokens is not None else []
    units += list(decoder.layers.values())
    return units + ([tail] if tail else [])


def make_optimizer(
    module: nn.Module, train: TrainSpec, layout: Layout, dp_group: torch.distributed.ProcessGroup | None
) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, as the training loop's own); with `--zero 1`, sharded over dp."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    hyper = dict(lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, **optimizer_kernels(params))
    if layout.zero == 1 and layout.dp > 1 and layout.fsdp == 1 and dp_group is not None:
        return _zero_with_groups(groups, dp_group, hyper)
    return torch.optim.AdamW(groups, **hyper)


def optimizer_kernels(params: list[torch.Tensor]) -> dict[str, bool]:
    """Which AdamW implementation steps `params`.

    The fused kernel (one pass over each tensor; also TorchTitan's default) where every parameter
    is the same kind of tensor. On CPU torch's foreach path falls back to one op per tensor per
    update term and costs several times the fused step. Fused kernels take one kind of tensor per
    list: DTensors on different meshes (TP, FSDP, plain MoE experts under TP) do not mix, so those
    layouts step parameter by parameter.
    """
    one_kind = len({_mesh_key(p) for p in params}) == 1
    return {"fused": one_kind, "foreach": False}


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose `state_dict()` is the whole state on every rank.

    torch's version hands the state to one rank after an explicit `consolidate_state_dict(to=...)`;
    checkpointing (torch.distributed.checkpoint) asks every rank for a complete state dict, the
    same as for a plain optimizer. `load_state_dict` of the whole state keeps this rank's part.
    """

    def step(self, closure=None):  # type: ignore[override]
        loss = super().step(closure)
        self._name_states()
        return loss

    def _name_states(self) -> None:
        """List each parameter's state names in `.state`, with empty placeholders.

        torch.distributed.checkpoint reads the names from `.state` to unflatten a checkpoint, and
        takes an empty `.state` for a fresh optimizer: it then runs a zero-gradient step to create
        one, which on the real shard would decay the Adam moments. torch's ZeRO keeps `.state`
        empty (the shard's own optimizer holds the tensors); the placeholders keep memory sharded.
        """
        if self.state or not self.optim.state:
            return
        names = list(next(iter(self.optim.state.values())))
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param] = {name: torch.empty(0) for name in names}

    def state_dict(self) -> dict:
        whole: dict = {}
        for target in range(self.world_size):  # every rank gathers once, in turn
            self.consolidate_state_dict(to=target)
            if target == self.rank:
                whole = super().state_dict()
        self._name_states()
        return whole

    def load_state_dict(self, state_dict: dict) -> None:
        # parameters may be keyed by name (torch.distributed.checkpoint does); ZeRO wants their
        # positions in the global parameter order, which the groups' lists give
        order = [key for group in state_dict["param_groups"] for key in group["params"]]
        position = {key: i for i, key in enumerate(order)}
        groups = [
            dict(group, params=[position[k] for k in group["params"]]) for group in state_dict["param_groups"]
        ]
        state = {position[k]: v for k, v in state_dict["state"].items()}
        super().load_state_dict({"state": state, "param_groups": groups})


def _zero_with_groups(
    groups: list[dict], dp_group: torch.distributed.ProcessGroup, hyper: dict
) -> ZeroRedundancyOptimizer:
    zero = ShardedOptimizer(
        groups[0]["params"],
        optimizer_class=torch.optim.AdamW,
        process_group=dp_group,
        weight_decay=groups[0]["weight_decay"],
        **hyper,
    )
    for group in groups[1:]:
        zero.add_param_group(group)
    return zero


def _mesh_key(p: torch.Tensor) -> object:
    return p.device_mesh if isinstance(p, DTensor) else None
