"""Step time of each layout on 4 CPU ranks: fivefold's runner vs a minimal hand-written torch script.

Both sides use the same torch APIs on the same model (`small`, built on meta and materialised
with the same seeded init) and the same batches: DDP / ZeroRedundancyOptimizer / FSDP2
`fully_shard` / DTensor `parallelize_module` + `loss_parallel`, AdamW. The hand-written side is
what one would write by hand for that one layout: a plan dict, a few `fully_shard` calls, a plain
loop. One step = forward + backward on one micro-batch, the loss averaged over the data ranks,
the optimizer step. (The global-norm clip is left out on both sides: torch's own
`clip_grad_norm_` cannot mix DTensors of several meshes, so a hand-written equivalent would be
fivefold's code again.)

Steps alternate between the two sides in blocks, medians are compared (ratio = fivefold / hand);
the target is an overhead of at most 5%. Memory: per-rank bytes of params, grads, optimizer state
and the activation peak (fivefold.measure.memory) after a step, against the single process.

    .venv/bin/python benchmarks/bench_layouts.py [--steps 12] [--seq-len 64] [--micro-batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

LAYOUTS = [
    dict(dp=4),
    dict(dp=4, zero=1),
    dict(fsdp=4, zero=2),
    dict(fsdp=4, zero=3),
    dict(dp=2, fsdp=2),
    dict(tp=4),
    dict(tp=2, sp=True, dp=2),
    dict(fsdp=2, tp=2, sp=True),
]
MODEL = "small"


def _name(lay: dict) -> str:
    return " ".join(f"{k}{'' if v is True else v}" for k, v in lay.items())


# ---------------------------------------------------------------------------------------------
# the hand-written side: torch APIs called directly for one layout


def hand_written(spec, layout, mesh, train):
    """(step function, model, optimizer) written plainly for `layout`."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel

    from fivefold.model import build_model, lm_loss, materialize

    model = build_model(spec)
    if layout.tp > 1:
        tp_mesh = mesh.get("tp")
        stream = Shard(1) if layout.sp else Replicate()
        local = not layout.sp
        embed_style = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=local
        )
        parallelize_module(model.model.embed_tokens, tp_mesh, embed_style)
        for block in model.model.layers.values():
            plan = {
                "self_attn": PrepareModuleInput(
                    input_layouts=(stream, None, None),
                    desired_input_layouts=(Replicate(), None, None),
                    use_local_output=False,
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=stream, use_local_output=local),
                "mlp": PrepareModuleInput(
                    input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=stream, use_local_output=local),
            }
            if layout.sp:
                plan["input_layernorm"] = SequenceParallel()
                plan["post_attention_layernorm"] = SequenceParallel()
            parallelize_module(block, tp_mesh, plan)
        if layout.sp:
            parallelize_module(model.model.norm, tp_mesh, SequenceParallel())
        head_style = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model.lm_head, tp_mesh, head_style)
        model.lm_head.weight = model.model.embed_tokens.weight  # `small` ties them
    wrapped = model
    replicate_tp = layout.tp > 1 and layout.dp > 1 and layout.fsdp == 1
    if layout.fsdp > 1 or replicate_tp:
        if replicate_tp:
            from torch.distributed._composable.replicate_with_fsdp import replicate as shard_fn

            kwargs = {"mesh": mesh.get("dp")}
        else:
            shard_fn = fully_shard
            dp_mesh = mesh.get("fsdp_cp") if layout.dp == 1 else mesh.submesh("dp", "fsdp_cp")
            kwargs = {"mesh": dp_mesh, "reshard_after_forward": layout.zero == 3}
        shard_fn([model.model.embed_tokens, model.model.norm, model.lm_head], **kwargs)
        for block in model.model.layers.values():
            shard_fn(block, **kwargs)
        shard_fn(model, **kwargs)
        materialize(model, "cpu", train.seed)
    else:
        materialize(model, "cpu", train.seed)
        if layout.dp > 1:
            wrapped = DistributedDataParallel(model, process_group=mesh.group("dp"), broadcast_buffers=False)
    params = list(model.parameters())
    hyper = dict(lr=train.lr, weight_decay=train.weight_decay)
    if layout.zero == 1:
        opt = ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, process_group=mesh.group("dp"), **hyper
        )
    else:
        meshes = {getattr(p, "device_mesh", None) for p in params}
        opt = torch.optim.AdamW(params, foreach=len(meshes) == 1, **hyper)
    data_group = mesh.group("batch") if mesh.size("batch") > 1 else None

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        ctx = loss_parallel() if layout.tp > 1 else _null()
        with ctx:
            loss = lm_loss(wrapped(x), y)
            loss.backward()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        value = value.detach().clone()
        if data_group is not None:
            dist.all_reduce(value, group=data_group)
        opt.step()
        return value

    return step, model, opt


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------
# fivefold's side


def fivefold_side(spec, layout, mesh, train):
    from fivefold.model import build_model
    from fivefold.parallel.runners import build_runner

    runner = build_runner(build_model(spec), mesh, layout, train)
    opt = runner.build_optimizer(runner.model_parts[0])

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = runner.forward_backward(x, y)
        opt.step()
        return loss

    return step, runner.model_parts[0], opt


# ---------------------------------------------------------------------------------------------


def _measure(rank: int, world: int, steps: int, seq_len: int, micro_batch: int) -> list[dict]:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    from fivefold.config import Layout, TrainSpec, load_model
    from fivefold.measure.memory import ActivationMeter, state_bytes
    from fivefold.parallel.device_mesh import build_runtime_mesh

    spec = load_model(MODEL)
    out = []
    for lay in LAYOUTS:
        layout = Layout(**lay).resolve(world)
        data_ranks = layout.dp * layout.fsdp
        train = TrainSpec(
            seq_len=seq_len,
            micro_batch=micro_batch,
            global_batch=micro_batch * data_ranks,
            lr=1e-3,
            weight_decay=0.0,
        )
        mesh = build_runtime_mesh(layout)
        sides = {
            "fivefold": fivefold_side(spec, layout, mesh, train),
            "hand": hand_written(spec, layout, mesh, train),
        }
        coord = mesh.coord("batch")
        times: dict[str, list[float]] = {"fivefold": [], "hand": []}
        memory: dict[str, dict] = {}
        for i in range(steps + 2):  # two warm-up steps
            gen = torch.Generator().manual_seed(i)
            tokens = torch.randint(0, spec.vocab, (micro_batch * data_ranks, seq_len + 1), generator=gen)
            x = tokens[coord * micro_batch : (coord + 1) * micro_batch, :-1]
            y = tokens[coord * micro_batch : (coord + 1) * micro_batch, 1:]
            order = ("fivefold", "hand") if i % 2 == 0 else ("hand", "fivefold")
            for side in order:
                step, model, opt = sides[side]
                dist.barrier()
                start = time.perf_counter()
                if i == 1:
                    with ActivationMeter() as meter:
                        step(x, y)
                    memory[side] = state_bytes([model], opt) | {"activations": meter.peak_bytes}
                else:
                    step(x, y)
                dist.barrier()
                if i >= 2:
                    times[side].append(time.perf_counter() - start)
        out.append({"layout": _name(lay), "times": times, "memory": memory})
        del sides
        dist.barrier()
    return out


def _single_process_memory(seq_len: int, micro_batch: int) -> dict:
    from fivefold.config import Layout, TrainSpec, load_model
    from fivefold.measure.memory import ActivationMeter, state_bytes
    from fivefold.model import build_model, materialize
    from fivefold.parallel.api import LocalRunner
    from fivefold.parallel.data import make_optimizer

    spec = load_model(MODEL)
    model = materialize(build_model(spec), "cpu", 0)
    train = TrainSpec(seq_len=seq_len, micro_batch=micro_batch, lr=1e-3)
    opt = make_optimizer(model, train, Layout(), None)
    runner = LocalRunner(model, micro_batch)
    # the same per-rank micro-batch; a data-parallel layout's ranks each hold one of these
    tokens = torch.randint(0, spec.vocab, (micro_batch, seq_len + 1))
    with ActivationMeter() as meter:
        runner.forward_backward(tokens[:, :-1], tokens[:, 1:])
    opt.step()
    return state_bytes([model], opt) | {"activations": meter.peak_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    from fivefold.parallel.spawn import spawn_ranks

    started = time.perf_counter()
    per_rank = spawn_ranks(_measure, 4, args.steps, args.seq_len, args.micro_batch)
    single = _single_process_memory(args.seq_len, args.micro_batch)
    print(
        f"model {MODEL}, 4 gloo ranks on {torch.get_num_threads()}-thread host, seq {args.seq_len}, "
        f"micro-batch {args.micro_batch}, {args.steps} timed steps per side (median, max over ranks)"
    )
    print(
        f"{'layout':<18} {'fivefold ms':>12} {'hand ms':>9} {'ratio':>6}   "
        "per-rank KiB: params grads optim acts"
    )
    ratios = []
    for i, row in enumerate(per_rank[0]):
        med = {
            side: max(statistics.median(r[i]["times"][side]) for r in per_rank)
            for side in ("fivefold", "hand")
        }
        ratio = med["fivefold"] / med["hand"]
        ratios.append(ratio)
        mem = per_rank[0][i]["memory"]["fivefold"]
        print(
            f"{row['layout']:<18} {med['fivefold'] * 1e3:>12.1f} {med['hand'] * 1e3:>9.1f} {ratio:>6.3f}   "
            + " ".join(f"{mem[k] / 1024:>6.0f}" for k in ("params", "grads", "optimizer", "activations"))
        )
    print(
        f"{'single process':<18} {'':>12} {'':>9} {'':>6}   "
        + " ".join(f"{single[k] / 1024:>6.0f}" for k in ("params", "grads", "optimizer", "activations"))
    )
    print(
        f"median ratio over layouts {statistics.median(ratios):.3f} (target <= 1.05); "
        f"took {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
