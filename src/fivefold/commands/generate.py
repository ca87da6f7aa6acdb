"""`fivefold generate`: continue prompts with a trained run, an HF checkpoint or a random preset.

    fivefold generate (--from DIR | --model PRESET [--init-seed S])
                      (--prompt TEXT | --prompt-ids 1,2,3)... --max-new-tokens N
                      [--greedy | --temperature T --top-k K --seed S] [--ids] [--stream] [--json]
                      [--nproc N --tp T [--pp P] [--dp R] [--cp C] [--ep E] [--comm] [--verify]]

DIR is an HF checkpoint directory (`config.json` + safetensors, optional `tokenizer.json`) or a
fivefold run directory (`config.toml` + `checkpoints/step_N/`, the latest unless --checkpoint).
--prompt / --prompt-ids may be repeated: the prompts form one left-padded batch (each row decodes
as it would alone) and each stops at its end-of-sequence id or after N tokens. With --ids only the
generated token ids are printed, comma-separated, one line per prompt; --json prints tokens and
timings per prompt. With --nproc N the model is served by N local ranks (`fivefold.parallel.serve`):
tensor-parallel shards, pipeline stages and data-parallel replicas, gloo on CPU, NCCL on GPU; with
--cp C each replica's prompts and KV cache are split over C ranks; with --ep E a mixture-of-experts
model's experts are split over groups of E of the replicas' ranks (cp first), which decode in
lockstep. --comm adds the communication per rank (prefill and per decoded token) from the ledger,
beside the plan's; --verify also decodes in one process and judges the tokens against it, the
traffic and KV cache against the plan (`fivefold.commands.verify.judge_serving`), exit 1 on a
difference.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from fivefold.config import add_layout_arguments
from fivefold.errors import FivefoldError, reason


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--from",
        dest="source",
        metavar="DIR",
        help="a fivefold run directory or an HF checkpoint directory",
    )
    source.add_argument("--model", help="a model preset (or .toml), randomly initialised from --init-seed")
    parser.add_argument("--init-seed", type=int, default=0, help="seed of --model's weights (default 0)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", action="append", help="prompt text (the run's or checkpoint's tokenizer); repeatable"
    )
    prompt.add_argument(
        "--prompt-ids", action="append", help="prompt token ids, comma-separated, e.g. 1,2,3; repeatable"
    )
    parser.add_argument(
        "--max-new-tokens",
        default="64",
        help="tokens to generate: one count, or one per prompt comma-separated (default 64)",
    )
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    # None: not given, so that --greedy with either is told apart from the defaults (1 and 0)
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1)")
    parser.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely (default 0: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    parser.add_argument("--ids", action="store_true", help="print only the generated ids, comma-separated")
    parser.add_argument("--stream", action="store_true", help="print tokens as they are chosen")
    parser.add_argument("--json", action="store_true", help="per prompt: tokens and timings as JSON")
    parser.add_argument(
        "--checkpoint", default=None, help="with --from a run directory: latest (default) or a step"
    )
    parser.add_argument(
        "--dtype", default=None, choices=("fp32", "bf16"), help="compute dtype (default: the weights' own)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run (auto: cuda if present)",
    )
    parser.add_argument("--nproc", type=int, default=1, help="local ranks serving the model (default 1)")
    add_layout_arguments(parser, axes=("dp", "tp", "pp", "cp", "ep"))  # dp: replicas serving other prompts
    parser.add_argument("--comm", action="store_true", help="with --nproc: the communication per rank")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="with --nproc: also decode in one process and judge the ranks' tokens against it, their "
        "collectives and KV cache against the plan (exit 1 on a difference)",
    )


def run(args: argparse.Namespace) -> int:
    if args.checkpoint is not None and args.model is not None:  # nothing to pick a step of
        raise FivefoldError(
            f"--checkpoint {args.checkpoint} picks a step of a run directory (--from); --model builds "
            "fresh weights from a preset: drop one of them"
        )
    if args.checkpoint is None:
        args.checkpoint = "latest"
    if args.stream and args.json:  # stdout is one JSON object or the text as it comes, not both
        raise FivefoldError(
            "--stream prints the text as it is chosen and --json one object at the end; give one of them"
        )
    if args.ids and args.json:  # the JSON object already holds the ids; one of the two would be dropped
        raise FivefoldError("--ids prints the ids as a line and --json as one object; give one of them")
    # --greedy decides every token: a temperature or top-k given with it would be dropped without a word
    sampling = (("--temperature", args.temperature), ("--top-k", args.top_k))
    given = [flag for flag, value in sampling if value is not None]
    if args.greedy and given:
        raise FivefoldError(
            f"--greedy takes the most likely token, so {' and '.join(given)} would not be used; "
            "give --greedy, or sample with --temperature / --top-k"
        )
    if args.comm and args.nproc == 1:
        raise FivefoldError("--comm reports the ranks' communication: give --nproc 2 or more and a layout")
    args.temperature = 1.0 if args.temperature is None else args.temperature
    args.top_k = 0 if args.top_k is None else args.top_k
    args.max_new_tokens = _parse_limits(args.max_new_tokens)
    if not (math.isfinite(args.temperature) and args.temperature >= 0) or args.top_k < 0:
        raise FivefoldError(
            f"--temperature must be a finite number >= 0 and --top-k >= 0 (0: all), "
            f"got {args.temperature} and {args.top_k}"
        )
    for flag, seed in (("--seed", args.seed), ("--init-seed", args.init_seed)):
        if not 0 <= seed < 2**63:  # what torch's generators take, as train and verify say
            raise FivefoldError(f"{flag} must be in 0..2^63-1, got {seed}")
    from fivefold.parallel.serve import resolve_degrees

    dp = None if args.dp in (None, -1) else args.dp  # fill: nproc / (tp·pp)
    tp, pp, ep, cp = (1 if v is None else v for v in (args.tp, args.pp, args.ep, args.cp))
    tp, pp, dp = resolve_degrees(args.nproc, tp, pp, dp, ep, cp)
    if args.verify and args.nproc == 1:
        raise FivefoldError("--verify compares ranks with one process: give --nproc 2 or more and a layout")
    if args.nproc == 1:
        return _run_here(args)
    return _run_ranks(args, tp, pp, dp, ep, cp)


def _sampler(args: argparse.Namespace):
    from fivefold.model.generate import Sampler

    return Sampler(args.greedy, args.temperature, args.top_k, args.seed)


def _prompts(args: argparse.Namespace, tokenizer: Any, vocab: int) -> list[list[int]]:
    if args.prompt_ids is not None:
        return [_parse_ids(text, vocab) for text in args.prompt_ids]
    if tokenizer is None:
        raise FivefoldError(f"{args.source} has no tokenizer.json to encode --prompt; give --prompt-ids")
    prompts = []
    for text in args.prompt:
        try:
            prompt = tokenizer.encode(text)
        except UnicodeEncodeError:  # raw bytes from the shell that the tokenizer's text cannot hold
            raise FivefoldError(
                "--prompt is not valid UTF-8 text; give it as text, or its token ids with --prompt-ids"
            ) from None
        if not prompt:
            raise FivefoldError("--prompt encodes to no tokens; give a non-empty prompt")
        if max(prompt) >= vocab:
            raise FivefoldError(
                f"the tokenizer yields ids up to {max(prompt)}, beyond the model's vocab {vocab}"
            )
        prompts.append(prompt)
    return prompts


def _run_here(args: argparse.Namespace) -> int:
    """One process: the whole model, the same decoding loop as the ranks."""
    prompts, rows, tokenizer, _ = _decode_here(args, stream=args.stream)
    return _print(args, prompts, rows, tokenizer, [])


def _decode_here(
    args: argparse.Namespace, stream: bool = False
) -> tuple[list[list[int]], list[dict], Any, Any]:
    """(prompts, a row per prompt, tokenizer, the weights' dtype) of the whole model decoding in this
    process."""
    from fivefold.model.generate import ModelStep, decode
    from fivefold.parallel.serve import StreamPrinter, check_context

    device = _device(args.device)
    if args.model is not None:
        model, tokenizer, eos_ids = _random_model(args.model, args.init_seed, args.dtype, device)
    else:
        model, tokenizer, eos_ids = load_for_generation(
            Path(args.source), args.checkpoint, args.dtype, device
        )
    prompts = _prompts(args, tokenizer, model.spec.vocab)
    check_context(model.spec, prompts, args.max_new_tokens)
    sampler = _sampler(args)
    step = ModelStep(model, sampler, sampler.generators(range(len(prompts))))
    # --ids streams the ids, not their text
    shown = None if args.ids else tokenizer
    on_token = StreamPrinter(shown, len(prompts), list(range(len(prompts)))) if stream else None
    got = decode(step, prompts, args.max_new_tokens, eos_ids, on_token)
    if on_token is not None:
        on_token.finish()
    rows = [{"prompt": i, "tokens": got.tokens[i], **got.timings(i)} for i in range(len(prompts))]
    return prompts, rows, tokenizer, next(model.parameters()).dtype


def _run_ranks(args: argparse.Namespace, tp: int, pp: int, dp: int, ep: int, cp: int) -> int:
    from fivefold.parallel.serve import ModelSource, ServeJob, check_job, serve
    from fivefold.train.tokenizer import load_tokenizer

    device = _device(args.device)
    if args.model is not None:
        source = ModelSource("preset", args.model, init_seed=args.init_seed, dtype=args.dtype)
        tokenizer_name, eos_ids = "bytes", None
    else:
        path = Path(args.source)
        if (path / "config.json").is_file():
            source = ModelSource("hf", str(path), dtype=args.dtype)
            tokenizer_name = str(path) if (path / "tokenizer.json").is_file() else None
            eos_ids = _hf_eos_ids(path)
        elif (path / "config.toml").is_file():
            from fivefold.config import RunConfig
            from fivefold.train.checkpoint import check_saved_model, find_checkpoint

            # a missing checkpoint, or one saved for another model than config.toml now describes, is
            # refused before any rank starts
            found = find_checkpoint(path, args.checkpoint)
            config = RunConfig.from_toml(path / "config.toml")
            check_saved_model(found, config.model, path / "config.toml")
            source = ModelSource("run", str(path), checkpoint=args.checkpoint, dtype=args.dtype)
            tokenizer_name = config.train.tokenizer
            eos_ids = None
        else:
            load_for_generation(path)  # raises the one-line reason
            raise AssertionError("unreachable")
    tokenizer = load_tokenizer(tokenizer_name) if tokenizer_name is not None else None
    if source.kind == "run" and tokenizer is not None and tokenizer.eos_id is not None:
        eos_ids = [tokenizer.eos_id]
    spec = source.spec()
    prompts = _prompts(args, tokenizer, spec.vocab)
    job = ServeJob(
        source=source,
        prompts=tuple(tuple(p) for p in prompts),
        max_new_tokens=args.max_new_tokens,
        sampler=_sampler(args),
        eos_ids=None if eos_ids is None else tuple(eos_ids),
        tp=tp,
        pp=pp,
        dp=dp,
        ep=ep,
        cp=cp,
        device=device.type,
        stream=args.stream,
        ledger=args.comm or args.verify,
        tokenizer=None if args.ids else tokenizer_name,  # the stream's words; --ids streams ids
    )
    check_job(spec, job)
    result = serve(job, args.nproc)
    if not args.verify:
        return _print(args, prompts, result["prompts"], tokenizer, result["ledger"], result["kv_cache"])
    import torch

    from fivefold.commands.verify import judge_serving, print_serving

    _, here, _, dtype = _decode_here(args)
    # 16-bit weights sum in another order over ranks: a near-tie may pick another token, so there the
    # tokens are shown, not judged (fp32 judges them exactly)
    table = judge_serving(result, [row["tokens"] for row in here], exact=dtype == torch.float32)
    ok = all(r.ok is not False for r in table)
    if args.json:
        verdict = {"ok": ok, "rows": [r.to_json() for r in table]}
        _print(args, prompts, result["prompts"], tokenizer, result["ledger"], result["kv_cache"], verdict)
    else:
        _print(args, prompts, result["prompts"], tokenizer, result["ledger"], result["kv_cache"])
        split = " × ".join(
            f"{a} {v}" for a, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if v > 1
        )
        print_serving(
            f"{spec.name} served on {args.nproc} ranks ({split}) against one process and the plan", table
        )
    return 0 if ok else 1


def _print(
    args: argparse.Namespace,
    prompts,
    rows: list[dict],
    tokenizer: Any,
    ledger: list[dict],
    kv_cache: list[dict] | None = None,
    verdict: dict | None = None,
) -> int:
    if args.stream and not args.json:
        print()  # end the streamed line(s)
        if args.comm and ledger:
            print(comm_table(ledger))
        return 0
    if args.json:
        out: dict[str, Any] = {"prompts": rows}
        if ledger:
            out["communication"] = ledger
        if kv_cache:
            out["kv_cache"] = kv_cache  # per rank: KV heads per layer, cache bytes (and the plan's)
        if verdict is not None:
            out["verify"] = verdict
        print(json.dumps(out, indent=1))
        return 0
    for prompt, row in zip(prompts, rows):
        new = row["tokens"]
        if args.ids or tokenizer is None:
            print(",".join(str(i) for i in new))
        else:
            print(tokenizer.decode(list(prompt) + new))
    if args.comm and ledger:
        print(comm_table(ledger))
    return 0


def comm_table(ledger: list[dict]) -> str:
    """Per rank, per (axis, op): ops and bytes in the prefill and per decoded token, each beside the
    plan's bytes (`plan.inference.decode_traffic`; expert rows under balanced routing)."""
    lines = [f"{'rank':>4}  {'axis':<6} {'op':<11} {'prefill ops':>11} {'bytes':>9} {'plan':>9}  "
             f"{'ops/token':>9} {'bytes':>9} {'plan':>9}"]  # fmt: skip
    for entry in ledger:
        tables = [
            {(r["axis"], r["op"]): r for r in entry.get(name, [])}
            for name in ("prefill", "planned_prefill", "per_token", "planned_per_token")
        ]
        for key in sorted(set().union(*tables)):
            p, pp, t, tp = (table.get(key, {}) for table in tables)
            lines.append(
                f"{entry['rank']:>4}  {key[0]:<6} {key[1]:<11} {p.get('count', 0):>11g} "
                f"{p.get('bytes', 0):>9,.0f} {pp.get('bytes', 0):>9,.0f}  {t.get('count', 0):>9g} "
                f"{t.get('bytes', 0):>9,.0f} {tp.get('bytes', 0):>9,.0f}"
            )
    if len(lines) == 1:  # replicas alone: a header over nothing would read as a lost ledger
        return "no communication: each replica generates its own prompts, and the plan sends nothing either"
    return "\n".join(lines)


def _random_model(name: str, seed: int, dtype: str | None, device: Any) -> tuple[Any, Any, None]:
    from fivefold.config import load_model
    from fivefold.model import build_model, materialize
    from fivefold.model.hf import DTYPES
    from fivefold.train.tokenizer import ByteTokenizer

    spec = load_model(name)
    check_weights_fit(spec, dtype, device)
    model = materialize(build_model(spec), device, seed).to(DTYPES[dtype or "fp32"]).eval()
    return model, ByteTokenizer() if model.spec.vocab >= 256 else None, None


def check_weights_fit(spec: Any, dtype: str | None, device: Any) -> None:
    """Refuse, before allocating, weights larger than the memory they would be made in: a hand-edited
    vocab or width would otherwise end in the allocator's traceback or the out-of-memory kill."""
    import torch

    from fivefold.layout_math import numel, param_shapes
    from fivefold.train.host_memory import physical_bytes

    need = sum(numel(shape) for shape in param_shapes(spec).values()) * (2 if dtype == "bf16" else 4)
    if torch.device(device).type == "cuda":
        have, where = torch.cuda.get_device_properties(torch.device(device)).total_memory, "the GPU's"
    else:
        have, where = physical_bytes(), "this machine's"
    if need > have:
        raise FivefoldError(
            f"model {spec.name}'s weights take {need / 1e9:,.1f} GB, more than {where} "
            f"{have / 1e9:.1f} GB; serve it over ranks (--nproc with --tp/--pp) on a bigger machine"
        )


def load_for_generation(
    source: Path, checkpoint: str = "latest", dtype: str | None = None, device: Any = "cpu"
) -> tuple[Any, Any, list[int] | None]:
    """(model, tokenizer or None, end-of-sequence ids or None) from an HF or a run directory."""
    from fivefold.model.hf import load_hf
    from fivefold.train.tokenizer import load_tokenizer

    if (source / "config.json").is_file():
        _, model = load_hf(source, dtype=dtype, device=device)
        tokenizer = load_tokenizer(str(source)) if (source / "tokenizer.json").is_file() else None
        return model, tokenizer, _hf_eos_ids(source)
    if (source / "config.toml").is_file():
        config, model = load_run(source, checkpoint, dtype, device)
        tokenizer = load_tokenizer(config.train.tokenizer)
        return model, tokenizer, None if tokenizer.eos_id is None else [tokenizer.eos_id]
    if not source.is_dir():
        what = "a file, not a directory" if source.exists() else "no such directory"
        raise FivefoldError(f"--from {source}: {what} (an HF checkpoint or a fivefold run directory)")
    raise FivefoldError(
        f"--from {source}: neither an HF checkpoint (config.json) nor a fivefold run directory (config.toml)"
    )


def load_run(run_dir: Path, checkpoint: str = "latest", dtype: str | None = None, device: Any = "cpu"):
    """A run directory's model, with the weights of one of its checkpoints, in a single process."""

    import torch

    from fivefold.config import RunConfig
    from fivefold.model.hf import (
        DTYPES,
        EARLIER_CHECKPOINT,
        NON_FINITE_CHECKPOINT,
        empty_model,
        refuse_non_finite,
    )
    from fivefold.train.checkpoint import (
        check_model_shapes,
        check_not_damaged,
        check_saved_model,
        find_checkpoint,
    )
    from fivefold.train.safe_metadata import load_weights, read_metadata

    config = RunConfig.from_toml(run_dir / "config.toml")
    path = find_checkpoint(run_dir, checkpoint)
    try:
        stored = read_metadata(path).state_dict_metadata
    except Exception as exc:  # a missing or unreadable .metadata: DCP raises several kinds
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise FivefoldError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {reason})") from None
    check_weights_fit(config.model, dtype, device)  # config.toml may have been edited since
    check_saved_model(path, config.model, run_dir / "config.toml")
    model = empty_model(config.model, DTYPES[dtype or "fp32"], device)
    weights = model.state_dict()
    if config.model.tie_embeddings and "model.lm_head.weight" not in stored:
        weights.pop("lm_head.weight", None)  # the same tensor as the embedding
    missing = sorted(k for k in weights if f"model.{k}" not in stored)
    if missing:
        raise FivefoldError(
            f"checkpoint {path} does not hold the weights of the model in {run_dir / 'config.toml'}; "
            f"missing e.g. {', '.join(missing[:3])}"
        )
    check_model_shapes(path, weights, stored, run_dir / "config.toml")
    check_not_damaged(path, EARLIER_CHECKPOINT)
    load_weights(weights, path)  # in place, cast to the model's dtype
    refuse_non_finite(weights.items(), f"checkpoint {path}", NON_FINITE_CHECKPOINT)
    with torch.no_grad():  # dcp.load may have replaced tensors in the dict instead of filling them
        for name, tensor in model.state_dict().items():
            if name in weights and weights[name] is not tensor:
                tensor.copy_(weights[name])
    return config, model.eval()


def _hf_eos_ids(source: Path) -> list[int] | None:
    """End-of-sequence ids from generation_config.json, else config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        file = source / name
        if not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids = None if eos is None else [eos] if isinstance(eos, int) else [int(i) for i in eos]
        except (OSError, ValueError, RecursionError, AttributeError, TypeError) as exc:
            raise FivefoldError(
                f"{file}: not a JSON object whose eos_token_id is a token id or a list of them "
                f"({reason(exc)})"
            ) from None
        if ids is not None:
            return ids
    return None


def _parse_limits(text: str) -> int | tuple[int, ...]:
    """`--max-new-tokens`: one count for every prompt, or one per prompt (comma-separated)."""
    try:
        limits = tuple(int(part) for part in str(text).replace(" ", "").split(","))
    except ValueError:
        raise FivefoldError(f"--max-new-tokens must be integers, e.g. 64 or 64,8; got {text!r}") from None
    if any(n < 0 for n in limits):
        raise FivefoldError(f"--max-new-tokens must be >= 0, got {text}")
    return limits[0] if len(limits) == 1 else limits


def _parse_ids(text: str, vocab: int) -> list[int]:
    try:
        parts = text.replace(" ", "").split(",")
        if "" in parts[:-1]:  # "1,,2" or ",1": a slip, not two tokens (a trailing comma is harmless)
            raise ValueError("an empty entry")
        ids = [int(part) for part in parts if part]
    except ValueError:
        raise FivefoldError(
            f"--prompt-ids must be comma-separated integers, e.g. 1,2,3; got {text!r}"
        ) from None
    if not ids:
        raise FivefoldError("--prompt-ids is empty; give at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise FivefoldError(f"--prompt-ids {bad[:5]} outside the model's vocabulary 0..{vocab - 1}")
    return ids


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise FivefoldError("--device cuda: no CUDA device is available; use --device cpu")
    return torch.device(name)
