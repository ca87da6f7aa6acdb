"""`fivefold generate`: continue a prompt with a trained run or an HF checkpoint (KV-cached).

    fivefold generate --from DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N
                      [--greedy | --temperature T --top-k K --seed S] [--ids]

DIR is an HF checkpoint directory (`config.json` + safetensors, optional `tokenizer.json`) or a
fivefold run directory (`config.toml` + `checkpoints/step_N/`, the latest unless --checkpoint).
With --ids only the generated token ids are printed, comma-separated, on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from fivefold.errors import FivefoldError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="DIR",
        help="a fivefold run directory or an HF checkpoint directory",
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (encoded with the run's or checkpoint's tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    parser.add_argument("--ids", action="store_true", help="print only the generated ids, comma-separated")
    parser.add_argument("--checkpoint", default="latest", help="run directory: latest (default) or a step")
    parser.add_argument(
        "--dtype", default=None, choices=("fp32", "bf16"), help="compute dtype (default: the weights' own)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run (auto: cuda if present)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from fivefold.model.generate import generate

    if args.max_new_tokens < 0:
        raise FivefoldError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0) or args.top_k < 0:
        raise FivefoldError(
            f"--temperature must be a finite number >= 0 and --top-k >= 0 (0: all), "
            f"got {args.temperature} and {args.top_k}"
        )
    device = _device(args.device)
    model, tokenizer, eos_ids = load_for_generation(Path(args.source), args.checkpoint, args.dtype, device)
    vocab = model.spec.vocab
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids, vocab)
    else:
        if tokenizer is None:
            raise FivefoldError(f"{args.source} has no tokenizer.json to encode --prompt; give --prompt-ids")
        prompt = tokenizer.encode(args.prompt)
        if not prompt:
            raise FivefoldError("--prompt encodes to no tokens; give a non-empty prompt")
        if max(prompt) >= vocab:
            raise FivefoldError(
                f"the tokenizer yields ids up to {max(prompt)}, beyond the model's vocab {vocab}"
            )
    new = generate(
        model,
        torch.tensor([prompt]),
        args.max_new_tokens,
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=torch.Generator().manual_seed(args.seed),
        eos_token_id=eos_ids,
    )[0].tolist()
    if args.ids or tokenizer is None:
        print(",".join(str(i) for i in new))
    else:
        print(tokenizer.decode(prompt + new))
    return 0


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
        raise FivefoldError(f"--from {source}: no such directory")
    raise FivefoldError(
        f"--from {source}: neither an HF checkpoint (config.json) nor a fivefold run directory (config.toml)"
    )


def load_run(run_dir: Path, checkpoint: str = "latest", dtype: str | None = None, device: Any = "cpu"):
    """A run directory's model, with the weights of one of its checkpoints, in a single process."""
    import warnings

    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from fivefold.config import RunConfig
    from fivefold.model.hf import DTYPES, empty_model
    from fivefold.train.checkpoint import find_checkpoint
    from fivefold.train.safe_metadata import read_metadata, safe_load

    config = RunConfig.from_toml(run_dir / "config.toml")
    path = find_checkpoint(run_dir, checkpoint)
    model = empty_model(config.model, DTYPES[dtype or "fp32"], device)
    weights = model.state_dict()
    try:
        stored = read_metadata(path).state_dict_metadata
    except Exception as exc:  # a missing or unreadable .metadata: DCP raises several kinds
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise FivefoldError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {reason})") from None
    if config.model.tie_embeddings and "model.lm_head.weight" not in stored:
        weights.pop("lm_head.weight", None)  # the same tensor as the embedding
    missing = sorted(k for k in weights if f"model.{k}" not in stored)
    if missing:
        raise FivefoldError(
            f"checkpoint {path} does not hold the weights of the model in {run_dir / 'config.toml'}; "
            f"missing e.g. {', '.join(missing[:3])}"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            safe_load({"model": weights}, path)  # in place, cast to the model's dtype
        except (
            Exception,
            CheckpointException,
        ) as exc:  # a deleted or damaged shard: DCP raises several kinds
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
            raise FivefoldError(f"checkpoint {path} is corrupt or incomplete ({detail})") from None
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
        except json.JSONDecodeError as exc:
            raise FivefoldError(f"malformed JSON in {file}: {exc}") from None
        if eos is not None:
            return [eos] if isinstance(eos, int) else [int(i) for i in eos]
    return None


def _parse_ids(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
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
