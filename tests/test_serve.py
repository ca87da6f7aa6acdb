"""Parallel generation (`fivefold.parallel.serve`) against the single-process model.

Four sources: a dense run directory with tied embeddings and a MoE run directory (DCP checkpoints
written by one process, resharded on load), an HF Llama and an HF Mixtral directory (tiny random
configs, saved locally). Every layout must produce exactly the greedy tokens of each prompt run
alone in one process; the prompts have different lengths, so padding is exercised everywhere.
Expert-parallel layouts (the two MoE sources) also stop replicas at different steps, so that one
replica serves its experts to the other after its own prompts are done.
One spawn per world size runs all layouts and sources.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from fivefold.cli import main
from fivefold.config import RunConfig, TrainSpec, load_model
from fivefold.model import build_model, materialize
from fivefold.model.generate import ModelStep, Sampler, decode, generate
from fivefold.parallel.serve import ModelSource, ServeJob, collect, serve_rank

PROMPTS = ((3, 1, 4, 1, 5), (9, 2), (7, 7, 7, 2))
NEW = 6


def _run_dir(path: Path, preset: str, **changes) -> Path:
    """A run directory as training writes it; weights scaled up so next tokens win by clear margins."""
    from fivefold.train.checkpoint import save_checkpoint

    spec = dataclasses.replace(load_model(preset), **changes)
    model = materialize(build_model(spec), "cpu", 5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    path.mkdir(parents=True)
    (path / "config.toml").write_text(RunConfig(model=spec, train=TrainSpec()).to_toml())
    save_checkpoint(path, 3, [model], [torch.optim.SGD(model.parameters(), lr=0.1)], {})
    return path


def _hf_dir(path: Path, kind: str) -> Path:
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    if kind == "llama":
        config = transformers.LlamaConfig(**common, intermediate_size=64)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _single_process(source: ModelSource):
    from fivefold.commands.generate import load_run
    from fivefold.model.hf import load_hf

    if source.kind == "run":
        return load_run(Path(source.path))[1]
    return load_hf(source.path)[1]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[ModelSource, list[list[int]]]]:
    """name -> (source, the greedy tokens of each prompt run alone in one process)."""
    root = tmp_path_factory.mktemp("serve")
    made = {
        "dense": ModelSource("run", str(_run_dir(root / "dense", "tiny", tie_embeddings=True))),
        "moe": ModelSource("run", str(_run_dir(root / "moe", "tiny-moe"))),
        "llama": ModelSource("hf", str(_hf_dir(root / "llama", "llama"))),
        "mixtral": ModelSource("hf", str(_hf_dir(root / "mixtral", "mixtral"))),
    }
    out = {}
    for name, source in made.items():
        model = _single_process(source)
        alone = [generate(model, torch.tensor([p]), NEW)[0].tolist() for p in PROMPTS]
        out[name] = (source, alone)
    return out


def test_mixed_length_batch_equals_each_prompt_alone(sources) -> None:
    for name, (source, alone) in sources.items():
        model = _single_process(source)
        got = decode(ModelStep(model, Sampler(), None), PROMPTS, NEW)
        assert got.tokens == alone, name
        assert got.first_token_s > 0 and len(got.step_s) == NEW - 1
    # per-prompt stop: an end id cuts one row, the others run on
    source, alone = sources["dense"]
    stop = alone[1][2]
    got = decode(ModelStep(_single_process(source), Sampler(), None), PROMPTS, NEW, eos_token_id=stop)
    for tokens, full in zip(got.tokens, alone):
        assert tokens == (full[: full.index(stop) + 1] if stop in full else full)
    # per-prompt limits
    got = decode(ModelStep(_single_process(source), Sampler(), None), PROMPTS, [2, NEW, 0])
    assert got.tokens == [alone[0][:2], alone[1], []]


def _plan_matches_ledger(res: dict) -> None:
    """Each rank's collectives in the prefill and per decoded token are the plan's
    (`plan.inference.decode_traffic`): to the byte, but for the expert all-to-alls, whose rows follow
    the router (the plan's are balanced)."""
    assert res["ledger"]
    for rank in res["kv_cache"]:  # the weights and KV cache each rank holds: the plan's, to the byte
        assert rank["weight_bytes"] == rank["planned_weight_bytes"], rank
        assert rank["bytes"] == rank["planned_bytes"], rank
    for rank in res["ledger"]:
        for when in ("prefill", "per_token"):
            measured = {(r["axis"], r["op"]): (r["count"], r["bytes"]) for r in rank[when]}
            planned = {(r["axis"], r["op"]): (r["count"], r["bytes"]) for r in rank[f"planned_{when}"]}
            assert set(measured) == set(planned), (when, rank)
            for key, (count, size) in planned.items():
                got = measured[key]
                assert got[0] == count, (when, rank["rank"], key, got, count)
                if key != ("ep", "all_to_all"):
                    assert got[1] == size, (when, rank["rank"], key, got, size)
                else:
                    assert 0.5 * size < got[1] < 1.5 * size, (when, rank["rank"], got, size)


def _job(source: ModelSource, tp: int = 1, pp: int = 1, dp: int = 1, **kw) -> ServeJob:
    limits = kw.pop("max_new_tokens", NEW)
    kw.setdefault("ledger", True)  # every layout's traffic is checked against the plan
    return ServeJob(source, PROMPTS, limits, kw.pop("sampler", Sampler()), tp=tp, pp=pp, dp=dp, **kw)


def _body(rank: int, world: int, jobs: list[ServeJob]) -> list:
    return [serve_rank(rank, world, job) for job in jobs]


def _serve_all(world: int, jobs: list[ServeJob]) -> list[dict]:
    per_rank = run_distributed(_body, world, jobs, timeout=300)
    return [collect(job, [ranks[i] for ranks in per_rank]) for i, job in enumerate(jobs)]


MOE = ("moe", "mixtral")


def _layouts(sources, layouts: list[dict]) -> list[tuple[dict, str]]:
    """Each layout with each source it can serve (ep only the mixture-of-experts ones)."""
    return [(lay, n) for lay in layouts for n in sources if lay.get("ep", 1) == 1 or n in MOE]


def test_layouts_on_two_ranks(sources) -> None:
    cases = _layouts(sources, [dict(tp=2), dict(pp=2), dict(dp=2), dict(dp=2, ep=2), dict(cp=2)])
    jobs = [_job(sources[n][0], **lay) for lay, n in cases]
    dense, moe = sources["dense"][0], sources["moe"][0]
    sampling = Sampler(greedy=False, temperature=1.5, top_k=20, seed=11)
    # experts split over replicas whose prompts stop at different steps: replica 1 (prompt 1) is done
    # after one token and keeps serving its experts to replica 0, by a limit and by an end id
    stop = sources["moe"][1][0][2]
    jobs += [
        _job(moe, dp=2, ep=2, max_new_tokens=(NEW, 1, NEW), ledger=True),
        _job(moe, dp=2, ep=2, eos_ids=(stop,)),
        _job(moe, dp=2, ep=2, sampler=sampling),
        _job(dense, cp=2, ledger=True),
        _job(dense, cp=2, sampler=sampling),
        _job(dense, tp=2, ledger=True),
        _job(dense, pp=2, ledger=True),
        _job(dense, tp=2, sampler=sampling),
        _job(dense, dp=2, sampler=sampling),
    ]
    results = _serve_all(2, jobs)
    for (lay, name), res in zip(cases, results):
        assert [row["tokens"] for row in res["prompts"]] == sources[name][1], (lay, name)
        assert all(row["time_to_first_token_s"] > 0 and row["tokens_per_s"] > 0 for row in res["prompts"])
        _plan_matches_ledger(res)

    alone = sources["moe"][1]
    limited, ended, sampled, cp_ledger, cp_sampled = results[len(cases) : len(cases) + 5]
    assert [row["tokens"] for row in limited["prompts"]] == [alone[0], alone[1][:1], alone[2]]
    assert [row["tokens"] for row in ended["prompts"]] == [
        t[: t.index(stop) + 1] if stop in t else t for t in alone
    ]
    # per decoded token each rank runs every MoE layer's three all-to-alls (counts, rows, results
    # back) and one flag, also the replica that is done (its steps kept apart: it decodes no token)
    moe_layers = load_model("tiny-moe").layers
    done = [rank for rank in limited["ledger"] if "idle_per_step" in rank]
    assert len(done) == 1 and not done[0]["per_token"]  # replica 1 decoded its one token at prefill
    for rank in limited["ledger"]:
        ops = {(r["axis"], r["op"]): r for r in rank["per_token"] or rank["idle_per_step"]}
        assert ops[("ep", "all_to_all")]["count"] == 3 * moe_layers, rank
        assert ops[("ep", "all_reduce")]["count"] == 1 and ops[("ep", "all_reduce")]["bytes"] == 8
        assert {axis for axis, _ in ops} == {"ep"}
    model = _single_process(moe)
    expected = decode(ModelStep(model, sampling, sampling.generators(range(3))), PROMPTS, NEW).tokens
    assert [row["tokens"] for row in sampled["prompts"]] == expected
    # cp: the prefill gathers K and V per layer; a decoded token all-gathers each layer's partial
    # outputs and log-sum-exp (fp32, 4 heads × (8 + 1) per prompt, from each of the 2 ranks) and cp
    # rank 0 broadcasts it
    layers = load_model("tiny").layers
    for rank in cp_ledger["ledger"]:
        prefill = {(r["axis"], r["op"]): r for r in rank["prefill"]}
        assert prefill[("cp", "all_gather")]["count"] == 2 * layers
        ops = {(r["axis"], r["op"]): r for r in rank["per_token"]}
        assert ops[("cp", "all_gather")]["count"] == layers
        assert ops[("cp", "all_gather")]["bytes"] == layers * 2 * len(PROMPTS) * 4 * 9 * 4
        assert ops[("cp", "broadcast")]["count"] == 1
    # the widened prompt (5 columns + 3 masked) is split evenly, the 5 later columns kept in turn
    kv = [2 * layers * 2 * 8 * len(PROMPTS) * columns * 4 for columns in (4 + 3, 4 + 2)]
    assert [r["bytes"] for r in cp_ledger["kv_cache"]] == kv

    layers = load_model("tiny").layers
    tp_ledger, pp_ledger = results[-4]["ledger"], results[-3]["ledger"]
    for rank in tp_ledger:  # per token: o_proj and down_proj per layer + the vocab-parallel embedding
        ops = {(r["axis"], r["op"]): r for r in rank["per_token"]}
        assert ops[("tp", "all_reduce")]["count"] == 2 * layers + 1
        assert ops[("tp", "all_reduce")]["bytes"] == (2 * layers + 1) * len(PROMPTS) * 32 * 4
    first = {(r["axis"], r["op"]): r for r in pp_ledger[0]["per_token"]}
    assert first[("pp", "send")]["count"] == 1 and first[("pp", "send")]["bytes"] == len(PROMPTS) * 32 * 4
    last = {(r["axis"], r["op"]): r for r in pp_ledger[1]["per_token"]}
    assert last[("pp", "recv")]["count"] == 1

    # sampling: the single process's draws, whatever the layout (one generator per prompt)
    model = _single_process(dense)
    expected = decode(ModelStep(model, sampling, sampling.generators(range(3))), PROMPTS, NEW).tokens
    assert expected != sources["dense"][1]
    for res in results[-2:]:
        assert [row["tokens"] for row in res["prompts"]] == expected


def test_layouts_on_four_ranks(sources) -> None:
    # tp 4 > the 2 KV heads of every source; ep with tp (each tp rank dispatches to its own peers)
    # and with pp (each stage's experts split over the two replicas' same stage)
    layouts = [dict(tp=4), dict(tp=2, pp=2), dict(dp=2, ep=2, tp=2), dict(dp=2, ep=2, pp=2)]
    # cp over more ranks than some rows have real columns, and with each other axis
    layouts += [dict(cp=4), dict(cp=2, tp=2), dict(cp=2, pp=2), dict(cp=2, dp=2)]
    # ep over the cp ranks of each replica, and over both replicas' cp ranks
    layouts += [dict(dp=2, cp=2, ep=2), dict(dp=2, cp=2, ep=4)]
    cases = _layouts(sources, layouts)
    jobs = [_job(sources[n][0], **lay) for lay, n in cases]
    results = _serve_all(4, jobs)
    for (lay, name), res in zip(cases, results):
        assert [row["tokens"] for row in res["prompts"]] == sources[name][1], (lay, name)
        _plan_matches_ledger(res)
    # the KV cache: tp 4 keeps the one KV head each rank's query heads read (replicated twice),
    # tp 2 × pp 2 one head per rank and half the layers
    whole = 2 * 4 * 2 * 8 * len(PROMPTS) * (5 + NEW - 1) * 4  # K,V · layers · KV heads · head_dim · b · t · 4
    assert [(r["heads"], r["bytes"]) for r in results[0]["kv_cache"]] == [(1, whole // 2)] * 4
    assert [(r["heads"], r["bytes"]) for r in results[4]["kv_cache"]] == [(1, whole // 4)] * 4


def test_cli_bad_input(sources, capsys, tmp_path) -> None:
    dense = sources["dense"][0].path
    # a NaN in the last row of one k projection: only the second tp rank's shard holds it, and the
    # first must not wait for it in a collective
    damaged = _run_dir(tmp_path / "nan", "tiny")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = damaged / "checkpoints" / "step_3"
    dcp_to_torch_save(step, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    state["model"]["model.layers.1.self_attn.k_proj.weight"][-1, 0] = float("nan")
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(step))
    (step / "checksums.json").unlink()  # as saved with the NaN in it (a checkpoint before checksums)
    nan = "weight model.layers.1.self_attn.k_proj.weight holds NaN"
    cases = [
        (["--from", str(damaged), "--prompt-ids", "1"], nan),
        (["--from", str(damaged), "--prompt-ids", "1", "--nproc", "2", "--tp", "2"], nan),
        (["--model", "tiny", "--prompt-ids", ",".join(["1"] * 300)], "longer than the context"),
        (["--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "255"], "valid --max-new-tokens"),
        (["--model", "tiny", "--prompt-ids", "1,2", "--nproc", "3", "--tp", "3"], "valid tp"),
        (["--model", "tiny", "--prompt-ids", "1,2", "--nproc", "3", "--tp", "2"], "not a multiple"),
        (["--model", "tiny", "--prompt-ids", "1,2", "--nproc", "8", "--pp", "8"], "valid pp"),
        (["--model", "tiny", "--prompt-ids", "1", "--nproc", "2", "--dp", "2"], "every replica needs"),
        (["--model", "tiny", "--prompt-ids", "1", "--nproc", "2", "--ep", "2"], "needs a mixture-of-experts"),
        (["--model", "tiny-moe", "--prompt-ids", "1", "--nproc", "2", "--tp", "2", "--ep", "2"], "--nproc 4"),
        (["--model", "tiny-moe", "--prompt-ids", "1", "--nproc", "3", "--ep", "3"], "valid ep: 1, 2, 4"),
        (
            ["--model", "tiny-moe", "--prompt-ids", "1", "--nproc", "2", "--ep", "4", "--cp", "2"],
            "ep: 1, 2, or --nproc 4",
        ),
        (["--model", "tiny", "--prompt-ids", "1", "--nproc", "3", "--cp", "2"], "tp×pp×cp = 1×1×2"),
        (["--from", dense, "--prompt-ids", "1", "--nproc", "2", "--checkpoint", "9"], "available steps"),
        (["--from", str(tmp_path / "absent"), "--prompt-ids", "1", "--nproc", "2"], "no such directory"),
    ]
    for argv, message in cases:
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_cli_json_and_stream(sources, capsys) -> None:
    argv = ["generate", "--from", sources["dense"][0].path, "--max-new-tokens", str(NEW), "--greedy"]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["prompts"]
    assert [r["tokens"] for r in rows] == sources["dense"][1]
    assert all(r["decode_s_per_token"] > 0 and r["time_to_first_token_s"] > 0 for r in rows)
    assert main([*argv[:3], "--max-new-tokens", "1,2,3", *argv[5:], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["prompts"]
    assert [r["tokens"] for r in rows] == [t[:n] for t, n in zip(sources["dense"][1], (1, 2, 3))]
    assert main([*argv, "--stream", "--ids"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == len(PROMPTS) * NEW
    # --ids streams the ids themselves, not their text
    assert all(line.split(" ", 1)[1].strip("'").strip().isdigit() for line in lines), lines[:3]


def test_cli_on_two_ranks_equals_one_process(capsys) -> None:
    """The launched path: `--nproc 2 --tp 2` from a preset's seeded init, with the ledger's table."""
    argv = ["generate", "--model", "tiny", "--init-seed", "4", "--prompt-ids", "5,6,7", "--prompt-ids", "8",
            "--max-new-tokens", "5", "--greedy"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["prompts"]
    assert main([*argv, "--json", "--nproc", "2", "--tp", "2", "--comm"]) == 0
    served = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in served["prompts"]] == [r["tokens"] for r in alone]
    assert [r["heads"] for r in served["kv_cache"]] == [1, 1]  # the 2 KV heads of tiny, split
    ranks = served["communication"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(
        any(row["axis"] == "tp" and row["op"] == "all_reduce" for row in r["per_token"]) for r in ranks
    )


def test_cli_verify_judges_tokens_traffic_and_cache(capsys) -> None:
    """`generate --verify`: the served tokens against one process, each rank's collectives and KV cache
    against the plan; a difference in any of them fails the verdict (exit 1)."""
    from fivefold.commands.verify import judge_serving

    argv = ["generate", "--model", "tiny-moe", "--prompt-ids", "5,6,7", "--prompt-ids", "8", "--greedy",
            "--max-new-tokens", "5,2", "--nproc", "2", "--cp", "2", "--verify", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["verify"]["rows"]
    assert out["verify"]["ok"] and {r["judgment"] for r in rows} == {"numerics", "comm", "memory"}
    assert any(r["name"].startswith("cp all_gather per token") for r in rows)
    served = {"prompts": out["prompts"], "ledger": out["communication"], "kv_cache": out["kv_cache"]}
    alone = [r["tokens"] for r in out["prompts"]]
    assert all(r.ok is not False for r in judge_serving(served, alone))
    other = [alone[0], alone[1][:-1] + [alone[1][-1] + 1]]
    assert [r.ok for r in judge_serving(served, other) if r.judgment == "numerics"] == [False]
    # 16-bit weights: a near-tie may flip, so the tokens are shown, not judged
    assert [r.ok for r in judge_serving(served, other, exact=False) if r.judgment == "numerics"] == [None]
    served["ledger"][1]["planned_per_token"][0]["count"] += 1
    assert any("rank" in r.name and r.ok is False for r in judge_serving(served, alone))
    served["kv_cache"][0]["planned_bytes"] += 4
    assert [r.ok for r in judge_serving(served, alone) if r.judgment == "memory"] == [True, False]
    served["kv_cache"][1]["planned_weight_bytes"] -= 4
    assert [r.ok for r in judge_serving(served, alone) if r.judgment == "memory"] == [False, False]
    assert main(["generate", "--model", "tiny", "--prompt-ids", "5", "--verify"]) == 2
    assert "--nproc 2 or more" in capsys.readouterr().err
