"""Serving the `small` preset: fivefold on 1, 2 and 4 CPU ranks with tensor parallelism and on 2 with
context parallelism, against HF transformers' `generate` on one process (same weights), and against
`plan --mode inference`.

Every configuration decodes the same greedy continuation of the same prompt (checked). Each rank
and the HF peer use one intra-op thread, so the ratio compares code, not thread counts. Figures
are medians over repeats inside one launch per world size; the machine's load average is quoted,
since other processes share its cores (with fewer free cores than ranks, tp 4 measures the queue).

Columns: time to first token (prefill + one token), decode time per token, decode tokens/s;
the planner's prefill and decode time for the same layout on the `cpu` hardware preset (weights
and KV cache in fp32, as run) and measured / predicted.

Run: .venv/bin/python benchmarks/bench_serve.py [--prompt 64] [--new 32] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from fivefold.config import Layout, load_hardware, load_model
from fivefold.model import build_model, materialize
from fivefold.model.generate import Sampler
from fivefold.model.hf import hf_config
from fivefold.parallel.serve import ModelSource, ServeJob, serve_rank
from fivefold.parallel.spawn import spawn_ranks
from fivefold.plan.inference import InferenceShape, inference_plan

PRESET = "small"


def _body(rank: int, world: int, job: ServeJob, repeats: int) -> list:
    return [serve_rank(rank, world, job) for _ in range(repeats + 1)][1:]  # the first warms up


# (tp, cp) of each fivefold run
LAYOUTS = ((1, 1), (2, 1), (4, 1), (1, 2))


def fivefold_run(tp: int, cp: int, prompt: list[int], new: int, repeats: int) -> dict:
    job = ServeJob(ModelSource("preset", PRESET), (tuple(prompt),), new, Sampler(), tp=tp, cp=cp)
    per_rank = spawn_ranks(_body, tp * cp, job, repeats)
    leader = next(r for r in per_rank if r[0]["leader"])
    rows = [rep["timings"][0] for rep in leader]
    return {
        "tokens": leader[0]["tokens"][0],
        "ttft": statistics.median(r["time_to_first_token_s"] for r in rows),
        "decode": statistics.median(r["decode_s_per_token"] for r in rows),
    }


def hf_run(prompt: list[int], new: int, repeats: int) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    spec = load_model(PRESET)
    model = materialize(build_model(spec), "cpu", 0)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(spec).items() if k != "architectures"})
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.tie_weights()
    hf.eval()
    ids = torch.tensor([prompt])

    def timed(n: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - start, out[0, ids.shape[1] :].tolist()

    timed(new)  # warm-up
    firsts, fulls, tokens = [], [], []
    for _ in range(repeats):
        firsts.append(timed(1)[0])
        elapsed, tokens = timed(new)
        fulls.append(elapsed)
    ttft = statistics.median(firsts)
    return {"tokens": tokens, "ttft": ttft, "decode": (statistics.median(fulls) - ttft) / (new - 1)}


def predicted(tp: int, cp: int, prompt: int, new: int) -> tuple[float, float]:
    shape = InferenceShape(batch=1, context=prompt + new, prompt=prompt, weight_bytes=4, kv_bytes=4)
    layout = Layout(tp=tp, cp=cp).resolve(tp * cp)
    p = inference_plan(load_model(PRESET), load_hardware("cpu"), layout, shape)
    return p.prefill_time_s, p.decode_time_per_token_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument("--new", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per configuration (default 5)")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    prompt = list((b"The quick brown fox jumps over the lazy dog. " * 8)[: args.prompt])
    load_before = os.getloadavg()
    hf = hf_run(prompt, args.new, args.repeats)
    runs = {(tp, cp): fivefold_run(tp, cp, prompt, args.new, args.repeats) for tp, cp in LAYOUTS}
    load_after = os.getloadavg()
    for (tp, cp), run in runs.items():
        assert run["tokens"] == hf["tokens"], f"tp {tp} cp {cp} decoded other tokens than HF"
    lines = [
        f"`{PRESET}` preset, batch 1, prompt {args.prompt} tokens, {args.new} new tokens (greedy), fp32, "
        f"1 thread per rank; medians of {args.repeats} repeats; {os.cpu_count()} CPU cores, load average "
        f"{load_before[0]:.1f} before / {load_after[0]:.1f} after (1 min)",
        "",
        "| run | TTFT ms | decode ms/token | decode tokens/s | vs HF tokens/s | plan prefill ms | "
        "plan decode ms/token | measured / plan (prefill, decode) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| HF transformers generate, 1 process | {hf['ttft'] * 1e3:.1f} | {hf['decode'] * 1e3:.2f} | "
        f"{1 / hf['decode']:.0f} | 1.00 | | | |",
    ]
    for (tp, cp), run in runs.items():
        pre, dec = predicted(tp, cp, args.prompt, args.new)
        name = f"tp {tp}" if cp == 1 else f"cp {cp}"
        lines.append(
            f"| fivefold {name} ({tp * cp} rank{'s' if tp * cp > 1 else ''}) | {run['ttft'] * 1e3:.1f} | "
            f"{run['decode'] * 1e3:.2f} | {1 / run['decode']:.0f} | {hf['decode'] / run['decode']:.2f} | "
            f"{pre * 1e3:.2f} | {dec * 1e3:.3f} | {run['ttft'] / pre:.1f}, {run['decode'] / dec:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
