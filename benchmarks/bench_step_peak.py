"""A CPU step's memory peak beyond its weights and moments, against the plan's two rules for it.

One process builds a 67M-parameter SwiGLU model (4 blocks of 1024 wide, fp32, fused AdamW, as
`fivefold train` runs one process on a CPU), takes two steps, then samples its resident size every
0.2 ms through a third step's forward and backward. glibc is told to give every block of 64 kB or
more its own mapping (`MALLOC_MMAP_THRESHOLD_`), so what is freed leaves the resident size at once
and the peak is the live bytes' peak. The step starts with the weights and the moments resident and
no gradients (`zero_grad(set_to_none=True)`); the peak beyond that start is set beside the plan's

* both: gradients + activations + buffers (the published trainers' persistent gradient buffers), and
* apart: max(gradients, activations) + buffers (`memory.grads_apart`, fivefold's runtime with one
  micro-batch a step),

for micro-batches of 1 and 4 sequences: the first holds more gradients than activations, the second
more activations than gradients. `--fsdp` runs it on 2 ranks (gloo, torchrun) sharded by fivefold's
own FSDP2 units at zero 3, rank 0's peak beside its stage's plan.
Run: .venv/bin/python benchmarks/bench_step_peak.py [--seq-len 256] [--batches 1 4] [--fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = """name = "peak-67m"
layers = 4
hidden = 1024
heads = 8
kv_heads = 8
ffn_hidden = 4096
vocab = 256
max_seq_len = 1024
"""


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model_toml: str, batch: int, seq_len: int) -> dict[str, float]:
    """(In a child process.) The resident peak of a step's forward and backward beyond its start."""
    import torch

    from fivefold.config import load_model
    from fivefold.model.transformer import build_model, lm_loss, materialize

    torch.manual_seed(0)
    spec = load_model(model_toml)
    model = materialize(build_model(spec), "cpu", seed=0)
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if sharded:  # fivefold's own FSDP2 units over every rank, zero 3
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from fivefold.config import TrainSpec
        from fivefold.parallel.data import apply_fsdp

        dist.init_process_group("gloo")
        apply_fsdp(model, init_device_mesh("cpu", (dist.get_world_size(),)), 3, TrainSpec())
    # fused where every parameter is one kind of tensor, as the runtime steps them (`optimizer_kernels`)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not sharded)
    tokens = torch.randint(0, spec.vocab, (batch, seq_len + 1))

    def forward_backward() -> None:
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()

    for _ in range(2):  # the moments exist from the first step on
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak, running = [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], _resident_bytes())
            time.sleep(0.0002)

    start = _resident_bytes()
    sampler = threading.Thread(target=sample)
    sampler.start()
    forward_backward()
    running[0] = False
    sampler.join()
    if sharded:
        dist.destroy_process_group()
    return {"start": start, "beyond_start": peak[0] - start}


def planned(model_toml: str, batch: int, seq_len: int, ranks: int) -> dict[str, float]:
    from fivefold.config import Layout, load_hardware, load_model
    from fivefold.plan import TrainShape, plan

    # in fp32, on the block fivefold's model code builds, each rank one micro-batch of `batch`
    shape = TrainShape(
        seq_len=seq_len,
        global_batch=batch * ranks,
        micro_batch=batch,
        act_bytes=4,
        param_bytes=4,
        block="llama",
    )
    layout = Layout(fsdp=ranks, zero=3 if ranks > 1 else 0).resolve(ranks)
    m = plan(load_model(model_toml), load_hardware("cpu"), layout, shape).memory
    return {
        "grads": m.grads,
        "activations": m.activations,
        "buffers": m.buffers,
        "apart": m.grads_apart,
        "both_rule": m.grads + m.activations + m.buffers,
        "apart_rule": max(m.grads, m.activations) + m.buffers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--fsdp", action="store_true", help="2 ranks sharded by FSDP2 (zero 3)")
    parser.add_argument("--child", nargs=3, metavar=("TOML", "BATCH", "SEQ"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.seq_len <= 1024 or min(args.batches) < 1:  # exit 2, one line
        parser.error("--seq-len must be 1..1024 (the model's positions) and each --batches value at least 1")
    if args.child:
        toml, batch, seq = args.child
        got = measure(toml, int(batch), int(seq))
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(got))
        return
    if not Path("/proc/self/statm").exists():
        print("needs /proc (Linux) to read the resident size; nothing measured")
        return
    with tempfile.TemporaryDirectory() as tmp:
        toml = str(Path(tmp) / "peak-67m.toml")
        Path(toml).write_text(MODEL)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
        print(f"load average {os.getloadavg()[0]:.2f}; sequences of {args.seq_len} tokens; MB = 1e6 bytes")
        heads = ("grads", "acts", "buffers", "measured", "apart", "both")
        print(f"{'batch':>5} " + " ".join(f"{h:>8}" for h in heads))
        ranks = 2 if args.fsdp else 1
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"] if args.fsdp else []
        for batch in args.batches:
            run = [*(launch or [sys.executable]), __file__, "--child", toml, str(batch), str(args.seq_len)]
            done = subprocess.run(run, capture_output=True, text=True, env=env, check=True)
            # rank 0's line (torchrun may add lines of its own)
            got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("{")))
            plan = planned(toml, batch, args.seq_len, ranks)
            mb = 1e6
            print(
                f"{batch:>5} {plan['grads'] / mb:>8.1f} {plan['activations'] / mb:>8.1f} "
                f"{plan['buffers'] / mb:>8.1f} {got['beyond_start'] / mb:>8.1f} "
                f"{plan['apart_rule'] / mb:>8.1f} {plan['both_rule'] / mb:>8.1f}"
                + ("" if plan["apart"] else "   (the plan holds both here)")
            )


if __name__ == "__main__":
    main()
