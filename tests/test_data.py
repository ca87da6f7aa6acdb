"""Corpus loading, tokenizers, held-out split and deterministic, rank-splittable batches."""

from __future__ import annotations

import json
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.errors import FivefoldError
from fivefold.train.data import (
    batch_rows,
    load_data,
    read_bin,
    sample_batch,
    stdlib_documents,
    write_bin,
)
from fivefold.train.tokenizer import ByteTokenizer, load_tokenizer

BYTES = ByteTokenizer()


@pytest.fixture(scope="module")
def stdlib_docs():
    return stdlib_documents()


def test_stdlib_corpus_is_the_interpreters_sources_in_sorted_order(stdlib_docs):
    names = [name for name, _ in stdlib_docs]
    assert names == sorted(names)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert "os.py" in names and "json/__init__.py" in names
    assert dict(stdlib_docs)["os.py"] == (root / "os.py").read_bytes()
    assert not any("site-packages" in n for n in names)
    assert sum(len(d) for _, d in stdlib_docs) > 1_000_000


def test_stdlib_split_holds_out_whole_documents(stdlib_docs):
    data = load_data("stdlib", BYTES, seq_len=64)
    # independent reference: the documents whose path hashes into the lowest 2%
    held = [d for n, d in stdlib_docs if zlib.crc32(n.encode()) % 1000 < 20]
    assert bytes(data.held_out) == b"".join(held)
    assert len(data.train) + len(data.held_out) == sum(len(d) for _, d in stdlib_docs)
    assert 0.005 < len(data.held_out) / len(data.train) < 0.05
    assert data.train.dtype == np.uint8  # bytes fit one byte each


def test_byte_tokenizer_round_trips_unicode():
    text = "def f(x):\n    return 'héllo → ∑'\n"
    assert BYTES.decode(BYTES.encode(text)) == text
    assert max(BYTES.encode(text)) < 256


def test_union_of_rank_shares_is_the_single_process_batch():
    tokens = np.arange(10_000, dtype=np.uint16)
    x1, y1 = sample_batch(tokens, 16, 8, seed=3, step=7)
    for ranks in (2, 4, 8):
        parts = [sample_batch(tokens, 16, 8, seed=3, step=7, rank=r, ranks=ranks) for r in range(ranks)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x1)
        assert torch.equal(torch.cat([p[1] for p in parts]), y1)


def test_batches_are_a_function_of_seed_and_step_and_labels_are_shifted():
    tokens = np.arange(50_000, dtype=np.uint32)
    x, y = sample_batch(tokens, 32, 4, seed=0, step=1)
    assert x.dtype == torch.int64 and x.shape == (4, 32)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(sample_batch(tokens, 32, 4, seed=0, step=1)[0], x)
    assert not torch.equal(sample_batch(tokens, 32, 4, seed=0, step=2)[0], x)
    assert not torch.equal(sample_batch(tokens, 32, 4, seed=1, step=1)[0], x)
    assert not torch.equal(sample_batch(tokens, 32, 4, seed=0, step=1, stream=1)[0], x)


def test_uneven_rank_split_is_an_error():
    assert batch_rows(8, 1, 4) == slice(2, 4)
    with pytest.raises(FivefoldError, match="split evenly"):
        batch_rows(6, 0, 4)


def test_text_file_folder_and_jsonl(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(400))
    (tmp_path / "one.txt").write_text(text)
    data = load_data(str(tmp_path / "one.txt"), BYTES, seq_len=32)
    assert bytes(np.concatenate([data.train, data.held_out])) == text.encode()

    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("B" * 3000)
    (folder / "sub" / "a.txt").write_text("A" * 3000)
    (folder / ".hidden").write_text("H" * 100)
    (folder / "blob.bin").write_bytes(b"\xff\xfe\x00" * 100)  # not UTF-8: skipped
    data = load_data(str(folder), BYTES, seq_len=32)
    stream = bytes(np.concatenate([data.train, data.held_out]))
    assert stream == b"B" * 3000 + b"A" * 3000  # sorted by path: b.txt < sub/a.txt

    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(50)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    data = load_data(str(tmp_path / "d.jsonl"), BYTES, seq_len=32)
    assert data.documents == 50


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(FivefoldError, match="not found"):
        load_data(str(tmp_path / "missing.txt"), BYTES, 32)
    (tmp_path / "x.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(FivefoldError, match="text"):
        load_data(str(tmp_path / "x.jsonl"), BYTES, 32)
    (tmp_path / "y.jsonl").write_text("{not json\n")
    with pytest.raises(FivefoldError, match="JSON"):
        load_data(str(tmp_path / "y.jsonl"), BYTES, 32)
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(FivefoldError, match="too few"):
        load_data(str(tmp_path / "small.txt"), BYTES, 32)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_pretokenized_bin_round_trip(tmp_path, dtype):
    ids = np.arange(5000) * 7 % 70_000 if dtype == "uint32" else np.arange(5000) % 1000
    path = write_bin(tmp_path / "tokens.bin", ids, dtype)
    assert np.array_equal(read_bin(path), ids)
    data = load_data(str(path), BYTES, seq_len=16)
    assert np.array_equal(np.concatenate([data.train, data.held_out]), ids)
    assert len(data.held_out) >= 17


def test_bin_without_sidecar_is_uint16_and_odd_sizes_are_rejected(tmp_path):
    raw = tmp_path / "raw.bin"
    np.arange(300, dtype=np.uint16).tofile(raw)
    assert np.array_equal(read_bin(raw), np.arange(300))
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00" * 7)
    with pytest.raises(FivefoldError, match="whole number"):
        read_bin(bad)


def test_hf_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["def add(a, b): return a + b", "class Point: pass"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))

    loaded = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json works too
    assert loaded.vocab_size == tok.get_vocab_size()
    assert loaded.eos_id == tok.token_to_id("</s>")
    ids = loaded.encode("def add(a, b)")
    assert ids == tok.encode("def add(a, b)").ids
    assert "add" in loaded.decode(ids)

    (tmp_path / "code.txt").write_text("\n".join(corpus))
    data = load_data(str(tmp_path / "code.txt"), loaded, seq_len=8)
    assert data.max_token < loaded.vocab_size
    with pytest.raises(FivefoldError, match="tokenizer not found"):
        load_tokenizer(str(tmp_path / "nope.json"))
