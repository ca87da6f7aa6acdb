"""Tokenizers: raw UTF-8 bytes by default, or an HF `tokenizer.json` through `tokenizers`.

Both expose the same small surface the data pipeline and `generate` need: `vocab_size`,
`encode(text) -> list[int]`, `decode(ids) -> str` and an optional end-of-document id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from fivefold.errors import FivefoldError

# end-of-document tokens of common HF tokenizers, most specific first
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token = one byte of the UTF-8 encoding: 256 ids, nothing to download, nothing unknown."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        # bytes that are no UTF-8 (a shell's raw argument, read as surrogates) are the bytes given
        return list(text.encode("utf-8", errors="surrogateescape"))

    def encode_bytes(self, data: bytes) -> bytes:
        return data

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (any HF fast tokenizer) loaded with the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise FivefoldError(
                "an HF tokenizer needs the `tokenizers` package: pip install 'fivefold[hf]'"
            ) from None
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions on bad JSON
            raise FivefoldError(f"cannot read tokenizer {path}: {exc}") from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for n in _EOS_NAMES if (i := self._tok.token_to_id(n)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(name_or_path: str) -> ByteTokenizer | HFTokenizer:
    """`bytes`, a `tokenizer.json` file, or a directory holding one (an HF checkpoint)."""
    if name_or_path in ("bytes", "byte", ""):
        return ByteTokenizer()
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FivefoldError(f"tokenizer not found: {path} (use 'bytes' or a path to a tokenizer.json)")
    return HFTokenizer(path)
