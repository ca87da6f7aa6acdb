"""The communication ledger: every collective and send/recv, by mesh axis, with its bytes.

`CommLedger` is a `TorchDispatchMode`. Every c10d op and functional collective passes through
the dispatcher, so the mode sees it with its tensors and its group; on this CPU build that was
checked for dist.all_reduce / all_gather(_into_tensor) / reduce_scatter_tensor / broadcast /
all_to_all_single / send / recv, batch_isend_irecv (c10d send + recv_), DTensor's functional
collectives (`_c10d_functional.*`), FSDP2's all-gather and reduce-scatter, and DDP's gradient
all-reduce (the reducer issues c10d allreduce_ from the backward pass, which the mode sees; no
comm hook is needed).

Two ways to see the ops, same records (tests run both):
* `method="hooks"` (default): kernels just below autograd on the collective ops only
  (`comm_hooks`); other ops pay nothing, and collectives from any thread are seen.
* `method="dispatch"`: the mode itself is pushed, so every op of the thread passes through
  `__torch_dispatch__`; simple and self-contained, but a Python call per op (10-20 % of a CPU
  step of the small preset, see benchmarks/bench_ledger.py).

Bytes (S, per rank) and the per-rank wire bytes of the ring algorithms, n = group size:

    all_reduce      S = the buffer            wire = 2(n-1)/n · S
    all_gather      S = the gathered output   wire = (n-1)/n · S
    reduce_scatter  S = the unreduced input   wire = (n-1)/n · S
    all_to_all      S = the input             wire = (n-1)/n · S
    broadcast, scatter, gather, reduce        wire = (n-1)/n · S (pipelined chain, averaged)
    send, recv      S = the tensor            wire = S

A group is credited to an axis by its process-group object when the runtime mesh named it
(`RuntimeMesh.group_axes`), else by comparing its ranks with this rank's mesh groups (first match
in `AXIS_PRIORITY`); the whole world is "world", a one-rank group "local", anything else "other".
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold import torch_internals
from fivefold.config import AXES
from fivefold.layout_math import wire_bytes  # noqa: F401  (re-exported: the ring formulas)
from fivefold.measure import comm_hooks
from fivefold.mesh import FLATTENED, MeshInfo
from fivefold.outputs import write_text_whole
from fivefold.parallel.device_mesh import AXIS_PRIORITY, RuntimeMesh

METHODS = ("hooks", "dispatch")

# op name (namespace-free) -> normalised op
C10D_OPS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
    "scatter_": "scatter",
    "gather_": "gather",
    "reduce_": "reduce",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
}
FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}

HOOKED_OPS = {"c10d": tuple(C10D_OPS), "_c10d_functional": tuple(FUNCTIONAL_OPS)}


def _nbytes(x: Any) -> int:
    """Bytes of a tensor or of (nested) lists of tensors."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommLedger(TorchDispatchMode):
    """Records op, count, bytes and wire bytes per (axis, op) per step while active (`with ledger:`).

    `next_step()` closes a step. `per_step()` lists each step's rows; `summary()` the mean per
    step; `write(dir)` writes `ledger.json`. `record(...)` adds an op the mode cannot see.
    """

    def __init__(
        self, mesh: RuntimeMesh | MeshInfo | None = None, rank: int | None = None, method: str = "hooks"
    ) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method = method
        self._lock = threading.Lock()
        self._release: weakref.finalize | None = None
        if isinstance(mesh, RuntimeMesh):
            self.info: MeshInfo | None = mesh.info
            self.rank = mesh.rank
            self._named = {pg.group_name: axis for pg, axis in mesh.group_axes.items()}
        else:
            self.info = mesh
            self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
            self._named = {}
        self._by_ranks: dict[frozenset[int], str] = {}
        self._alias: dict[str, str] = {}
        if self.info is not None:
            self._alias = flattened_aliases(self.info)
            for name in AXIS_PRIORITY:
                group = self.info.group_of(self.rank, name)
                if len(group) > 1:
                    self._by_ranks.setdefault(frozenset(group), self._alias.get(name, name))
        self._group_cache: dict[str, tuple[str, int]] = {}  # group name -> (axis, size)
        self._handlers: dict[Any, Any] = {}  # op overload -> (functional, op, arg names) or None
        self._peer_cache: dict[tuple[str, int], str] = {}
        self.steps: list[dict[tuple[str, str], list[float]]] = [defaultdict(lambda: [0, 0, 0.0])]

    # ---- seeing the ops: a dispatch mode (every op) or collective-only kernels
    def __enter__(self) -> CommLedger:
        if self.method == "dispatch":
            return super().__enter__()
        if self._release is None or not self._release.alive:  # hold the kernels until closed or collected
            comm_hooks.acquire(HOOKED_OPS)
            self._release = weakref.finalize(self, comm_hooks.release)
        comm_hooks.add_observer(self._observe, HOOKED_OPS)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self.method == "dispatch":
            return super().__exit__(exc_type, exc_value, traceback)
        comm_hooks.remove_observer(self._observe)
        return None

    def close(self) -> None:
        """Let go of the collective kernels now rather than when the ledger is collected."""
        if self._release is not None:
            self._release()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._observe(func, args, kwargs)
        return func(*args, **kwargs)

    def _observe(self, func, args, kwargs) -> None:
        spec = self._handlers.get(func, False)
        if spec is False:
            spec = self._handlers[func] = _op_spec(func)
        if spec is not None:
            functional, op, names = spec
            bound = dict(zip(names, args)) | kwargs
            if functional:
                self._on_functional(op, bound)
            else:
                self._on_c10d(op, bound)

    def _on_c10d(self, op: str, bound: dict[str, Any]) -> None:
        axis, n = self._axis_of_group(bound["process_group"])
        if op in ("send", "recv") and "tensors" in bound:
            peer = bound.get("dst", bound.get("src"))
            if peer is not None:
                axis = self._axis_of_peer(bound["process_group"], peer, axis)
            self.record(axis, op, _nbytes(bound["tensors"]), 2)
            return
        if op == "all_gather":
            payload = _nbytes(bound.get("output_tensor", bound.get("output_tensors", bound.get("outputs"))))
        elif op in ("reduce_scatter", "all_to_all"):
            payload = _nbytes(
                bound.get("input_tensor", bound.get("input_tensors", bound.get("inputs", bound.get("input"))))
            )
        elif op == "scatter":
            payload = _nbytes(bound["output_tensors"]) * n
        elif op == "gather":
            payload = _nbytes(bound["input_tensors"]) * n
        elif op == "barrier":
            payload = 0
        else:
            payload = _nbytes(bound["tensors"])
        self.record(axis, op, payload, n)

    def _on_functional(self, op: str, bound: dict[str, Any]) -> None:
        axis, n = self._axis_of_group(bound["group_name"])
        payload = _nbytes(bound.get("input", bound.get("inputs")))
        if op == "all_gather":
            payload *= n
        self.record(axis, op, payload, n)

    # ---- groups to axes
    def _axis_of_group(self, group: Any) -> tuple[str, int]:
        if isinstance(group, str):  # functional collectives carry the group's name
            pg, name = None, group
        else:  # c10d ops carry the group as a TorchScript object
            pg = group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)
            name = pg.group_name
        cached = self._group_cache.get(name)
        if cached is None:
            pg = pg or _resolve(name)
            ranks = frozenset(dist.get_process_group_ranks(pg)) if pg is not None else frozenset()
            cached = self._group_cache[name] = (self._axis_for(name, ranks), len(ranks) or 1)
        return cached

    def _axis_of_peer(self, group: Any, peer: int, fallback: str) -> str:
        """A point-to-point op belongs to the one world axis on which the peer's coordinate differs."""
        if self.info is None:
            return fallback
        pg = group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)
        # by the group's name: an unboxed group is a fresh object whose id a later one may reuse,
        # which credited pp's send to group rank 1 to cp's rank 1 now and then
        key = (pg.group_name, peer)
        if key not in self._peer_cache:
            try:
                global_peer = dist.get_global_rank(pg, peer) if pg is not dist.group.WORLD else peer
                mine, theirs = self.info.ranks[self.rank].coords, self.info.ranks[global_peer].coords
            except (ValueError, RuntimeError, KeyError, IndexError):  # a group the mesh does not know
                self._peer_cache[key] = fallback
                return fallback
            differ = [a for a in AXES if mine[a] != theirs[a]]
            self._peer_cache[key] = differ[0] if len(differ) == 1 else fallback
        return self._peer_cache[key]

    def _axis_for(self, group_name: str, ranks: frozenset[int]) -> str:
        if group_name in self._named and (len(ranks) > 1 or not ranks):
            name = self._named[group_name]
            return self._alias.get(name, name)
        if ranks in self._by_ranks:
            return self._by_ranks[ranks]
        if len(ranks) == 1:
            return "local"
        if dist.is_initialized() and len(ranks) == dist.get_world_size():
            return "world"
        return "other"

    # ---- recording and reading
    def record(self, axis: str, op: str, payload: float, n: int, count: int = 1) -> None:
        """Add `count` ops of `payload` bytes each over a group of `n` ranks to the current step."""
        with self._lock:  # hooks may report from a backward thread
            row = self.steps[-1][(axis, op)]
            row[0] += count
            row[1] += payload * count
            row[2] += wire_bytes(op, payload, n) * count

    def next_step(self) -> None:
        self.steps.append(defaultdict(lambda: [0, 0, 0.0]))

    @staticmethod
    def _rows(step: dict[tuple[str, str], list[float]]) -> list[dict]:
        order = {a: i for i, a in enumerate(AXIS_PRIORITY)}
        items = sorted(step.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0]))
        return [
            {"axis": axis, "op": op, "count": int(c), "bytes": int(b), "wire_bytes": w}
            for (axis, op), (c, b, w) in items
        ]

    def per_step(self) -> list[list[dict]]:
        """Rows of each step (the open step only if it has records)."""
        steps = self.steps if self.steps[-1] else self.steps[:-1]
        return [self._rows(s) for s in steps]

    def summary(self, skip: int = 0) -> list[dict]:
        """Mean rows per step over the recorded steps after the first `skip` (warm-up; fewer when the
        run recorded no more, so that the last step is always counted)."""
        recorded = self.steps if self.steps[-1] else self.steps[:-1]
        return self.mean(list(range(min(skip, max(len(recorded) - 1, 0)), len(recorded))))

    def mean(self, indices: list[int]) -> list[dict]:
        """Mean rows per step over the steps of these indices."""
        steps = [self.steps[i] for i in indices]
        if not steps:
            return []
        total: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for step in steps:
            for key, (c, b, w) in step.items():
                row = total[key]
                row[0] += c
                row[1] += b
                row[2] += w
        rows = self._rows(total)
        for row in rows:
            row["count"] = row["count"] / len(steps)
            row["bytes"] = row["bytes"] / len(steps)
            row["wire_bytes"] = row["wire_bytes"] / len(steps)
        return rows

    def by_axis(self, skip: int = 0) -> dict[str, dict[str, float]]:
        """Mean per step per axis: count, bytes, wire_bytes (all ops together)."""
        out: dict[str, dict[str, float]] = {}
        for row in self.summary(skip):
            agg = out.setdefault(row["axis"], {"count": 0.0, "bytes": 0.0, "wire_bytes": 0.0})
            for k in agg:
                agg[k] += row[k]
        return out

    def to_json(self, skip: int = 0, first_step: int = 0) -> dict:
        """The ledger as `ledger.json` holds it; `first_step` numbers its steps (train's: from 1, and on
        from a resumed checkpoint's step, as metrics.jsonl numbers them)."""
        per_step = self.per_step()
        return {
            "rank": self.rank,
            "steps": len(per_step),
            "summary_skips": min(skip, max(len(per_step) - 1, 0)),
            "per_step": [{"step": first_step + i, "ops": rows} for i, rows in enumerate(per_step)],
            "summary": self.summary(skip),
            "by_axis": self.by_axis(skip),
            "formulas": {
                "all_reduce": "2(n-1)/n*S",
                "all_gather": "(n-1)/n*S",
                "reduce_scatter": "(n-1)/n*S",
                "all_to_all": "(n-1)/n*S",
                "send": "S",
                "recv": "S",
            },
        }

    def write(self, path: str | Path, skip: int = 0, first_step: int = 0) -> Path:
        """Write `ledger.json` (into `path` if it is a directory)."""
        p = Path(path)
        if p.is_dir() or not p.suffix:
            p.mkdir(parents=True, exist_ok=True)
            p = p / "ledger.json"
        write_text_whole(p, json.dumps(self.to_json(skip, first_step), indent=1), "output")
        return p


def _op_spec(func: Any) -> tuple[bool, str, tuple[str, ...]] | None:
    """(is functional, normalised op, argument names) of a collective op; None for any other op."""
    namespace, name = func.namespace, func._opname
    names = tuple(a.name for a in func._schema.arguments)
    if namespace == "c10d" and name in C10D_OPS:
        return False, C10D_OPS[name], names
    if namespace == "_c10d_functional" and name in FUNCTIONAL_OPS:
        return True, FUNCTIONAL_OPS[name], names
    return None


def flattened_aliases(info: MeshInfo) -> dict[str, str]:
    """A flattened dim with one constituent of size > 1 is credited to that constituent.

    Except FSDP over fsdp×cp when only cp is split: that is still FSDP traffic, kept as fsdp_cp.
    Without expert parallelism, `expert_fsdp` is the same group as `fsdp_cp` and is named as it.
    """
    out: dict[str, str] = {}
    for flat, parts in FLATTENED.items():
        split = [a for a in parts if info.dims[a].size > 1]
        if len(split) == 1 and not (flat == "fsdp_cp" and split[0] == "cp"):
            out[flat] = split[0]
    if info.dims["ep"].size == 1:
        # without expert parallelism the experts' shard group is the fsdp×cp group itself
        out["expert_fsdp"] = out.get("fsdp_cp", "fsdp_cp")
    return out


def _resolve(group_name: str) -> dist.ProcessGroup | None:
    return torch_internals.process_group_named(group_name)
