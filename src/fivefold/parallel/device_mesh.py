"""The torch `DeviceMesh` whose process groups are exactly the groups of `fivefold.mesh`.

The root mesh has the five world axes as named dims, outermost first (the reverse of the layout's
`order`), over `arange(world)`: a DeviceMesh's last dim is the contiguous one, so its groups are the
mixed-radix groups `fivefold.mesh` computes. The derived dims are built from that root so that
every mesh shares it (FSDP2 + TP and DTensor need a common root):

* `fsdp_cp`, `batch`, `dp_fsdp_cp`: `root[constituents]._flatten(name)`;
* `ep`, `expert_fsdp`: the `fsdp_cp` mesh unflattened into (expert_fsdp, ep), so `ep` takes the
  innermost fsdp×cp ranks, as in `fivefold.mesh`.

`RuntimeMesh.get(name)` returns the 1-D mesh of any dim, size-1 dims included (a 1-rank mesh:
callers that only want real splits check `size(name) > 1`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fivefold import torch_internals
from fivefold.config import AXES, Layout
from fivefold.errors import FivefoldError
from fivefold.layout_math import AXIS_PRIORITY  # when two dims share ranks, the first one is credited
from fivefold.mesh import FLATTENED, MeshInfo, build_mesh


@dataclass
class RuntimeMesh:
    info: MeshInfo
    device_mesh: DeviceMesh  # root: the five world axes, outermost first
    rank: int
    meshes: dict[str, DeviceMesh] = field(default_factory=dict)  # 1-D mesh per dim name
    expert_mesh: DeviceMesh | None = None  # (expert_fsdp, ep), sharing the root
    group_axes: dict[dist.ProcessGroup, str] = field(default_factory=dict)  # for the ledger

    def get(self, name: str) -> DeviceMesh:
        """The 1-D mesh of `name` (a world axis or a derived dim); size-1 dims give a 1-rank mesh."""
        if name not in self.meshes:
            raise FivefoldError(f"unknown mesh dim {name!r}; dims: {', '.join(self.meshes)}")
        return self.meshes[name]

    def coord(self, name: str) -> int:
        return self.info.ranks[self.rank].coords[name]

    def size(self, name: str) -> int:
        return self.info.dims[name].size

    def group(self, name: str) -> dist.ProcessGroup:
        return self.get(name).get_group()

    def submesh(self, *names: str) -> DeviceMesh:
        """A multi-dim mesh sharing the root, e.g. ("dp", "fsdp_cp") for HSDP.

        Names must be outermost first in the root's dim order (dp before fsdp_cp in the default
        order); torch rejects any other order.
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # slicing a flattened dim from the root warns
            try:
                return self.device_mesh[names]
            except (KeyError, RuntimeError) as exc:
                raise FivefoldError(f"cannot slice dims {names} from the mesh: {exc}") from None

    def axis_of(self, group: dist.ProcessGroup) -> str | None:
        return self.group_axes.get(group)


def root_dim_names(layout: Layout) -> tuple[str, ...]:
    """The world axes outermost first: the reverse of `order` (innermost first)."""
    return tuple(reversed(layout.order_list))


def build_runtime_mesh(
    layout: Layout, device_type: str = "cpu", gpus_per_node: int | None = None
) -> RuntimeMesh:
    """Build the DeviceMesh for the initialised default process group's world."""
    if not dist.is_initialized():
        raise FivefoldError("build_runtime_mesh needs an initialised default process group")
    torch_internals.check()  # one clear line on a torch whose internals moved, before any step
    world, rank = dist.get_world_size(), dist.get_rank()
    if gpus_per_node is None:
        gpus_per_node = _local_world_size(world)
    info = build_mesh(layout, world, gpus_per_node)
    lay = info.layout
    names = root_dim_names(lay)
    ranks = torch.arange(world, dtype=torch.int).reshape([getattr(lay, a) for a in names])
    root = DeviceMesh(device_type, ranks, mesh_dim_names=names)
    meshes: dict[str, DeviceMesh] = {a: root[a] for a in AXES}
    for flat, parts in FLATTENED.items():
        ordered = tuple(a for a in names if a in parts)  # the root's order, as slicing requires
        meshes[flat] = torch_internals.flatten_mesh(root[ordered], flat)
    expert_dims = (lay.fsdp * lay.cp // lay.ep, lay.ep)
    expert = torch_internals.unflatten_mesh(meshes["fsdp_cp"], 0, expert_dims, ("expert_fsdp", "ep"))
    meshes["expert_fsdp"], meshes["ep"] = expert["expert_fsdp"], expert["ep"]
    group_axes: dict[dist.ProcessGroup, str] = {}
    for name in AXIS_PRIORITY:
        group_axes.setdefault(meshes[name].get_group(), name)
    return RuntimeMesh(info, root, rank, meshes, expert, group_axes)


def _local_world_size(world: int) -> int:
    """GPUs per node from torchrun's LOCAL_WORLD_SIZE, else the whole world is one node."""
    import os

    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else world
