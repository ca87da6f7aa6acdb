"""Training data: a corpus turned into one token stream, a held-out split, deterministic batches.

Sources (`TrainSpec.data`):
  * `stdlib` (default): the `.py` sources of the running interpreter's standard library, read at
    run time in sorted order, so every machine has the same corpus without a download;
  * a text file, or a folder of UTF-8 files (read recursively, sorted);
  * a `.jsonl` file whose objects carry a `text` field;
  * a pre-tokenized `.bin` file: raw token ids, uint16 unless a sidecar `<file>.json` says
    `{"dtype": "uint32"}` (`write_bin` writes both).

Held-out split: with many documents, each document goes wholly to the held-out side when a
hash of its name says so (about 2%, stable across machines and runs); otherwise the last 2% of
the stream is held out.

Batches are a pure function of (seed, step): the global batch of a step is drawn the same way
however many ranks there are, and rank r of R takes rows [r·B/R, (r+1)·B/R), so the union over
ranks is exactly the single-process batch.
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fivefold.errors import FivefoldError, reason
from fivefold.train.tokenizer import ByteTokenizer, HFTokenizer

HELD_OUT_PER_MILLE = 20  # documents whose name hashes below this (of 1000) are held out
TRAIN_STREAM, EVAL_STREAM = 0, 1


@dataclass
class TokenData:
    """A corpus as token ids: a training stream and a held-out stream (1-D integer arrays)."""

    train: np.ndarray
    held_out: np.ndarray
    source: str
    documents: int

    @property
    def max_token(self) -> int:
        return int(max(self.train.max(initial=0), self.held_out.max(initial=0)))


# --------------------------------------------------------------------------------------------
# reading documents


def stdlib_documents() -> list[tuple[str, bytes]]:
    """(relative path, bytes) of every stdlib `.py` file, sorted by path; site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts)
    ]
    docs = [(p.relative_to(root).as_posix(), p.read_bytes()) for p in files if p.is_file()]
    docs.sort(key=lambda d: d[0])
    if not docs:
        raise FivefoldError(f"no Python sources found under the standard library at {root}")
    return docs


def folder_documents(root: Path) -> list[tuple[str, bytes]]:
    docs = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        data = p.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # binary files are not text
        docs.append((rel.as_posix(), data))
    if not docs:
        raise FivefoldError(f"no UTF-8 text files found under {root}")
    return docs


def jsonl_documents(path: Path) -> list[tuple[str, bytes]]:
    docs = []
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                text = obj["text"]
            except (ValueError, RecursionError) as exc:  # not JSON, not text, a 5000-digit number
                raise FivefoldError(f"{path}:{lineno}: not a JSON object: {reason(exc)}") from None
            except (KeyError, TypeError):
                raise FivefoldError(f'{path}:{lineno}: each JSONL line needs a "text" field') from None
            if not isinstance(text, str):
                raise FivefoldError(f'{path}:{lineno}: "text" must be a string')
            docs.append((f"{path.name}:{lineno}", text.encode("utf-8")))
    if not docs:
        raise FivefoldError(f"{path} holds no documents")
    return docs


def check_data_source(source: str) -> None:
    """The cheap part of reading `source`: it names something that is there."""
    if source != "stdlib" and not Path(source).exists():
        raise FivefoldError(f"data not found: {source} (use 'stdlib', a text file or folder, .jsonl or .bin)")
    if source.endswith(".bin") and not Path(source).is_file():
        raise FivefoldError(f"--data {source}: a .bin of token ids must be a file")


def read_documents(source: str) -> list[tuple[str, bytes]]:
    if source == "stdlib":
        return stdlib_documents()
    path = Path(source)
    check_data_source(source)
    if path.is_dir():
        return folder_documents(path)
    if path.suffix == ".jsonl":
        return jsonl_documents(path)
    try:
        return [(path.name, path.read_bytes())]
    except OSError as exc:
        raise FivefoldError(f"cannot read {path}: {exc}") from None


# --------------------------------------------------------------------------------------------
# tokenizing and splitting


def token_dtype(vocab_size: int) -> np.dtype:
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _tokenize(docs: list[tuple[str, bytes]], tokenizer: ByteTokenizer | HFTokenizer) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(b"".join(data for _, data in docs), dtype=np.uint8)
    dtype = token_dtype(tokenizer.vocab_size)
    parts = []
    for _, data in docs:
        ids = tokenizer.encode(data.decode("utf-8", errors="replace"))
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
        parts.append(np.asarray(ids, dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % 1000 < HELD_OUT_PER_MILLE


def _tail_split(tokens: np.ndarray, min_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    held = max(len(tokens) * HELD_OUT_PER_MILLE // 1000, min_tokens)
    return tokens[: len(tokens) - held], tokens[len(tokens) - held :]


def load_data(source: str, tokenizer: ByteTokenizer | HFTokenizer, seq_len: int) -> TokenData:
    """Read, tokenize and split `source`; each side must hold at least one full sequence."""
    need = seq_len + 1
    if source != "stdlib" and Path(source).suffix == ".bin":
        tokens = read_bin(Path(source))
        train, held = _tail_split(tokens, need)
        docs = 1
    else:
        documents = read_documents(source)
        docs = len(documents)
        held_docs = [d for d in documents if _is_held_out(d[0])]
        train_docs = [d for d in documents if not _is_held_out(d[0])]
        train, held = _tokenize(train_docs, tokenizer), _tokenize(held_docs, tokenizer)
        if len(held) < need or len(train) < need:  # too few documents to split by name
            train, held = _tail_split(np.concatenate([train, held]) if len(held) else train, need)
    if len(train) < need or len(held) < need:
        raise FivefoldError(
            f"data {source} has {len(train) + len(held)} tokens: too few for a training and a held-out "
            f"sequence of --seq-len {seq_len}; use more text or a shorter --seq-len"
        )
    return TokenData(train=train, held_out=held, source=source, documents=docs)


# --------------------------------------------------------------------------------------------
# pre-tokenized files


def write_bin(path: str | Path, ids: np.ndarray | list[int], dtype: str = "uint16") -> Path:
    """Write token ids as a raw `.bin` with a `<file>.json` sidecar naming the dtype."""
    path = Path(path)
    if dtype not in ("uint16", "uint32"):
        raise FivefoldError(f"a .bin dtype must be uint16 or uint32, got {dtype}")
    arr = np.asarray(ids)
    if arr.size and (arr.min() < 0 or arr.max() >= np.iinfo(dtype).max):
        raise FivefoldError(f"token ids do not fit {dtype}")
    arr.astype(dtype).tofile(path)
    Path(f"{path}.json").write_text(json.dumps({"dtype": dtype, "tokens": int(arr.size)}))
    return path


def read_bin(path: Path) -> np.ndarray:
    """Memory-map a `.bin` of token ids (uint16 unless the sidecar says uint32)."""
    dtype = "uint16"
    sidecar = Path(f"{path}.json")
    if sidecar.exists():
        try:
            dtype = json.loads(sidecar.read_text()).get("dtype", dtype)
        except (OSError, ValueError, RecursionError, AttributeError) as exc:  # a directory, not a JSON object
            raise FivefoldError(f"{sidecar}: not a JSON object with a dtype ({reason(exc)})") from None
    if dtype not in ("uint16", "uint32"):
        raise FivefoldError(f"{sidecar}: dtype must be uint16 or uint32, got {dtype!r}")
    size = path.stat().st_size
    if size % np.dtype(dtype).itemsize:
        raise FivefoldError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    if size == 0:
        raise FivefoldError(f"{path} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


# --------------------------------------------------------------------------------------------
# batches


def batch_rows(global_batch: int, rank: int, ranks: int) -> slice:
    """The rows of a global batch that data-parallel rank `rank` of `ranks` takes."""
    if global_batch % ranks:
        raise FivefoldError(f"global batch {global_batch} does not split evenly over {ranks} data ranks")
    per = global_batch // ranks
    return slice(rank * per, (rank + 1) * per)


def sample_batch(
    tokens: np.ndarray,
    seq_len: int,
    global_batch: int,
    seed: int,
    step: int,
    rank: int = 0,
    ranks: int = 1,
    stream: int = TRAIN_STREAM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch for `step`: (inputs, labels), int64 [rows, seq_len].

    Window starts are drawn from a generator keyed by (seed, stream, step) only, so the batch
    does not depend on how many ranks there are or on what ran before (resume is exact).
    """
    rng = np.random.default_rng([seed, stream, step])
    starts = rng.integers(0, len(tokens) - seq_len, size=global_batch)[batch_rows(global_batch, rank, ranks)]
    windows = np.stack([np.asarray(tokens[s : s + seq_len + 1]) for s in starts]).astype(np.int64)
    block = torch.from_numpy(windows)
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


class BatchPrefetcher:
    """Batches of consecutive steps, each sampled on a worker thread while the step before it runs.

    `get(step)` returns `fetch(step)` on `device` and starts `fetch(step + 1)` (up to `last`) in the
    background, so the loop never waits for sampling, copying or pinning between two steps. A step
    asked for out of order (resume) is fetched on the spot. The batches are the same as without it:
    `fetch` is a pure function of the step.
    """

    def __init__(
        self, fetch: Callable[[int], tuple[torch.Tensor, ...]], device: torch.device, last: int
    ) -> None:
        self._fetch, self._device, self._last = fetch, device, last
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fivefold-batches")
        self._pending: tuple[int, Future] | None = None

    def _load(self, step: int) -> tuple[torch.Tensor, ...]:
        batch = self._fetch(step)
        if self._device.type == "cuda":  # pinned host memory: the copy below overlaps compute
            batch = tuple(t.pin_memory() for t in batch)
        return batch

    def get(self, step: int) -> tuple[torch.Tensor, ...]:
        if self._pending is not None and self._pending[0] == step:
            batch = self._pending[1].result()
        else:
            batch = self._load(step)
        self._pending = (step + 1, self._pool.submit(self._load, step + 1)) if step < self._last else None
        return tuple(t.to(self._device, non_blocking=True) for t in batch)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
