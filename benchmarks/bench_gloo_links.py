"""This machine's gloo links as the planner's `cpu` preset describes them: a ring step's latency and the
bandwidth of large payloads, from timed all-gathers, reduce-scatters and all-reduces between local ranks.

Each collective is timed at a small and a large size (medians of `--repeats` calls after warm-up). The
small one gives the latency per ring step (the planner's α: an all-gather or reduce-scatter of 2 ranks
is one step, an all-reduce two); the large one, less that latency, gives the bytes each rank puts on
the wire per second (what `intra_node_gbps` × `link_efficiency` stands for). The last lines are the
values to put in a hardware TOML for this machine (`presets/hardware/cpu.toml` took them from a
2-core machine).

A collective the runtime issues from Python costs more than its ring step: a tensor-parallel one goes
through DTensor (sharding propagation, redistribution, autograd wrapping), an FSDP one through its
unit's hooks (copy-in, copy-out, buffer bookkeeping), and on a CPU the host doing that work is the one
that computes. The last measurements time the forward and backward of four MLP blocks made
tensor-parallel (column then row) and FSDP-sharded (a unit per block) over the ranks, less the same
MLP whole on one rank and the bare time of the collectives each issued (counted by torch's
CommDebugMode), and print the rest per collective as `tp_dispatch_us` and `fsdp_dispatch_us`. A
context-parallel core (Ulysses' all-to-alls, the all-gather core's gathers) issues its collectives
through torch's functional collectives with their autograd wrapping: the forward and backward of one
`all_to_all_single_autograd`, less two bare all-to-alls of the same size, per collective, is
`cp_dispatch_us`. Last, one thread's step of the `tiny` model on 8 tokens, whose compute is next to
nothing, over its blocks (and one block's worth for the embedding, head and loss) and three passes (a
backward is two forwards' ops), is the host's per-op work a block costs: `block_dispatch_us`.
Run: .venv/bin/python benchmarks/bench_gloo_links.py [--ranks 2] [--large-mb 16]
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.plan.comm import DEFAULT_LINK_EFFICIENCY, wire_factor

OPS = ("all_gather", "reduce_scatter", "all_reduce")


# torch 2.13 renames the tensor forms (`*_single`); older releases have only the first names
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _call(op: str, x: torch.Tensor, ranks: int) -> None:
    if op == "all_gather":
        _GATHER(torch.empty(x.numel() * ranks), x)
    elif op == "reduce_scatter":
        _SCATTER(torch.empty(x.numel() // ranks), x)
    else:
        dist.all_reduce(x)


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls after three, each started together on every rank
    (in a group)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _mlp(hidden: int, blocks: int) -> torch.nn.Sequential:
    """`blocks` two-layer MLPs in a row (each one FSDP unit, or one tensor-parallel pair)."""
    return torch.nn.Sequential(
        *(
            torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden))
            for _ in range(blocks)
        )
    )


def _issued_step(ranks: int, repeats: int, hidden: int = 64, tokens: int = 64, blocks: int = 4) -> dict:
    """Seconds of the forward and backward of the MLP whole on one rank, tensor-parallel (column then
    row, per block) and under FSDP (a unit per block), with each form's collectives counted by op."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (ranks,))
    whole, tensor_parallel, sharded = _mlp(hidden, blocks), _mlp(hidden, blocks), _mlp(hidden, blocks)
    plan = {f"{i}.0": ColwiseParallel() for i in range(blocks)}
    plan |= {f"{i}.1": RowwiseParallel() for i in range(blocks)}
    parallelize_module(tensor_parallel, mesh, plan)
    for block in sharded:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(tokens, hidden, requires_grad=True)  # its gradient is a tensor-parallel all-reduce
    out = {}
    group = mesh.get_group()
    y = torch.randn(ranks * tokens, hidden, requires_grad=True)

    def cp_step() -> None:  # one all-to-all forward, its gradient's backward
        all_to_all_single_autograd(y, None, None, group).sum().backward()

    out["cp_step"] = _timed(cp_step, repeats)
    out["cp_calls"] = {"all_to_all": 2}
    for name, module in (("whole", whole), ("tp", tensor_parallel), ("fsdp", sharded)):

        def step(module: torch.nn.Module = module) -> None:
            module(x).sum().backward()

        out[f"{name}_step"] = _timed(step, repeats)
        with CommDebugMode() as comms:
            step()
        counts: dict[str, int] = {}
        for op, n in comms.get_comm_counts().items():
            kind = next((k for k in OPS if k.replace("_", "") in str(op).replace("_", "")), "all_reduce")
            counts[kind] = counts.get(kind, 0) + n
        out[f"{name}_calls"] = counts
    # nothing of the mesh's may be in flight or left to the collector once the process group goes:
    # gloo aborts the process if a group is torn down under its own pending work
    dist.barrier(group=mesh.get_group())
    del whole, tensor_parallel, sharded, module
    gc.collect()
    return out


def _rank(rank: int, ranks: int, port: int, sizes: tuple[int, int], repeats: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        issued = _issued_step(ranks, repeats)
        if rank == 0:
            out.update(issued)
        for op in OPS:
            for elements in sizes:
                x = torch.randn(elements)
                seconds = _timed(lambda op=op, x=x: _call(op, x, ranks), repeats)
                if rank == 0:
                    out[(op, elements)] = seconds
        x = torch.randn(64 * 64 * ranks)  # the cp step's all-to-all, bare
        seconds = _timed(lambda: dist.all_to_all_single(torch.empty_like(x), x), repeats)
        if rank == 0:
            out[("all_to_all", sizes[0])] = seconds
    finally:
        dist.destroy_process_group()
    # Every result is handed over and the groups destroyed, yet since the tp and FSDP steps were added
    # the interpreter's own teardown aborts the worker in about one run in eight here ("terminate
    # called without an active exception", after destroy_process_group has returned), which failed the
    # whole measurement: a worker that finished ends here, without that teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measure(ranks: int, small: int, large: int, repeats: int) -> dict:
    """Median seconds of each op at each size (in fp32 elements a rank hands the collective), and
    `_issued_step`'s steps and collective counts."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(ranks, port, (small, large), repeats, out), nprocs=ranks)
    return dict(out)


def fit(times: dict[tuple[str, int], float], ranks: int, small: int, large: int) -> tuple[float, float]:
    """(seconds per ring step, wire bytes per second) over the three ops."""
    alphas, rates = [], []
    for op in OPS:
        factor, steps = wire_factor(op, ranks)
        alpha = times[(op, small)] / steps
        alphas.append(alpha)
        payload = 4 * large * (ranks if op == "all_gather" else 1)  # B: the full, gathered size
        rates.append(factor * payload / max(times[(op, large)] - steps * alpha, 1e-9))
    return statistics.mean(alphas), statistics.mean(rates)


def dispatch(times: dict, small: int, form: str) -> float:
    """Host seconds each collective of a tensor-parallel, FSDP or context-parallel step (`form`) adds to
    the bare collectives: the step, less the MLP whole (not for cp: no compute) and the bare time of
    the collectives it issued, per collective."""
    calls = times[f"{form}_calls"]
    bare = sum(n * times[(op, small)] for op, n in calls.items())
    compute = 0.0 if form == "cp" else times["whole_step"]
    return max(0.0, (times[f"{form}_step"] - compute - bare) / max(sum(calls.values()), 1))


def block_dispatch(repeats: int) -> float:
    """Seconds of host work one block's eager forward costs whatever its size: a step of the `tiny`
    model on 8 tokens (its compute next to nothing) over its blocks and the embedding, head and loss
    (one block's worth), a forward and a backward of twice its ops each, on one thread."""
    from fivefold.config import load_model
    from fivefold.model.transformer import Transformer

    torch.set_num_threads(1)
    spec = load_model("tiny")
    model = Transformer(spec)
    ids = torch.randint(0, spec.vocab, (1, 8))

    def step() -> None:
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

    return _timed(step, repeats) / (3 * (spec.layers + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--large-mb", type=float, default=16.0, help="large payload a rank hands in, MB")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    small, large = 256, max(int(args.large_mb * 1e6 / 4) // args.ranks * args.ranks, args.ranks)
    times = measure(args.ranks, small, large, args.repeats)
    print(f"gloo, {args.ranks} local ranks, load average {os.getloadavg()[0]:.2f}")
    print("| op | 1 KB | large |")
    print("|---|---|---|")
    for op in OPS:
        print(f"| {op} | {times[(op, small)] * 1e3:.2f} ms | {times[(op, large)] * 1e3:.1f} ms |")
    alpha, rate = fit(times, args.ranks, small, large)
    print(f"ring step {alpha * 1e6:.0f} us; wire {rate / 1e9:.2f} GB/s")
    print(f"intra_node_latency_us = {alpha * 1e6:.0f}")
    gbps = rate / 1e9 / DEFAULT_LINK_EFFICIENCY
    print(f"intra_node_gbps = {gbps:.2f}  # at link_efficiency {DEFAULT_LINK_EFFICIENCY}")
    print(f"# MLP step whole on one rank {times['whole_step'] * 1e3:.2f} ms")
    for form in ("tp", "fsdp", "cp"):
        calls = ", ".join(f"{n} {op}" for op, n in sorted(times[f"{form}_calls"].items()))
        print(f"# {form} step {times[f'{form}_step'] * 1e3:.2f} ms ({calls})")
        print(f"{form}_dispatch_us = {dispatch(times, small, form) * 1e6:.0f}")
    print(f"block_dispatch_us = {block_dispatch(args.repeats * 3) * 1e6:.0f}  # tiny, 8 tokens, one thread")


if __name__ == "__main__":
    main()
