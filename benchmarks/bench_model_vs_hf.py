"""Training-step throughput of fivefold's model against HF transformers' LlamaForCausalLM.

Same dims, same weights (copied by name, q/k rows in HF's rotary order), same batch, same loss
function and the same AdamW: one step is forward + backward + optimizer step. Each round times both
models back to back (in alternating order) and yields one ratio HF time / fivefold time; the
reported ratio is the median over rounds, so load from other processes that drifts between rounds
cancels (> 1: fivefold faster). Tokens/s are medians over rounds too, and move with the machine's
load; the ratio is the result.

On a machine shared with other busy processes, `--threads 1` gives far steadier numbers: with more
intra-op threads than free cores, a step waits on whichever thread was descheduled.

Run: .venv/bin/python benchmarks/bench_model_vs_hf.py [--repeats 9] [--steps 1] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fivefold.config import ModelSpec, load_model
from fivefold.model import build_model, lm_loss, materialize
from fivefold.model.hf import hf_config, rotary_rows

# (label, spec, micro-batch, sequence length)
CASES = [
    ("small (demo preset)", load_model("small"), 8, 128),
    (
        "~20M",
        ModelSpec(name="20m", layers=6, hidden=512, heads=8, kv_heads=4, ffn_hidden=1536, vocab=2048),
        4,
        256,
    ),
]


def hf_twin(spec: ModelSpec, model: torch.nn.Module) -> torch.nn.Module:
    """LlamaForCausalLM of the same config, holding a copy of `model`'s weights."""
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(spec).items() if k != "architectures"})
    hf = transformers.LlamaForCausalLM(config)
    # HF's rotary pairs a head's halves where fivefold pairs neighbours: q/k rows change order
    state = {name: rotary_rows(name, t, spec.head_dim, to_hf=True) for name, t in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    if spec.tie_embeddings:
        hf.tie_weights()
    return hf.train()


def make_step(model: torch.nn.Module, logits_of, inputs: torch.Tensor, labels: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(logits_of(model, inputs), labels)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def measure(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def bench_case(label: str, spec: ModelSpec, batch: int, seq: int, repeats: int, steps: int) -> dict:
    ours = materialize(build_model(spec), "cpu", seed=0).train()
    theirs = hf_twin(spec, ours)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, spec.vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, spec.vocab, (batch, seq), generator=gen)
    with torch.no_grad():  # same weights, same function: the comparison is like for like
        gap = (ours(inputs) - theirs(inputs).logits).abs().max().item()
    if gap > 1e-3:  # fp32: the twins agree to rounding, or the timing compares two different models
        raise SystemExit(
            f"{label}: HF's logits differ from fivefold's by {gap:.1e}; the weights were not copied"
        )
    runs = {
        "fivefold": make_step(ours, lambda m, x: m(x), inputs, labels),
        "hf": make_step(theirs, lambda m, x: m(x).logits, inputs, labels),
    }
    for step in runs.values():  # warm-up: allocator, thread pools, first-call paths
        step()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(measure(runs[name], steps))
    tokens = batch * seq
    median = {name: statistics.median(t) for name, t in times.items()}
    ratios = [h / f for h, f in zip(times["hf"], times["fivefold"])]
    return {
        "case": label,
        "params": spec.num_params(),
        "tokens_per_step": tokens,
        "logits_max_abs_diff": gap,
        "fivefold_step_s": median["fivefold"],
        "hf_step_s": median["hf"],
        "fivefold_tokens_per_s": tokens / median["fivefold"],
        "hf_tokens_per_s": tokens / median["hf"],
        "ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (both models per round)")
    parser.add_argument("--steps", type=int, default=1, help="training steps per model per round")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    rows = [bench_case(*case, args.repeats, args.steps) for case in CASES]
    if args.json:
        print(
            json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "rows": rows})
        )
        return
    print(
        f"training step (forward + backward + AdamW), fp32, CPU, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}, transformers {transformers.__version__}; "
        f"median of {args.repeats} alternating rounds of {args.steps} steps"
    )
    header = (
        f"{'model':<22}{'params':>8}{'tokens':>8}{'fivefold tok/s':>16}{'HF tok/s':>11}{'ratio':>8}"
        f"{'rounds min..max':>17}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['case']:<22}{row['params'] / 1e6:>7.1f}M{row['tokens_per_step']:>8}"
            f"{row['fivefold_tokens_per_s']:>16,.0f}{row['hf_tokens_per_s']:>11,.0f}{row['ratio']:>8.2f}"
            f"{row['ratio_range'][0]:>10.2f}..{row['ratio_range'][1]:.2f}"
        )
    print(
        "ratio = HF step time / fivefold step time (> 1: fivefold faster); logits max |diff| before "
        "training: " + ", ".join(f"{r['logits_max_abs_diff']:.1e}" for r in rows)
    )


if __name__ == "__main__":
    main()
