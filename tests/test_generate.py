"""Generation: the KV-cached decoder against full recomputation, sampling options, and the CLI
on a fivefold run directory (DCP checkpoint) and on an HF checkpoint directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fivefold.cli import main
from fivefold.config import RunConfig, TrainSpec, load_model
from fivefold.model import build_model, materialize
from fivefold.model.generate import generate


def _model(preset: str, seed: int = 0, **changes):
    spec = dataclasses.replace(load_model(preset), **changes)
    model = materialize(build_model(spec), "cpu", seed)
    # larger weights than the training init, so the next token is decided by clear margins
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return spec, model.eval()


@torch.no_grad()
def _greedy_by_recompute(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference: re-run the whole sequence for every new token, no cache."""
    seq = prompt
    for _ in range(steps):
        seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return seq[:, prompt.shape[1] :]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_cached_greedy_equals_recompute(preset: str) -> None:
    _, model = _model(preset)
    prompt = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate(model, prompt, 10), _greedy_by_recompute(model, prompt, 10))


def test_sampling_options() -> None:
    _, model = _model("tiny")
    prompt = torch.tensor([[10, 20, 30]])

    def sample(seed: int, **kw) -> torch.Tensor:
        return generate(model, prompt, 12, greedy=False, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1, temperature=2.0), sample(2, temperature=2.0))
    assert torch.equal(sample(5, top_k=1), generate(model, prompt, 12))  # top-1 is greedy
    # top-k: every sampled token is among the k most likely after its prefix
    out = sample(7, top_k=3, temperature=5.0)
    seq = torch.cat((prompt, out), dim=1)
    with torch.no_grad():
        top3 = model(seq[:, :-1])[0, prompt.shape[1] - 1 :].topk(3).indices
    assert all(tok in row for tok, row in zip(out[0].tolist(), top3.tolist()))


def test_a_temperature_too_small_for_the_dtype_is_greedy() -> None:
    from fivefold.model.generate import _pick

    logits = torch.tensor([[0.5, 3.0, -1.0], [2.0, 1.0, 0.0]])
    for temperature in (1e-320, 1e-45, 1e-30):  # 0 in fp32, a subnormal, a tiny normal
        picked = _pick(logits, False, temperature, 0, torch.Generator().manual_seed(0))
        assert picked.tolist() == [1, 0], temperature


def test_stops_at_end_of_sequence() -> None:
    _, model = _model("tiny")
    prompt = torch.tensor([[5, 6, 7]])
    free = generate(model, prompt, 12)[0].tolist()
    stop = free[4]
    cut = generate(model, prompt, 12, eos_token_id=[stop, 255])[0].tolist()
    assert cut == free[: free.index(stop) + 1]


def _write_run(run_dir: Path, preset: str, **changes) -> torch.nn.Module:
    """A run directory as training writes it: config.toml + a DCP checkpoint of model and optimizer."""
    from fivefold.train.checkpoint import save_checkpoint

    spec, model = _model(preset, seed=3, **changes)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    optimizer.step()
    for moe in (m for m in model.modules() if hasattr(m, "update_bias")):
        moe.gate.expert_bias.copy_(torch.randn(spec.experts))  # a trained selection bias is kept too
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(RunConfig(model=spec, train=TrainSpec()).to_toml())
    save_checkpoint(run_dir, 7, [model], [optimizer], {})
    return model.eval()


@pytest.mark.parametrize(
    "preset,changes",
    [("tiny", {"tie_embeddings": True}), ("tiny-moe", {"router_bias_rate": 0.01})],
)
def test_run_directory_loads_the_checkpointed_weights(tmp_path, preset, changes) -> None:
    from fivefold.commands.generate import load_run

    trained = _write_run(tmp_path, preset, **changes)
    _, loaded = load_run(tmp_path)
    expected = trained.state_dict()
    assert set(loaded.state_dict()) == set(expected)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    if loaded.spec.tie_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_cli_on_a_run_directory(tmp_path, capsys) -> None:
    trained = _write_run(tmp_path, "tiny")
    prompt = torch.tensor([[104, 101, 108, 108, 111]])  # "hello" as bytes
    expected = _greedy_by_recompute(trained, prompt, 9)[0].tolist()
    argv = ["generate", "--from", str(tmp_path), "--max-new-tokens", "9", "--greedy", "--ids"]
    assert main(argv + ["--prompt-ids", "104,101,108,108,111"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected))
    assert main(argv + ["--prompt", "hello"]) == 0  # byte tokenizer: the same ids
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected))
    assert main(argv[:-1] + ["--prompt", "hello"]) == 0  # text: prompt + continuation, decoded
    text = capsys.readouterr().out
    assert text.startswith("hello") and text.rstrip("\n") == bytes([*prompt[0], *expected]).decode(
        "utf-8", errors="replace"
    )


def test_cli_on_an_hf_directory_matches_transformers(tmp_path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    words = {f"w{i}": i for i in range(64)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))

    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    expected = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0
    )[0, 5:].tolist()
    argv = ["generate", "--from", str(tmp_path), "--max-new-tokens", "8", "--greedy"]
    assert main(argv + ["--prompt-ids", "3,1,4,1,5", "--ids"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected))
    assert main(argv + ["--prompt", "w3 w1 w4 w1 w5"]) == 0
    assert capsys.readouterr().out.split() == [f"w{i}" for i in [3, 1, 4, 1, 5, *expected]]


def test_cli_bad_input(tmp_path, capsys) -> None:
    _write_run(tmp_path / "run", "tiny")
    run = str(tmp_path / "run")
    cases = [
        (["--from", str(tmp_path / "absent"), "--prompt", "x"], "no such directory"),
        (["--from", str(tmp_path), "--prompt", "x"], "neither an HF checkpoint"),
        (["--from", run, "--prompt-ids", "1,x"], "comma-separated integers"),
        (["--from", run, "--prompt-ids", "1,300"], "outside the model's vocabulary"),
        (["--from", run, "--prompt", "x", "--checkpoint", "9"], "available steps: 7"),
        (["--from", run, "--prompt", "x", "--max-new-tokens", "-1"], "max-new-tokens"),
    ]
    for argv, message in cases:
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    (tmp_path / "run" / "checkpoints" / "step_7" / ".metadata").write_bytes(b"garbage")
    assert main(["generate", "--from", run, "--prompt", "x"]) == 2
    assert "unreadable" in capsys.readouterr().err
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert main(["generate", "--from", str(hf_dir), "--prompt", "x"]) == 2
    assert "unsupported HF architecture" in capsys.readouterr().err


def test_a_checkpoint_in_the_earlier_qk_layout_is_refused(tmp_path, capsys) -> None:
    """Weights saved before q/k rows were ordered for adjacent rotary pairs would be misread: every
    way in (generate, resume) refuses them with one message."""
    from fivefold.errors import FivefoldError
    from fivefold.train.checkpoint import find_checkpoint, load_checkpoint

    _write_run(tmp_path, "tiny")
    step = tmp_path / "checkpoints" / "step_7"
    meta = json.loads((step / "trainer.json").read_text())
    assert meta["qk_rotary_pairs"] == "adjacent"
    del meta["qk_rotary_pairs"]
    (step / "trainer.json").write_text(json.dumps(meta))
    for load in (lambda: find_checkpoint(tmp_path), lambda: load_checkpoint(step, [], [])):
        with pytest.raises(FivefoldError, match="earlier fivefold"):
            load()
    assert main(["generate", "--from", str(tmp_path), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "earlier fivefold" in err and "Traceback" not in err
    meta["qk_rotary_pairs"] = 5  # a value no version wrote: said as such, not blamed on an old one
    (step / "trainer.json").write_text(json.dumps(meta))
    with pytest.raises(FivefoldError, match="is 5, which no fivefold writes"):
        load_checkpoint(step, [], [])


def test_a_comm_table_of_replicas_alone_says_they_do_not_talk() -> None:
    """generate --dp 2 --comm: replicas never talk, and a header over no rows read as a lost ledger."""
    from fivefold.commands.generate import comm_table

    assert comm_table([{"rank": 0, "prefill": [], "per_token": []}]).startswith("no communication")
    row = {"axis": "tp", "op": "all_reduce", "count": 2, "bytes": 64}
    assert "all_reduce" in comm_table([{"rank": 0, "prefill": [row], "planned_prefill": [row]}])


def test_the_stream_reads_as_the_final_text_and_any_seed_decodes(capsys) -> None:
    """A byte tokenizer's character can span tokens: the stream holds it back until whole, so it prints
    what the plain output prints after the prompt. Every --seed the command takes seeds a generator
    (the per-prompt seed had overflowed torch's 64 bits above about 1.8e13)."""
    from fivefold.cli import main

    base = ["generate", "--model", "tiny", "--prompt", "hello", "--max-new-tokens", "12", "--greedy"]
    assert main(base) == 0
    whole = capsys.readouterr().out.rstrip("\n")
    assert main([*base, "--stream"]) == 0
    streamed = capsys.readouterr().out.rstrip("\n")
    assert whole == "hello" + streamed
    for seed in ("20000000000000", str(2**63 - 1)):
        argv = ["generate", "--model", "tiny", "--prompt-ids", "5", "--max-new-tokens", "3", "--ids"]
        assert main([*argv, "--seed", seed]) == 0
        assert len(capsys.readouterr().out.strip().split(",")) == 3
