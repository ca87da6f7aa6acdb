"""Comm-ledger overhead on a training step: the same FSDP2 step with and without the ledger.

Two gloo ranks train the `small` preset (FSDP2 over the fsdp mesh, AdamW). Steps rotate between
plain, recorded by the default collective hooks, and recorded by the full dispatch mode, so that
machine noise hits all alike; the ratio of the medians (and of the minima, the steadier figure on
a shared machine) is the overhead (target < 2 %). The
dispatch mode pays one Python call per dispatched op, so the benchmark also prints how many ops
a step dispatches.
Run: .venv/bin/python benchmarks/bench_ledger.py [--model small] [--seq-len 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from distributed import run_distributed  # noqa: E402  (the repo's multi-rank helper)


def _body(rank: int, world: int, model_name: str, seq_len: int, batch: int, repeats: int) -> dict:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.config import Layout, load_model
    from fivefold.measure import comm_hooks
    from fivefold.measure.ledger import HOOKED_OPS, CommLedger
    from fivefold.model.transformer import build_model, lm_loss, materialize
    from fivefold.parallel.device_mesh import build_runtime_mesh

    warnings.simplefilter("ignore")
    rm = build_runtime_mesh(Layout(fsdp=world), gpus_per_node=world)
    spec = load_model(model_name)
    model = materialize(build_model(spec), "cpu", seed=0)
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=rm.get("fsdp_cp"))
    fully_shard(model, mesh=rm.get("fsdp_cp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, spec.vocab, (batch, seq_len + 1), generator=gen)

    def step() -> None:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()

    class OpCounter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            OpCounter.count += 1
            return func(*args, **(kwargs or {}))

    with OpCounter():
        step()
    ledgers = {"hooks": CommLedger(rm, method="hooks"), "dispatch": CommLedger(rm, method="dispatch")}
    for _ in range(2):  # warm-up, every path
        step()
        for ledger in ledgers.values():
            with ledger:
                step()
    # wall time, and this process's CPU time: on a shared machine the wall clock mostly measures
    # the neighbours, while the ledger's cost is CPU work in this process
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "hooks": [], "dispatch": []}
    names = list(times)
    for repeat in range(repeats):
        for name in names[repeat % 3 :] + names[: repeat % 3]:  # each path in each position alike
            # plain and dispatch run with no collective kernels registered at all; the hooks step
            # has them registered beforehand, as a ledger kept over a run does
            if name == "hooks":
                comm_hooks.acquire(HOOKED_OPS)
                comm_hooks.release()
            else:
                comm_hooks.uninstall()
            torch.distributed.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            if name == "plain":
                step()
            else:
                with ledgers[name]:
                    step()
                ledgers[name].next_step()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    # the cost per collective, free of step-time noise: many tiny all-reduces
    group, tiny, calls = rm.group("fsdp"), torch.ones(1), 300
    per_call: dict[str, list[float]] = {name: [] for name in times}
    for _ in range(5):
        for name in per_call:
            torch.distributed.barrier()
            ledger = CommLedger(rm, method=name) if name != "plain" else None
            comm_hooks.uninstall()
            if name == "hooks":
                comm_hooks.acquire(HOOKED_OPS)  # registered before the clock starts
            start = time.process_time()
            if ledger is None:
                for _ in range(calls):
                    torch.distributed.all_reduce(tiny, group=group)
            else:
                with ledger:
                    for _ in range(calls):
                        torch.distributed.all_reduce(tiny, group=group)
            per_call[name].append((time.process_time() - start) / calls)
            if name == "hooks":
                comm_hooks.release()
    return {
        "times": times,
        "ops_per_step": OpCounter.count,
        "per_call": {name: statistics.median(t) for name, t in per_call.items()},
        "comm_per_step": ledgers["hooks"].summary(skip=2),
        "same_records": ledgers["hooks"].per_step() == ledgers["dispatch"].per_step(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    results = run_distributed(
        _body, args.ranks, args.model, args.seq_len, args.batch, args.repeats, timeout=1800
    )
    print(
        f"model {args.model}, seq {args.seq_len}, batch {args.batch} per rank, FSDP2 over {args.ranks} "
        f"gloo ranks, {args.repeats} rotating steps; medians per step"
    )
    for rank, res in enumerate(results):
        for clock, index in (("wall", 0), ("cpu", 1)):
            value = {name: statistics.median(t[index] for t in ts) for name, ts in res["times"].items()}
            parts = [f"plain {value['plain'] * 1e3:7.1f} ms"]
            for name in ("hooks", "dispatch"):
                ratio = value[name] / value["plain"]
                parts.append(
                    f"{name} {value[name] * 1e3:7.1f} ms (ratio {ratio:.4f}, {(ratio - 1) * 100:+.2f} %)"
                )
            print(f"rank {rank} {clock:>4}: " + "   ".join(parts))
        print(
            f"rank {rank}: {res['ops_per_step']} dispatched ops per step; hooks and dispatch "
            f"recorded the same: {res['same_records']}"
        )
    cost = results[0]["per_call"]
    each = ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in cost.items())
    print(
        f"CPU time of one tiny all-reduce (rank 0): {each}"
        f"; the ledger adds {(cost['hooks'] - cost['plain']) * 1e6:.1f} us (hooks) / "
        f"{(cost['dispatch'] - cost['plain']) * 1e6:.1f} us (dispatch) per collective"
    )
    print("recorded per step (rank 0):")
    for row in results[0]["comm_per_step"]:
        print(
            f"  {row['axis']:<6} {row['op']:<15} count {row['count']:5.1f}  bytes {row['bytes']:12.0f}  "
            f"wire {row['wire_bytes']:12.0f}"
        )


if __name__ == "__main__":
    main()
