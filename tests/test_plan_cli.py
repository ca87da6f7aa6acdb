"""`fivefold plan`: the JSON contract, human output, bad input, and no torch import."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config import Layout, load_hardware, load_model
from fivefold.plan import TrainShape, plan

BASE = [
    "plan",
    "--model",
    "llama3-70b",
    "--hardware",
    "h100-80gb",
    "--gpus",
    "64",
    "--seq-len",
    "4096",
    "--global-batch",
    "64",
    "--micro-batch",
    "1",
]


def run_cli(capsys, *extra: str) -> tuple[int, str, str]:
    code = main([*BASE, *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_contract(capsys) -> None:
    code, out, _ = run_cli(capsys, "--tp", "8", "--pp", "2", "--sp", "--recompute", "selective", "--json")
    assert code == 0
    data = json.loads(out)  # one object, nothing else on stdout
    for key in ("params", "grads", "optimizer", "activations", "buffers", "total"):
        assert isinstance(data["memory"][key], int)
    m = data["memory"]
    # a pipeline holds gradients beside activations: the total is every part
    assert m["grads_apart"] is False
    assert m["total"] == pytest.approx(
        sum(m[k] for k in ("params", "grads", "optimizer", "activations", "buffers")), abs=8
    )
    for key in (
        "fits",
        "compute_time_s",
        "bubble_fraction",
        "step_time_s",
        "tokens_per_s",
        "tflops_per_gpu",
        "mfu",
        "hardware_tflops_per_gpu",
        "hfu",
    ):
        assert key in data
    assert data["layout"]["dp"] == 4  # filled from the world size
    axes = {c["axis"] for c in data["comm"]}
    assert {"tp", "pp", "dp"} <= axes
    for c in data["comm"]:
        assert set(c) >= {"axis", "op", "bytes", "wire_bytes", "time_s", "link"}
        assert c["link"] in ("intra", "inter", "mixed")
    assert data["tokens_per_s"] == pytest.approx(64 * 4096 / data["step_time_s"])
    assert data["hfu"] > data["mfu"]


def test_human_output_has_tables_and_bar_chart(capsys) -> None:
    code, out, _ = run_cli(capsys, "--tp", "8", "--fsdp", "8")
    assert code == 0
    assert "memory per GPU" in out and "█" in out and "communication per step" in out and "MFU" in out


def test_a_cpu_plan_is_of_what_train_runs_there_in_units_that_read(capsys) -> None:
    """On the cpu preset the plan takes train's fp32 unless told; a 54K-parameter model's memory and
    traffic read in kB/MB, not as columns of 0.00 GB."""
    base = ["plan", "--model", "tiny", "--hardware", "cpu", "--gpus", "2", "--dp", "2", "--seq-len", "128"]
    base += ["--global-batch", "16"]
    assert main([*base, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory"]["params"] == 4 * data["params"]
    # in bf16 train's DDP runs autocast over the same fp32 weights: their bf16 copies are saved
    # activations when eager, a buffer beside the compiled kernels' count
    assert main([*base, "--json", "--dtype", "bf16"]) == 0
    eager = json.loads(capsys.readouterr().out)["memory"]
    assert eager["params"] == 4 * data["params"] and eager["detail"]["weight_copies"] == 0
    assert main([*base, "--json", "--dtype", "bf16", "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)["memory"]
    assert (
        compiled["params"] == 4 * data["params"] and compiled["detail"]["weight_copies"] == 2 * data["params"]
    )
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "53.54K params" in out and " MB " in out and "0.00 GB" not in out
    assert any(line.split()[:2] == ["dp", "all_reduce"] and "kB" in line for line in out.splitlines())


def test_a_pipelines_batch_split_reads_as_train_reads_it(capsys) -> None:
    """--microbatches alone splits a data rank's batch, as in train; a plan without it says the
    --microbatches that train needs to run its split (train's own default is 2 × pp)."""
    base = ["plan", "--model", "tiny", "--hardware", "cpu", "--gpus", "4", "--pp", "2", "--dp", "2"]
    base += ["--seq-len", "128", "--global-batch", "32"]
    assert main([*base, "--microbatches", "4"]) == 0
    assert "micro-batch 4, 4 micro-batches per step" in capsys.readouterr().out
    assert main([*base, "--micro-batch", "1"]) == 0
    hint = "fivefold train runs this batch split with --micro-batch 1 --microbatches 16"
    assert hint in capsys.readouterr().out
    assert main([*base, "--micro-batch", "4"]) == 0  # 4 micro-batches of 4: train's own default split
    assert "fivefold train runs" not in capsys.readouterr().out
    assert main([*base, "--microbatches", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "valid microbatches: 2, 4, 8, 16" in err[0]
    # with --micro-batch too, as train reads them: the data rank's 16 sequences in 8 micro-batches of
    # 2, and the --micro-batch of 1 only its unit of accumulation
    assert main([*base, "--micro-batch", "1", "--microbatches", "8"]) == 0
    assert "micro-batch 2, 8 micro-batches per step" in capsys.readouterr().out
    assert main([*base, "--micro-batch", "3", "--microbatches", "8"]) == 2  # 32 over 3 × 2 data ranks
    assert "must be a multiple of micro_batch × data-parallel ranks" in capsys.readouterr().err
    # without a pipeline --microbatches does nothing, in train as here
    flat = ["plan", "--model", "tiny", "--hardware", "cpu", "--gpus", "2", "--seq-len", "32"]
    assert main([*flat, "--micro-batch", "2", "--global-batch", "32", "--microbatches", "6"]) == 0
    assert (
        "note: --microbatches splits a pipeline's batch into micro-batches; pp is 1 here"
        in capsys.readouterr().err
    )


def test_a_merged_axis_keeps_the_communication_table_in_columns(capsys) -> None:
    """fsdp and cp share their gradient collectives (axis fsdp_cp): the axis column widens to hold it."""
    code, out, _ = run_cli(capsys, "--fsdp", "4", "--cp", "2", "--gpus", "8")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("fsdp_cp")]
    assert rows and all(row[1] in ("all_gather", "reduce_scatter") for row in rows)


def test_search_and_inference_modes(capsys) -> None:
    code, out, _ = run_cli(capsys, "--search", "--top", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["plans"]) == 2 and data["search"]["explanation"]
    code = main(
        [
            "plan",
            "--model",
            "llama3-70b",
            "--hardware",
            "h100-80gb",
            "--gpus",
            "16",
            "--tp",
            "8",
            "--mode",
            "inference",
            "--batch",
            "8",
            "--context",
            "8192",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["memory"]["kv_cache"] > 0
    assert data["decode_time_per_token_s"] < data["prefill_time_s"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--tp", "8", "--pp", "3", "--dp", "2"], "must equal the world size"),
        (["--tp", "8", "--global-batch", "12"], "must be a multiple of micro_batch"),
        (["--hardware", "tpu-v9"], "unknown hardware"),
        (["--model", "nope"], "unknown model"),
        # llama3-70b's 80 layers over 2 stages: 2 to 40 chunks a rank; tiny's 4 over 4: none
        (["--tp", "8", "--pp", "2", "--pp-schedule", "interleaved-1f1b"], "for pp 2 over 80 layers: 2, 3, 4"),
        (
            ["--model", "tiny", "--pp", "4", "--pp-schedule", "interleaved-1f1b", "--seq-len", "64"],
            "use --pp-sc",
        ),
        (["--tp", "8", "--recompute-layers", "2"], "add --recompute full"),
        (["--tp", "8", "--recompute", "full", "--recompute-layers", "-1"], "count of blocks >= 0"),
        (["--search", "--recompute", "selective", "--recompute-layers", "2"], "add --recompute full"),
        (["--search", "--recompute-layers", "2"], "add --recompute full"),
        # what the search chooses itself is refused under it, not dropped in silence
        (["--search", "--pp", "2", "--pp-split", "1,1"], "--pp-split is not kept by --search"),
        (["--search", "--microbatches", "1000000"], "--microbatches is not kept by --search"),
        (["--search", "--order", "pp,pp"], "pp given twice"),
        (["--order", ",,,"], "--order lists axes"),
        # a search whose inputs leave no layout to size says why, and exits 2
        (["--search", "--global-batch", "1", "--micro-batch", "2"], "splits --global-batch 1 into micro"),
        # a search keeps the degrees it is given: they must be degrees, and fit the 64 GPUs
        (["--search", "--tp", "0"], "--tp must be a positive integer"),
        (["--search", "--tp", "128"], "valid tp: 1, 2, 4, 8, 16, 32, 64"),
        (["--search", "--tp", "8", "--pp", "16"], "kept: --tp 1, 2, 4; --pp 1, 2, 4, 8"),
        (["--search", "--ep", "3"], "valid ep: 1, 2, 4"),
        (["--mode", "inference", "--context", "4096", "--search", "--tp", "3"], "valid tp: 1, 2"),
    ],
)
def test_bad_input_exits_2_with_a_hint(capsys, extra: list[str], needle: str) -> None:
    code, out, err = run_cli(capsys, *extra)
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err


def test_model_and_hardware_toml_files(capsys, tmp_path) -> None:
    model = tmp_path / "m.toml"
    model.write_text(
        "layers = 24\nhidden = 2304\nffn_hidden = 9216\nheads = 24\nkv_heads = 24\nvocab = 51200\n"
    )
    hw = tmp_path / "hw.toml"
    hw.write_text(
        "gpu_memory_gb = 80\npeak_tflops = 312\ngpus_per_node = 8\nintra_node_gbps = 300\n"
        "inter_node_gbps = 25\n"
    )
    args = [
        "plan",
        "--model",
        str(model),
        "--hardware",
        str(hw),
        "--gpus",
        "32",
        "--seq-len",
        "2048",
        "--global-batch",
        "512",
        "--micro-batch",
        "16",
        "--recompute",
        "full",
        "--json",
    ]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["block"] == "gpt" and 1.6e9 < data["params"] < 1.8e9  # Megatron's "1.7B"
    # fivefold's own runtime would build SwiGLU blocks of this file: the plan says so, where the
    # block was guessed and the runtime is fivefold's, and nowhere else
    said = "fivefold train builds SwiGLU blocks of it"
    assert any(said in note for note in data["notes"])
    for other in (["--block", "gpt"], ["--trainer", "megatron"]):
        assert main([*args, *other]) == 0
        assert not any(said in note for note in json.loads(capsys.readouterr().out)["notes"])
    assert main([*args, "--block", "llama"]) == 0
    llama = json.loads(capsys.readouterr().out)
    assert llama["block"] == "llama" and llama["params"] > 1.3 * data["params"]
    # a serving plan and its search take --block too (they dropped it without a word)
    serving = ["plan", "--model", str(model), "--hardware", str(hw), "--gpus", "8", "--mode", "inference"]
    weights = {}
    assert main([*serving, "--tp", "1", "--json"]) == 0  # a serving plan names the block it guessed
    assert any(
        "fivefold generate builds SwiGLU blocks of it" in n
        for n in json.loads(capsys.readouterr().out)["notes"]
    )
    for block in ("gpt", "llama"):
        assert main([*serving, "--tp", "1", "--block", block, "--json"]) == 0
        served = json.loads(capsys.readouterr().out)
        weights[block] = served["memory"]["params"]
        assert not any("SwiGLU" in note for note in served["notes"])  # asked for, not guessed
        assert main([*serving, "--search", "--top", "1", "--block", block, "--json"]) == 0
        best = json.loads(capsys.readouterr().out)["plans"][0]
        assert best["memory"]["params"] * best["layout"]["tp"] * best["layout"]["pp"] > 0.9 * weights[block]
    assert weights["llama"] > 1.3 * weights["gpt"]
    assert main([*args[:-1], "--tp", "16"]) == 2
    assert "valid tp" in capsys.readouterr().err  # 24 heads do not split 16 ways


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, fivefold.plan, fivefold.plan.search, fivefold.plan.inference, fivefold.commands.plan;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_inference_with_expert_parallel_replicas(capsys) -> None:
    """Serving replicas carry the expert split: 8 replicas of tp 8 with ep 8 on 64 GPUs."""
    args = [
        "plan",
        "--model",
        "mixtral-8x7b",
        "--hardware",
        "h100-80gb",
        "--gpus",
        "64",
        "--tp",
        "8",
        "--mode",
        "inference",
        "--batch",
        "16",
        "--context",
        "4096",
        "--json",
    ]
    assert main([*args, "--ep", "8"]) == 0
    with_ep = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    without = json.loads(capsys.readouterr().out)
    assert with_ep["layout"]["replicas"] == 8 and with_ep["layout"]["ep"] == 8
    assert with_ep["memory"]["params"] < without["memory"]["params"] / 3  # experts split 8 ways
    assert with_ep["comm_time_s"]["ep"] > 0


def test_fits_margin_and_mfu_band(capsys) -> None:
    fitting = ("--tp", "8", "--pp", "2", "--sp", "--zero", "1", "--recompute", "selective")
    code, out, _ = run_cli(capsys, *fitting, "--json")
    data = json.loads(out)
    assert data["mfu_low"] < data["mfu"] < data["mfu_high"]
    assert data["fits"] and data["fits_margin_bytes"] > 0
    assert data["memory_capacity"] - data["memory"]["total"] == pytest.approx(
        data["fits_margin_bytes"], abs=2
    )
    code, out, _ = run_cli(capsys, *fitting)
    assert code == 0 and "fits with" in out and "GB to spare" in out
    assert data["nearest_fit"] is None  # nothing to suggest for a layout that fits
    code, out, _ = run_cli(capsys, "--tp", "1", "--recompute", "none")  # 70B unsharded on one GPU
    assert code == 0 and "does not fit by" in out
    # a program reads the nearest layout that fits as the text gives it: the same command and MFU
    nearest_line = next(line for line in out.splitlines() if line.startswith("nearest that fits"))
    code, out, _ = run_cli(capsys, "--tp", "1", "--recompute", "none", "--json")
    data = json.loads(out)
    nearest = data["nearest_fit"]
    assert not data["fits"] and nearest["plan"]["fits"] and nearest["plan"]["fits_margin_bytes"] > 0
    assert nearest_line.endswith(nearest["command"]) and f"MFU {nearest['mfu']:.1%}" in nearest_line
    assert nearest["keeps_given_flags"] == ("keeping the flags you gave" in nearest_line)


BAD_RUN = """
[[run]]
id = "bad-run"
source = "a made-up source"
kind = "measured"
[run.hardware]
gpu = "H100 80GB"
[run.model]
layers = 32
hidden = 4096
heads = 32
vocab = 32000
[run.layout]
gpus = 8
tp = 1
pp = 1
global_batch = 8
[run.measured]
tokens_per_s_per_gpu = 1000
"""


def test_bad_runs_file_names_the_run_and_the_field(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_RUN)  # no seq_len
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad-run" in err[0] and "seq_len" in err[0]
    bad.write_text(
        BAD_RUN.replace("[run.measured]", "[run.measured]\nnothing = 1").replace("[[run]]\n", "[[x]]\n")
    )
    assert main(["plan", "--validate", str(bad)]) == 2
    assert "no [[run]]" in capsys.readouterr().err
    assert main(["plan", "--cross-validate", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "hardware, needle",
    [
        ("hbm_gbs = nan", "hardware.hbm_gbs must be a finite number"),
        ("inter_node_gbs_per_gpu = -1", "hardware.inter_node_gbs_per_gpu must be at least 0.001"),
        ('gpu = "Foo 9000"\npeak_bf16_tflops = 100\ngpu_memory_gb = -3', "hardware.gpu_memory_gb must be"),
        # an fp8 row's MFU is over it (0: a ZeroDivisionError); 8.5 GPUs a node was read as 8; a table
        # was searched for a GPU's name as its text
        ("peak_fp8_tflops = 0", "hardware.peak_fp8_tflops must be a positive number"),
        ("gpus_per_node = 8.5", "hardware.gpus_per_node must be a whole number, got 8.5"),
        ('gpu = {name = "H100"}', "hardware.gpu must be a name"),
    ],
)
def test_a_runs_hardware_is_checked_under_the_files_own_names(capsys, tmp_path, hardware, needle) -> None:
    bad = tmp_path / "bad.toml"
    text = BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")
    if hardware.startswith("gpu ="):
        text = text.replace('gpu = "H100 80GB"', hardware)
    else:
        text = text.replace('gpu = "H100 80GB"', f'gpu = "H100 80GB"\n{hardware}')
    bad.write_text(text)
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run bad-run: " in err[0] and needle in err[0]


@pytest.mark.parametrize(
    "old, new, needle",
    [  # `true` and 1.0 equal 1 in Python; a newline or an escape in an id forged or garbled table lines
        ("[[run]]", "version = true\n[[run]]", "version True; this fivefold reads version 1"),
        ("[[run]]", "version = 1.0\n[[run]]", "version 1.0; this fivefold reads version 1"),
        ('id = "bad-run"', 'id = "bad\\nrun"', "run bad\\nrun: id has a control character"),
        ('id = "bad-run"', 'id = "bad\\u001b[2Jrun"', "id has a control character"),
        ("a made-up source", "a made-up\\tsource", "source has a control character"),
        ('id = "bad-run"', f'id = "{"x" * 10_000}"', "id is 10,000 characters; at most 200"),
    ],
)
def test_a_runs_files_header_and_ids_are_checked(capsys, tmp_path, old: str, new: str, needle: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048").replace(old, new, 1))
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and len(err[0]) < 300


@pytest.mark.parametrize(
    "key", ["experts_per_token = 2", "expert_ffn_hidden = 1024", "shared_experts = 1", "moe_topk = 2"]
)
def test_a_mixture_of_experts_without_its_expert_count_is_named(capsys, tmp_path, key: str) -> None:
    # planned as the dense model in silence before
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_RUN.replace("vocab = 32000", f"vocab = 32000\nseq_len = 2048\n{key}"))
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run bad-run: " in err[0] and "model.experts (how many) is not given" in err[0]


def test_a_link_loop_is_named_as_one(capsys, tmp_path) -> None:
    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)
    assert main(["plan", "--validate", str(loop)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "leading back to itself" in err[0]


def test_cross_validate_needs_two_sources(capsys, tmp_path) -> None:
    # leaving the one source out leaves nothing to fit on (a median of no runs, once a traceback)
    runs = tmp_path / "runs.toml"
    runs.write_text(BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 4096"))
    assert main(["plan", "--validate", str(runs)]) == 0
    capsys.readouterr()
    assert main(["plan", "--cross-validate", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at least 2 sources" in err[0] and "--validate" in err[0]


@pytest.mark.parametrize(
    "layout, needle",
    [
        ('recompute = "full"\nrecompute_layers = true', "recompute_layers must be an integer"),
        ('recompute = "full"\nrecompute_layers = 2.5', "recompute_layers must be an integer"),
        ('recompute = "selective"\nrecompute_layers = 2', 'needs recompute = "full"'),
        ('cp_impl = "tree"', "cp_impl must name one of ring, allgather, ulysses"),
        ("cp_impl = 2", "cp_impl must name one of ring, allgather, ulysses"),
        ('pipeline_schedule = "zigzag"', "names no schedule fivefold knows"),
        ("pipeline_schedule = 3", "pipeline_schedule must be a name"),
        ('recompute = "sometimes"', "recompute must be one of none, selective, full, custom"),
        ("virtual_stages = 0", "virtual_stages must be positive"),
        ('sequence_parallel = "yes"', "sequence_parallel must be true or false"),
        ('zero_stage = "one"', "zero_stage must be 0, 1, 2 or 3"),
        ("zero_stage = 4", "zero_stage must be 0, 1, 2 or 3"),
        ('cp = "two"', "layout.cp must be an integer"),
        # read as their text or truth once: "no" as compiled, a list as 16-bit, 2.0 as stage 2
        ('torch_compile = "no"', "layout.torch_compile must be true or false"),
        ('async_tp = "false"', "layout.async_tp must be true or false"),
        ('precision = ["fp8"]', "layout.precision must be a string"),
        ('cpu_offload = ["optimizer"]', "layout.cpu_offload must be true, false or a word"),
        ("zero_stage = 2.0", "zero_stage must be 0, 1, 2 or 3"),
        ('attention = "magic"', "layout.attention must be one of flash, flash3, materialized"),
    ],
)
def test_a_runs_recompute_block_count_is_checked(capsys, tmp_path, layout: str, needle: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048").replace(
            "tp = 1", f"tp = 1\n{layout}"
        )
    )
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad-run" in err[0] and needle in err[0]


@pytest.mark.parametrize(
    "old, new, needle",
    [  # counts past any real run overflowed the planner's floats (a traceback) or printed 300 digits
        ("seq_len = 2048", "seq_len = 1e308", "model.seq_len must be at most 1,000,000,000, got 1e+308"),
        ("global_batch = 8", "global_batch = 1e308", "layout.global_batch must be at most"),
        ("global_batch = 8", "global_batch_tokens = 1e308", "layout.global_batch_tokens must be at most"),
        ("global_batch = 8", "local_batch = 1e308", "layout.local_batch must be at most"),
        ("heads = 32", "heads = 1" + "0" * 400, "model.heads must be at most 1,000,000,000, got a 401-digit"),
    ],
)
def test_a_runs_counts_beyond_any_real_run_are_named(capsys, tmp_path, old: str, new: str, needle) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048").replace(old, new))
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run bad-run: " in err[0] and needle in err[0] and len(err[0]) < 200


def test_contradicting_runs_are_reported_and_calibration_writes_hardware(capsys, tmp_path) -> None:
    good = BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")
    runs = good + good.replace('"bad-run"', '"contradicts"').replace(
        "tokens_per_s_per_gpu = 1000", "tokens_per_s_per_gpu = 1000\ntokens_per_s_total = 20000"
    )
    path = tmp_path / "runs.toml"
    path.write_text(runs)
    out_file = tmp_path / "hw.toml"
    assert main(["plan", "--calibrate", str(path), "--out", str(out_file)]) == 0
    captured = capsys.readouterr()
    assert "contradicts" in captured.err and "tokens_per_s_total" in captured.err
    # 1,000 tokens/s/GPU of a 7B model is slower than any H100 knob allows: written, and said so
    assert "still miss these runs by" in captured.err
    code = main([*BASE[:3], "--hardware", str(out_file), *BASE[5:], "--tp", "8", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"] == "hw" and data["step_time_s"] > 0


@pytest.mark.parametrize(
    "measured, named",
    [
        ("mfu = 0.40", "tokens_per_s_per_gpu"),  # an 8B at 1000 tokens/s/GPU is ~5% MFU: 8x apart
        ("tflops_per_gpu = 4000", "tflops_per_gpu"),  # TFLOP/s of the job, not of one GPU
    ],
)
def test_throughputs_that_disagree_leave_the_run_out(capsys, tmp_path, measured: str, named: str) -> None:
    good = BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")
    path = tmp_path / "runs.toml"
    path.write_text(
        good
        + good.replace('"bad-run"', '"slipped"').replace(
            "tokens_per_s_per_gpu = 1000", f"tokens_per_s_per_gpu = 1000\n{measured}"
        )
    )
    assert main(["plan", "--validate", str(path)]) == 0
    captured = capsys.readouterr()
    left = [line for line in captured.err.splitlines() if "left out" in line]
    assert len(left) == 1 and "slipped" in left[0] and named in left[0] and "MFU" in left[0]
    assert "bad-run" in captured.out and "slipped" not in captured.out
    path.write_text(good.replace("tokens_per_s_per_gpu = 1000", "tokens_per_s_per_gpu = 1000\nmfu = 0.05"))
    assert main(["plan", "--validate", str(path)]) == 0  # the same throughput twice: kept
    assert "left out" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "measured, named",
    [  # each alone, and each far above what 8 H100s can do: once planned and scored without a word
        ("iteration_time_s = 1e-6", "iteration_time_s"),
        ("aggregate_pflops = 1e6", "aggregate_pflops"),
        ('tflops_per_gpu = 5000\ntflops_basis = "hardware"', "tflops_per_gpu"),
    ],
)
def test_a_step_time_or_job_rate_above_the_peak_leaves_the_run_out(capsys, tmp_path, measured, named) -> None:
    good = BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")
    path = tmp_path / "runs.toml"
    fast = good.replace('"bad-run"', '"fast"').replace("tokens_per_s_per_gpu = 1000", measured)
    path.write_text(good + fast)
    assert main(["plan", "--validate", str(path)]) == 0
    left = [line for line in capsys.readouterr().err.splitlines() if "left out" in line]
    assert len(left) == 1 and "run fast:" in left[0] and f"measured.{named}" in left[0] and "peak" in left[0]


def test_a_throughput_above_the_peak_leaves_the_run_out(capsys, tmp_path) -> None:
    """30,000 tokens/s on one H100 is an 8B at over 150% MFU (a job's rate typed as one GPU's, say); an
    fp8 run is held to the fp8 tensor cores' peak, twice the 16-bit one its MFU is given against."""
    good = BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")
    path = tmp_path / "runs.toml"
    path.write_text(
        good
        + good.replace('"bad-run"', '"too-fast"').replace("= 1000", "= 30000")
        + good.replace('"bad-run"', '"fp8"')
        .replace("= 1000", "= 15000")
        .replace("pp = 1", 'pp = 1\nprecision = "fp8"')
    )
    assert main(["plan", "--validate", str(path)]) == 0
    captured = capsys.readouterr()
    left = [line for line in captured.err.splitlines() if "left out" in line]
    assert len(left) == 1 and "too-fast" in left[0] and "above the 989 TFLOP/s peak" in left[0]
    assert "fp8" in captured.out and "too-fast" not in captured.out


def test_no_bundled_run_contradicts_itself() -> None:
    from fivefold.plan.runs import builtin_paths, contradictions, load_runs

    assert [r["id"] for r in load_runs(*builtin_paths()) if contradictions(r)] == []


@pytest.mark.parametrize(
    "words, impl",
    [
        ("all-gather based", "allgather"),
        ("All_Gather", "allgather"),
        ("DeepSpeed-Ulysses (all-to-all)", "ulysses"),
        ("a2a", "ulysses"),
        ("p2p", "ring"),
        ("zigzag ring attention", "ring"),
        ("Ring", "ring"),
    ],
)
def test_a_runs_cp_core_is_read_in_its_sources_words(words: str, impl: str) -> None:
    """Sources name the context-parallel core in their own words; each reads as the core it names."""
    from fivefold.plan import validation as V

    run = {
        "id": "cp-words",
        "source": "a 2024 report",
        "kind": "measured",
        "hardware": {"gpu": "H100 80GB", "gpus_per_node": 8},
        "model": {
            "layers": 32,
            "hidden": 4096,
            "heads": 32,
            "kv_heads": 8,
            "vocab": 128256,
            "seq_len": 65536,
        },
        "layout": {"gpus": 8, "tp": 1, "pp": 1, "cp": 2, "dp": 4, "global_batch": 8, "cp_impl": words},
        "measured": {"tokens_per_s_per_gpu": 2000},
    }
    assert V.cases([run])[0].inputs.layout.cp_impl == impl


def test_a_run_directory_is_planned_with_its_own_cp_core(tmp_path) -> None:
    """Each of the three context-parallel cores a run ran with is the one its plan prices."""
    from fivefold.config import Layout, RunConfig, TrainSpec, load_model
    from fivefold.plan import validation as V
    from fivefold.plan.runs import run_from_dir

    steps = {}
    for impl in ("ring", "allgather", "ulysses"):
        run = tmp_path / impl
        run.mkdir()
        lay = Layout(cp=2, dp=1, cp_impl=impl).resolve(2)
        cfg = RunConfig(model=load_model("small"), train=TrainSpec(seq_len=256, micro_batch=4), layout=lay)
        (run / "config.toml").write_text(cfg.to_toml())
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i, "step_time_s": 1.0}) + "\n" for i in (1, 2))
        )
        (case,) = V.cases([run_from_dir(run)])
        assert case.inputs.layout.cp_impl == impl
        steps[impl] = V.predict(case).predicted
    assert len(set(steps.values())) == 3


def test_a_pipelined_run_directory_is_planned_with_its_own_batch_split(tmp_path) -> None:
    """train --pp 2 --micro-batch 8 --microbatches 4 runs 4 pipeline micro-batches of 2 sequences:
    the plan of its run directory does too (it had planned one micro-batch of 8)."""
    from fivefold.config import Layout, RunConfig, TrainSpec, load_model
    from fivefold.plan import validation as V
    from fivefold.plan.runs import run_from_dir

    run = tmp_path / "pp2"
    run.mkdir()
    lay = Layout(pp=2, microbatches=4).resolve(2)
    cfg = RunConfig(model=load_model("tiny"), train=TrainSpec(seq_len=64, micro_batch=8), layout=lay)
    (run / "config.toml").write_text(cfg.to_toml())
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "step_time_s": 1.0}) + "\n" for i in (1, 2))
    )
    (case,) = V.cases([run_from_dir(run)])
    plan = V._plan_case(case, case.inputs.hw)
    assert (plan.shape.micro_batch, plan.microbatches, plan.shape.global_batch) == (2, 4, 8)


def _small_dp2_run(run: Path) -> Path:
    """A run directory of `small` on 2 data-parallel ranks (config.toml only; its steps to be written)."""
    from fivefold.config import Layout, RunConfig, TrainSpec, load_model

    run.mkdir()
    cfg = RunConfig(
        model=load_model("small"),
        train=TrainSpec(seq_len=256, micro_batch=8, global_batch=16),
        layout=Layout(dp=2, zero=0).resolve(2),
    )
    (run / "config.toml").write_text(cfg.to_toml())
    return run


def _write_steps(run: Path, times: tuple[float, ...]) -> None:
    """metrics.jsonl of steps 1, 2, ... taking `times` seconds each."""
    steps = [{"step": i, "loss": 5.0, "step_time_s": t} for i, t in enumerate(times, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))


def test_calibrate_reads_run_directories(capsys, tmp_path) -> None:
    run = _small_dp2_run(tmp_path / "run-dp2")
    assert main(["plan", "--calibrate", str(run)]) == 2  # no metrics.jsonl yet
    err = capsys.readouterr().err
    assert "run-dp2" in err and "metrics.jsonl" in err
    for bad, said in (
        ('{"step": 2, "step_time_s": "fast"}', "step 2: step_time_s"),
        ("[1, 2]", "JSON object"),
    ):
        (run / "metrics.jsonl").write_text(bad + "\n")
        assert main(["plan", "--calibrate", str(run)]) == 2  # one line, no traceback
        assert said in capsys.readouterr().err
    _write_steps(run, (9.0, 2.1, 1.9, 2.0))
    out_file = tmp_path / "cpu-here.toml"
    assert main(["plan", "--calibrate", str(run), "--out", str(tmp_path)]) == 2  # a directory: one line
    assert "cannot write there" in capsys.readouterr().err
    assert main(["plan", "--calibrate", str(run), str(run)]) == 2  # the same run twice would weigh twice
    assert "is given twice" in capsys.readouterr().err
    assert main(["plan", "--calibrate", str(run), "--out", str(out_file)]) == 0
    capsys.readouterr()
    code = main(
        ["plan", "--model", "small", "--hardware", str(out_file), "--gpus", "2", "--dp", "2", "--zero", "0"]
        + ["--seq-len", "256", "--global-batch", "16", "--micro-batch", "8", "--json"]
    )
    assert code == 0
    step = json.loads(capsys.readouterr().out)["step_time_s"]
    assert step == pytest.approx(2.0, rel=0.05)  # the median step after the first, reproduced
    # --validate with --hardware plans the run directory on the calibrated file, not on the preset
    assert main(["plan", "--validate", str(run), "--hardware", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert f"on --hardware {out_file}" in out
    row = next(line for line in out.splitlines() if line.startswith("run-dp2")).split()
    error = float(next(cell for cell in row if cell.endswith("%")).rstrip("%"))  # the first % column
    assert abs(error) < 5


def test_a_gpu_run_directory_is_planned_on_the_gpu_it_ran_on(tmp_path, capsys) -> None:
    """`run.json` names the preset the run measured its MFU against; `--compile` plans fused kernels."""
    from fivefold.config import Layout, RunConfig, TrainSpec, load_model
    from fivefold.plan.runs import build, hardware, run_from_dir

    run = tmp_path / "gpu-run"
    run.mkdir()
    cfg = RunConfig(
        model=load_model("small"),
        train=TrainSpec(seq_len=256, micro_batch=8, device="cuda", dtype="bf16", compile=True),
        layout=Layout().resolve(1),
    )
    (run / "config.toml").write_text(cfg.to_toml())
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "step_time_s": 0.2}) + "\n" for i in (1, 2))
    )
    (run / "run.json").write_text(json.dumps({"world": 1, "mfu_peak_from": "h200", "torch": "2.10.0+cu128"}))
    described = run_from_dir(run)
    assert hardware(described).name == "h200"
    assert described["layout"]["torch_compile"] is True
    assert described["layout"]["torch_version"] == "2.10.0+cu128"  # its SDPA kernel: FlashAttention-2's
    assert build(described).shape.attention == "flash"
    (run / "run.json").write_text(json.dumps({"world": 1, "mfu_peak_from": "h200", "torch": "2.11.0"}))
    assert build(run_from_dir(run)).shape.attention == "flash3"  # cuDNN's, as SDPA picks it there
    # a small model's GPU step is far under 0.2% MFU: fivefold's own clock, not a unit slip to leave out
    assert main(["plan", "--validate", str(run)]) == 0
    assert "left out" not in capsys.readouterr().err
    (run / "run.json").write_text(json.dumps({"world": 1, "mfu_peak_from": "h200", "torch": ["2.11"]}))
    assert "torch_version" not in run_from_dir(run)["layout"]  # only a version string is taken
    (run / "run.json").write_text("not json")  # an older or damaged run.json: the device decides
    assert run_from_dir(run)["hardware"]["gpu"] == "H100"
    for hostile in ("../../etc/passwd", ["h200"], {"a": 1}):  # only a preset's name is taken
        (run / "run.json").write_text(json.dumps({"mfu_peak_from": hostile}))
        assert run_from_dir(run)["hardware"]["gpu"] == "H100"


def test_a_run_directory_is_planned_in_its_own_dtype(tmp_path) -> None:
    """An fp32 run (the CPU default) gathers, sends and streams 4-byte elements: its FSDP gathers
    and tp traffic are twice a bf16 run's, as its ledger records them."""
    from fivefold.config import Layout, RunConfig, TrainSpec, load_model
    from fivefold.plan import plan
    from fivefold.plan.runs import build, run_from_dir

    volumes = {}
    for dtype in ("fp32", "bf16"):
        run = tmp_path / dtype
        run.mkdir()
        cfg = RunConfig(
            model=load_model("small"),
            train=TrainSpec(seq_len=256, micro_batch=4, global_batch=16, dtype=dtype),
            layout=Layout(fsdp=2, tp=2, zero=3, sp=True).resolve(4),
        )
        (run / "config.toml").write_text(cfg.to_toml())
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i, "step_time_s": 1.0}) + "\n" for i in (1, 2))
        )
        inputs = build(run_from_dir(run))
        assert inputs.shape.act_bytes == inputs.shape.param_bytes == (4 if dtype == "fp32" else 2)
        assert inputs.model.tie_embeddings is cfg.model.tie_embeddings is True  # `small` ties its head
        p = plan(inputs.model, inputs.hw, inputs.layout, inputs.shape)
        volumes[dtype] = {(c.axis, c.op): c.bytes for c in p.comm}
    assert volumes["fp32"][("fsdp", "all_gather")] == pytest.approx(
        2 * volumes["bf16"][("fsdp", "all_gather")]
    )
    assert volumes["fp32"][("tp", "all_gather")] == pytest.approx(2 * volumes["bf16"][("tp", "all_gather")])


@pytest.mark.parametrize(
    "argv",
    [
        ["--validate", "--hardware", "h200"],
        ["--cross-validate", "--hardware", "h200"],
        ["--calibrate", "RUNS.toml", "--hardware", "h200"],
    ],
)
def test_hardware_is_refused_where_runs_name_their_own_gpu(capsys, argv) -> None:
    assert main(["plan", *argv]) == 2
    assert "--hardware applies to --validate with your own runs" in capsys.readouterr().err


def test_calibrate_separates_compute_from_collective_latency(capsys, tmp_path) -> None:
    """A data-parallel and a tensor-parallel run of one machine: the fit takes the matmul rate from
    the first and the per-collective latency from the second, so both are reproduced."""
    from fivefold.config import Layout, RunConfig, TrainSpec, load_model

    layouts = {"dp2": (Layout(dp=2, zero=0), 2.0), "tp2": (Layout(tp=2, sp=True), 3.0)}
    dirs = []
    for name, (lay, step) in layouts.items():
        run = tmp_path / name
        run.mkdir()
        cfg = RunConfig(
            model=load_model("small"),
            train=TrainSpec(seq_len=256, micro_batch=4, global_batch=16),
            layout=lay.resolve(2),
        )
        (run / "config.toml").write_text(cfg.to_toml())
        steps = [{"step": i, "step_time_s": t} for i, t in enumerate((9.0, step, step), 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        dirs.append(str(run))
    out_file = tmp_path / "cpu-here.toml"
    assert main(["plan", "--calibrate", *dirs, "--out", str(out_file)]) == 0
    capsys.readouterr()
    for flags, step in ((["--dp", "2", "--zero", "0"], 2.0), (["--tp", "2", "--sp"], 3.0)):
        code = main(
            ["plan", "--model", "small", "--hardware", str(out_file), "--gpus", "2", *flags]
            + ["--seq-len", "256", "--global-batch", "16", "--micro-batch", "4", "--json"]
        )
        assert code == 0
        assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(step, rel=0.05)


def test_a_calibration_of_one_machines_runs_keeps_its_ranks_on_one_node(capsys, tmp_path) -> None:
    """Run directories of one machine, the one-rank run first: the file keeps every rank on one node
    (the CPU preset's 8), so it plans the 2-rank run as the fit did, not across a node boundary."""
    import tomllib

    from fivefold.config import Layout, RunConfig, TrainSpec, load_hardware, load_model

    dirs = []
    for name, lay, step in (("one", Layout(), 3.0), ("dp2", Layout(dp=2, zero=0), 2.0)):
        run = tmp_path / name
        run.mkdir()
        cfg = RunConfig(
            model=load_model("small"),
            train=TrainSpec(seq_len=256, micro_batch=4, global_batch=8 * lay.resolve(lay.world).world),
            layout=lay.resolve(lay.world),
        )
        (run / "config.toml").write_text(cfg.to_toml())
        steps = [{"step": i, "step_time_s": t} for i, t in enumerate((9.0, step, step), 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        dirs.append(str(run))
    out_file = tmp_path / "cpu-here.toml"
    assert main(["plan", "--calibrate", *dirs, "--out", str(out_file), "--json"]) == 0
    fitted = {r["run"]: r["error"] for r in json.loads(capsys.readouterr().out)["runs"]}
    assert tomllib.loads(out_file.read_text())["gpus_per_node"] == load_hardware("cpu").gpus_per_node
    assert main(["plan", "--validate", *dirs, "--hardware", str(out_file), "--json"]) == 0
    again = {r["run"]: r["error"] for r in json.loads(capsys.readouterr().out)["as_shipped"]["runs"]}
    assert again == pytest.approx(fitted, abs=0.01)


def _serving(capsys, model: str, gpus: int, *extra: str) -> tuple[int, dict | str, str]:
    argv = ["plan", "--model", model, "--hardware", "h100-80gb", "--gpus", str(gpus), "--mode", "inference"]
    code = main([*argv, *extra])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if "--json" in extra and code == 0 else out.out), out.err


def test_top_0_lists_every_layout_that_fits(capsys) -> None:
    """--top 0 (documented: every layout that fits) in the training and the serving search."""
    code, out, _ = run_cli(capsys, "--search", "--top", "0", "--json")
    data = json.loads(out)
    assert code == 0 and len(data["plans"]) == data["search"]["fitting"] > 5
    code, serving, _ = _serving(
        capsys, "mixtral-8x7b", 8, "--context", "4096", "--search", "--top", "0", "--json"
    )
    assert code == 0 and len(serving["plans"]) == serving["search"]["fitting"] > 5


def test_a_serving_pin_no_layout_has_is_named(capsys) -> None:
    """The serving search with --ep on a dense model, or a cp no serving layout takes: one line naming
    the pin and what is valid, not "0 layouts considered, none fits: more GPUs". A cp the search
    would not try at a short context, but that divides the GPUs, is searched as asked."""
    args = ("--context", "4096", "--search")
    code, _, err = _serving(capsys, "llama3-8b", 8, *args, "--ep", "2")
    assert code == 2 and "needs a mixture-of-experts model" in err
    code, _, err = _serving(capsys, "llama3-8b", 8, *args, "--cp", "3")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "valid cp: 1, 2, 4, 8" in err
    code, pinned, _ = _serving(capsys, "llama3-8b", 8, *args, "--cp", "2", "--json")
    assert code == 0 and pinned["plans"] and {p["layout"]["cp"] for p in pinned["plans"]} == {2}


def test_serving_search_ranks_fitting_layouts_by_the_objective(capsys) -> None:
    args = ("--context", "8192", "--batch", "8", "--search", "--top", "50", "--json")
    _, latency, _ = _serving(capsys, "llama3-70b", 16, *args)
    _, throughput, _ = _serving(capsys, "llama3-70b", 16, *args, "--objective", "throughput")
    for result in (latency, throughput):
        plans = result["plans"]
        assert plans and all(p["fits"] and p["decode_tokens_per_s"] > 0 for p in plans)
        assert all(p["layout"]["tp"] <= 8 for p in plans)  # tp stays inside a node
        assert result["search"]["fitting"] < result["search"]["considered"]  # tp 1, 2 do not fit
        assert all(p["prompt"] < p["context"] for p in plans)  # the default prompt leaves tokens to generate
    times = [p["decode_time_per_token_s"] for p in latency["plans"]]
    rates = [p["decode_tokens_per_s"] for p in throughput["plans"]]
    assert times == sorted(times) and rates == sorted(rates, reverse=True)
    assert latency["plans"][0]["layout"]["tp"] == 8  # the widest tp: fastest per token
    assert throughput["plans"][0]["layout"]["replicas"] > latency["plans"][0]["layout"]["replicas"]
    assert "split the model" in latency["search"]["explanation"][0]

    # a model that fits one GPU: replicas serve the most tokens/s
    _, small, _ = _serving(capsys, "llama3-8b", 8, "--context", "4096", "--search", "--objective",
                           "throughput", "--json")  # fmt: skip
    assert small["plans"][0]["layout"] == {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "replicas": 8}
    assert "serve 8 replicas" in small["search"]["explanation"][0]
    # MoE and a long context: ep and cp are tried
    _, moe, _ = _serving(
        capsys, "mixtral-8x7b", 16, "--context", "32768", "--search", "--top", "100", "--json"
    )
    assert {p["layout"]["ep"] for p in moe["plans"]} > {1} and {p["layout"]["cp"] for p in moe["plans"]} > {1}


def test_serving_refuses_throughput_for_layouts_that_do_not_fit(capsys) -> None:
    code, data, _ = _serving(capsys, "llama3-70b", 1, "--context", "8192", "--json")
    assert code == 0 and not data["fits"] and data["decode_tokens_per_s"] is None
    code, text, _ = _serving(capsys, "llama3-70b", 1, "--context", "8192")
    assert "memory per GPU — does not fit by 62 GB" in text
    assert "does not fit: serves nothing" in text and "tokens/s" not in text
    assert "no serving layout of llama3-70b fits 1 × h100-80gb: add GPUs" in text
    # as a training plan: by how much, and the nearest layout that fits, the typed degrees kept where
    # they can be (tp 2 with two stages), else the best one; the context, left out, is said
    code, text, err = _serving(capsys, "llama3-70b", 8, "--tp", "2", "--batch", "16")
    assert code == 0 and "assuming --context 4096 (give it to plan your own)" in err  # one: "it"
    assert "this layout does not fit by 4 GB per GPU" in text
    nearest = next(line for line in text.splitlines() if line.startswith("nearest that fits"))
    assert "(keeping the flags you gave, latency)" in nearest and "--tp 2 --pp" in nearest
    code, text, _ = _serving(capsys, "llama3-70b", 8)
    assert "(the best layout, latency)" in text and text.splitlines()[1].endswith("--batch 1 --tp 8")
    code, data, _ = _serving(capsys, "llama3-70b", 8, "--tp", "2", "--batch", "16", "--json")
    assert nearest.endswith(data["nearest_fit"]["command"]) and data["nearest_fit"]["plan"]["fits"]
    assert data["nearest_fit"]["keeps_given_flags"] and data["nearest_fit"]["plan"]["layout"]["tp"] == 2
    code, text, _ = _serving(capsys, "llama3-70b", 8, "--tp", "8")
    assert "nearest" not in text and "fits with" in text
    code, text, _ = _serving(capsys, "llama3-405b", 1, "--context", "8192", "--search")
    assert code == 0 and "0 fit" in text and "none fits" in text
    code, _, err = _serving(capsys, "llama3-70b", 8, "--context", "8192", "--prompt", "8192")
    assert code == 2 and "generates no token" in err and "valid prompt: 1..8191" in err
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses an unknown objective
        _serving(capsys, "llama3-70b", 8, "--context", "8192", "--search", "--objective", "cost")
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "old, new, needle",
    [
        (
            "tokens_per_s_per_gpu = 1000",
            'tokens_per_s_per_gpu = "fast"',
            "tokens_per_s_per_gpu must be a positive",
        ),
        (
            "tokens_per_s_per_gpu = 1000",
            "tokens_per_s_per_gpu = -3",
            "tokens_per_s_per_gpu must be a positive",
        ),
        ("tokens_per_s_per_gpu = 1000", "mfu = 47.0", "fraction of the peak"),
        ("layers = 32", "layers = 1000000000", "layers must be at most"),  # no hour-long walk over them
    ],
)
def test_a_runs_measured_numbers_and_size_are_checked(
    capsys, tmp_path, old: str, new: str, needle: str
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048").replace(old, new))
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad-run" in err[0] and needle in err[0]


@pytest.mark.parametrize(
    "line, needle",
    [
        ("intra_node_latency_us = -5", "intra_node_latency_us must be 0 or more"),
        ("intra_node_latency_us = nan", "must be a finite number"),
        ("hbm_gbps = inf", "must be a finite number"),
        ("link_efficiency = 7", "link_efficiency is a fraction"),
        ("matmul_efficiency = -1", "matmul_efficiency is a fraction"),
        ("step_overhead_s = -3", "step_overhead_s must be 0 or more"),
        # positive, and still no device: a step of inf seconds and an MFU of NaN, in --json too
        ("hbm_gbps = 5e-324", "hbm_gbps must be at least 0.001"),
        ("inter_node_gbps = 1e-300", "inter_node_gbps must be at least 0.001"),
        ("matmul_efficiency = 1e-300", "matmul_efficiency is a fraction (0.0001 to 1"),
    ],
)
def test_a_hardware_file_with_impossible_numbers_is_one_line(
    capsys, tmp_path, line: str, needle: str
) -> None:
    """A negative latency or an efficiency of 7 planned happily before, to MFUs above 100%."""
    hw = tmp_path / "hw.toml"
    hw.write_text(f'name = "x"\ngpu_memory_gb = 80\npeak_tflops = 900\n{line}\n')
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--hardware", str(hw)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (
            lambda t: t.replace("[run.measured]", "[run.measured]\ntflops_basis = 'weird'"),
            "tflops_basis must be",
        ),
        (
            lambda t: t.replace('id = "bad-run"', 'id = "bad-run"\nunknown = "layers"'),
            "unknown must be a list",
        ),
        (lambda t: t + t, "given twice"),
        (
            lambda t: 'format = "megatron-runs"\n' + t,
            "format 'megatron-runs' is not 'fivefold-reference-runs'",
        ),
        (lambda t: "version = 2\n" + t, "version 2; this fivefold reads version 1"),
        (
            lambda t: t.replace('[run.hardware]\ngpu = "H100 80GB"\n', 'hardware = "a100"\n'),
            "hardware must be a table",
        ),
        (
            lambda t: t.replace('gpu = "H100 80GB"', 'gpu = "H100"\ngpu_memory_gb = "80GB"'),
            "must be a number",
        ),
        (lambda t: "run = [1, 2]\n", "is not a table"),
        (lambda t: t.replace('source = "', 'source = "  "\nx = "'), "source must be a non-empty string"),
    ],
)
def test_a_malformed_runs_file_is_one_line(capsys, tmp_path, edit, needle: str) -> None:
    """Whatever is wrong in a runs file ends in one line naming it, exit 2, never a traceback."""
    bad = tmp_path / "bad.toml"
    bad.write_text(edit(BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")))
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_runs_file_that_is_not_text_is_one_line(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'[[run]]\nid = "\xff\xfe"\n')
    assert main(["plan", "--validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "UTF-8" in err[0]


@pytest.mark.parametrize("split", ["0,32", "32,0"])
def test_a_pipeline_end_without_blocks_is_planned(capsys, split: str) -> None:
    """`--pp-split` lets the first or last chunk hold only the embedding or the head."""
    code = main(["plan", "--model", "llama3-8b", "--gpus", "2", "--pp", "2", "--pp-split", split, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["step_time_s"] > 0


def test_a_search_for_another_trainer_proposes_only_what_it_runs(capsys) -> None:
    """`--search --trainer NAME` keeps to that trainer's pipeline schedules and ZeRO (nanotron: 1F1B or
    all-forward-all-backward, ZeRO-1 at most; Megatron: 1F1B, interleaved or not); a single plan of a
    layout it does not run says so. 1F1B stays a candidate where zero-bubble is refused."""
    import json as _json

    def best(*flags: str) -> list[dict]:
        argv = ["plan", "--model", "llama3-70b", "--gpus", "64", "--search", "--top", "20", "--json", *flags]
        assert main(argv) == 0
        return [p["layout"] for p in _json.loads(capsys.readouterr().out)["plans"]]

    nanotron = best("--trainer", "nanotron")
    assert nanotron and all(lay["fsdp"] == 1 and lay["zero"] <= 1 for lay in nanotron)
    assert all(lay["pp_schedule"] in ("1f1b", "gpipe") for lay in nanotron if lay["pp"] > 1)
    megatron = best("--trainer", "megatron")
    assert all(lay["pp_schedule"] in ("1f1b", "interleaved-1f1b") for lay in megatron if lay["pp"] > 1)
    assert {lay["pp_schedule"] for lay in best() if lay["pp"] > 1} - {"1f1b", "interleaved-1f1b"}
    # replicated tp weights cannot take zero-bubble's split backward in fivefold: 1F1B is proposed
    pinned = best("--tp", "8", "--pp", "4", "--dp", "2", "--zero", "0")
    schedules = {lay["pp_schedule"] for lay in pinned}
    assert "1f1b" in schedules and not schedules & {"zero-bubble", "zbv", "dualpipev"}
    flags = ["--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--dp", "2", "--zero", "0"]
    assert main(["plan", *flags, "--pp-schedule", "zbv", "--trainer", "nanotron"]) == 0
    out = capsys.readouterr().out
    why = "--pp-schedule zbv (it runs 1f1b, gpipe)"
    assert f"note: huggingface/nanotron does not run this layout: {why}" in out


def test_trainer_flag_plans_with_that_trainers_facts(capsys) -> None:
    """`--trainer` plans another implementation with the facts its published runs are planned with:
    Megatron on Hopper overlaps tp with the GEMMs and runs cuDNN attention; fivefold's runtime (the
    default) issues DTensor's collectives and its masked cp cores. The flags typed still win."""
    from fivefold.commands.plan import trainer_shape
    from fivefold.config import load_hardware
    from fivefold.plan.trainers import TRAINERS, sdpa_attention, shape_facts

    h100, a100 = load_hardware("h100-80gb"), load_hardware("a100-80gb")
    # fivefold's attention is the kernel the installed torch's SDPA picks on that GPU
    assert trainer_shape("fivefold", h100) == ({}, sdpa_attention(True))
    assert trainer_shape("fivefold", a100) == ({}, "flash")
    facts, attention = trainer_shape("megatron", h100)
    assert attention == "flash3" and facts["tp_overlap"] and facts["tp_backward_overlap"]
    assert trainer_shape("megatron", a100)[1] == "flash"  # no FA3-class kernels on Ampere
    assert trainer_shape("torchtitan", h100)[0] == shape_facts(TRAINERS["pytorch/torchtitan"])
    layout = ["--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--fsdp", "8", "--zero", "2", "--sp"]
    layout += ["--seq-len", "8192", "--global-batch", "64"]
    step = {}
    for trainer in ("fivefold", "torchtitan", "megatron"):
        assert main(["plan", *layout, "--trainer", trainer, "--json"]) == 0
        step[trainer] = json.loads(capsys.readouterr().out)["step_time_s"]
    # Megatron hides tp behind its fused kernels; fivefold and torchtitan both run eager DTensor code
    assert step["megatron"] < step["fivefold"] <= step["torchtitan"]
    assert main(["plan", *layout, "--trainer", "megatron", "--attention", "flash", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > step["megatron"]
    with pytest.raises(SystemExit) as refused:  # argparse's one line, naming the choices
        main(["plan", *layout, "--trainer", "nobody"])
    assert refused.value.code == 2 and "choose from" in capsys.readouterr().err


@pytest.mark.parametrize("stated", ["full (uniform)", "Full", "selective, attention only"])
def test_a_runs_recompute_is_read_by_its_first_word(capsys, tmp_path, stated: str) -> None:
    runs = tmp_path / "runs.toml"
    runs.write_text(
        BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048").replace(
            "tp = 1", f'tp = 1\nrecompute = "{stated}"'
        )
    )
    assert main(["plan", "--validate", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "bad-run" in out


def test_a_calibration_is_anchored_at_the_devices_own_figures(capsys, tmp_path) -> None:
    """A calibration starts from, and is pulled toward, the figures the device's plans use unfitted
    (the CPU preset's measured 650 µs ring step, not a GPU's 100 µs), and says when one run cannot
    tell compute from the collectives' cost."""
    from fivefold.config import Layout, RunConfig, TrainSpec, load_hardware, load_model
    from fivefold.plan import compute as C
    from fivefold.plan import validation as V

    cpu = V.anchored(load_hardware("cpu"))
    assert cpu.latency_other == 650 and cpu.matmul_other == 0.8
    assert cpu.memory_other == C.DEFAULT_MEMORY_EFFICIENCY
    assert cpu.attention_other == pytest.approx(0.8 * C.ATTENTION_RATIO)
    h100 = load_hardware("h100-80gb")
    assert V.anchored(h100).matmul_hopper == h100.matmul_efficiency
    assert V.anchored(h100).latency_other == V.START.latency_other  # not a knob of a GPU's fit

    run = tmp_path / "tp2"
    run.mkdir()
    cfg = RunConfig(
        model=load_model("small"),
        train=TrainSpec(seq_len=256, micro_batch=4, global_batch=16),
        layout=Layout(tp=2, sp=True).resolve(2),
    )
    (run / "config.toml").write_text(cfg.to_toml())
    steps = [{"step": i, "step_time_s": t} for i, t in enumerate((9.0, 0.7, 0.7), 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert main(["plan", "--calibrate", str(run), "--out", str(tmp_path / "here.toml")]) == 0
    assert "cannot be told apart" in capsys.readouterr().err


def test_the_mfu_band_stops_at_the_peak(capsys) -> None:
    """An MFU band is a range of possible runs: none beats the peak, so its top is at most 1."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=8, micro_batch=1)
    high_mfu = dataclasses.replace(plan(model, hw, Layout(dp=8), shape), mfu=0.95)
    low, high = high_mfu.mfu_band
    assert low < 0.95 < high == 1.0


def test_a_flag_for_an_axis_of_one_is_named_not_silently_dropped(capsys, tmp_path) -> None:
    code, out, err = run_cli(capsys, "--fsdp", "64", "--sp", "--cp-impl", "ulysses", "--json")
    assert code == 0 and json.loads(out)["layout"]["sp"] is False  # stdout stays clean for --json
    assert "--sp" in err and "tp is 1" in err and "--cp-impl" in err and "cp is 1" in err
    code, _, err = run_cli(capsys, "--tp", "8", "--cp", "2", "--sp", "--cp-impl", "ulysses", "--json")
    assert code == 0 and "note" not in err
    page = ["explore", "--model", "tiny", "--gpus", "2", "--fsdp", "2", "--top", "0", "--no-lab"]
    assert main([*page, "--pp-schedule", "gpipe", "--out", str(tmp_path / "page.html")]) == 0
    assert "--pp-schedule orders" in capsys.readouterr().err


def test_a_pipelined_serving_plan_says_its_throughput_is_one_batch_in_flight(capsys) -> None:
    """fivefold generate passes one batch through the stages in turn: the plan says what an engine
    keeping pp batches in flight would get, and says nothing without a pipeline."""
    args = ("--context", "8192", "--batch", "16")
    code, text, _ = _serving(capsys, "llama3-70b", 16, *args, "--tp", "8", "--pp", "2")
    assert code == 0 and "keeps 2 batches in flight" in text and "2× the tokens/s" in text
    code, text, _ = _serving(capsys, "llama3-70b", 16, *args, "--tp", "8")
    assert code == 0 and "in flight" not in text


def test_a_serving_plan_lists_the_collectives_generate_issues(capsys) -> None:
    """The serving plan shows, per decoded token and for the first and last stage, the collectives
    `fivefold generate` issues (`decode_traffic`, which tests/test_serve.py holds to the ledger)."""
    args = ("--context", "32768", "--batch", "4", "--tp", "2", "--pp", "2", "--cp", "2", "--ep", "2")
    code, text, _ = _serving(capsys, "mixtral-8x7b", 16, *args)
    assert code == 0 and "collectives per decoded token" in text
    code, data, _ = _serving(capsys, "mixtral-8x7b", 16, *args, "--json")
    rows = {(r["stage"], r["axis"], r["op"]): (r["count"], r["bytes"]) for r in data["decode_traffic"]}
    layers = 32 // 2  # per stage; every Mixtral block is MoE, so tp reduces once a layer (+ the embedding)
    assert rows[0, "tp", "all_reduce"] == (layers + 1, (layers + 1) * 4 * 4096 * 2)
    assert rows[1, "tp", "all_gather"] == (1, 4 * 32000 * 2) and (0, "tp", "all_gather") not in rows
    assert rows[0, "ep", "all_to_all"][0] == 3 * layers and rows[1, "cp", "broadcast"] == (1, 4 * 8)
    assert rows[0, "pp", "send"] == rows[1, "pp", "recv"] == (1, 4 * 4096 * 2)


def test_inference_flags_on_a_training_plan_are_named_as_ignored(capsys) -> None:
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--objective", "throughput", "--json"]) == 0
    err = capsys.readouterr().err
    assert "note: --objective is a flag of --mode inference; this training plan ignores it" in err
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--json"]) == 0
    assert "note:" not in capsys.readouterr().err  # the defaults are not flags someone typed


def test_search_keeps_a_given_rank_order_and_cp_implementation(capsys) -> None:
    """--order and --cp-impl under --search stay fixed like the degrees, and the flags printed for
    each layout carry them, so the command they spell plans the same layout."""
    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--search", "--top", "3"]
    assert main([*argv, "--cp", "2", "--cp-impl", "ulysses", "--order", "dp,cp", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["layout"]["cp_impl"] == "ulysses" for p in plans)
    assert all(p["layout"]["order"].startswith("dp,cp") for p in plans)
    assert main(argv + ["--cp", "2", "--cp-impl", "ulysses", "--order", "dp,cp"]) == 0
    best = capsys.readouterr().out.split("Best: ", 1)[1].split(":", 1)[0]
    assert "--cp-impl ulysses" in best and "--order dp,cp," in best, best


def test_a_micro_batch_larger_than_a_ranks_batch_leaves_the_run_out(capsys, tmp_path) -> None:
    """A run stating micro_batch 100000 with a batch of 8 over 8 data ranks contradicts itself: the
    run is left out with the reason, and a file of nothing else says each was left out (exit 2)."""
    good = BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")
    huge = good.replace('"bad-run"', '"huge-micro"').replace(
        "global_batch = 8", "global_batch = 8\nmicro_batch = 100000"
    )
    path = tmp_path / "runs.toml"
    path.write_text(good + huge)
    assert main(["plan", "--validate", str(path)]) == 0
    captured = capsys.readouterr()
    left = [line for line in captured.err.splitlines() if "left out" in line]
    assert len(left) == 1 and "huge-micro" in left[0] and "more than global_batch 8" in left[0], left
    path.write_text(huge)
    assert main(["plan", "--validate", str(path)]) == 2
    assert "no run left to compare: the 1 given were each left out" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, reason",
    [
        (["--micro-batch", "1000", "--global-batch", "64000"], "not the activations of micro-batch 1000"),
        (["--model", "llama3-405b", "--gpus", "8"], "the model state alone exceeds"),
    ],
)
def test_a_search_where_nothing_fits_names_the_obstacle(capsys, extra: list[str], reason: str) -> None:
    """Layouts sized against the memory and none fitting is an answer (exit 0, as the serving search
    answers); the line says what stopped them: the activations, not the model state, where it is so."""
    code, out, _ = run_cli(capsys, "--search", *extra)
    assert code == 0 and "0 fit" in out and reason in out, out


def test_the_smallest_runs_file_docs_planner_shows_plans(tmp_path, capsys) -> None:
    """docs/planner.md's "Someone else's runs" gives the smallest file --validate takes: it plans."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "planner.md").read_text()
    block = doc.split("The smallest file that plans:", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    runs = tmp_path / "mine.toml"
    runs.write_text(block)
    assert main(["plan", "--validate", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "my-8b" in out and "tokens/s/GPU" in out


def test_a_cpu_run_is_planned_with_the_threads_it_ran_with(capsys, tmp_path, monkeypatch) -> None:
    """On a CPU device a rank computes with its share of the machine's cores (`fivefold train` gives
    each of n local ranks cores // n threads, and records them in run.json); the per-op host work of
    each block does not shrink with them. A run directory is planned with its own threads, also on a
    calibrated file, which does not keep the threads of the run it was fitted to."""
    import dataclasses

    from fivefold.config import Layout, RunConfig, TrainSpec, load_hardware, load_model
    from fivefold.plan.compute import on_this_host

    cpu = load_hardware("cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert on_this_host(cpu, 1, 8).threads_per_rank == 3  # as train would set them here
    assert on_this_host(load_hardware("h100-80gb"), 1, 8).threads_per_rank == 0  # a GPU: no threads
    model, shape = load_model("small"), TrainShape(seq_len=256, global_batch=4, micro_batch=4, act_bytes=4)
    one, two = (
        plan(model, dataclasses.replace(cpu, threads_per_rank=t), Layout().resolve(1), shape) for t in (1, 2)
    )
    # two threads halve the compute, not the blocks' dispatch
    dispatch = 3 * cpu.block_dispatch_us * 1e-6 * (model.layers + 1)
    assert two.step_time_s - dispatch == pytest.approx((one.step_time_s - dispatch) / 2, rel=0.02)

    cfg = RunConfig(model=model, train=TrainSpec(seq_len=256, micro_batch=4, global_batch=4))
    cfg.layout = cfg.layout.resolve(1)
    steps = [{"step": i, "step_time_s": t} for i, t in enumerate((1.0, 0.05, 0.05), 1)]
    for threads in (1, 2):
        run = tmp_path / f"t{threads}"
        run.mkdir()
        (run / "config.toml").write_text(cfg.to_toml())
        (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        facts = {"world": 1, "mfu_peak_from": "cpu", "threads_per_rank": threads}
        (run / "run.json").write_text(json.dumps(facts))
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert main(["plan", "--validate", str(tmp_path / "t1"), str(tmp_path / "t2"), "--json"]) == 0
    runs = {r["run"]: r["predicted"] for r in json.loads(capsys.readouterr().out)["as_shipped"]["runs"]}
    assert 1.3 * runs["t2"] < runs["t1"] < 2 * runs["t2"]  # each run its own threads
    cal = tmp_path / "cal.toml"
    assert main(["plan", "--calibrate", str(tmp_path / "t2"), "--out", str(cal)]) == 0
    assert "threads_per_rank = 0" in cal.read_text()
    # one thread count fits one rate per core: the calibration says other counts are extrapolated
    assert "every run here ran 2 thread(s) a rank" in capsys.readouterr().err
    both = [str(tmp_path / "t1"), str(tmp_path / "t2")]
    assert main(["plan", "--calibrate", *both, "--out", str(tmp_path / "both.toml")]) == 0
    assert "thread(s) a rank" not in capsys.readouterr().err
    argv = ["plan", "--validate", str(tmp_path / "t1"), str(tmp_path / "t2"), "--hardware", str(cal)]
    assert main([*argv, "--json"]) == 0
    runs = {r["run"]: r["predicted"] for r in json.loads(capsys.readouterr().out)["as_shipped"]["runs"]}
    assert runs["t1"] > 1.3 * runs["t2"]


def test_validate_and_report_set_a_run_directorys_measured_memory_beside_the_plan(capsys, tmp_path) -> None:
    """A run directory's metrics carry rank 0's weights, gradients, optimizer state and saved
    activations; `plan --validate` sets each beside the layout plan of rank 0's stage, which counts
    them as the runtime holds them (here the exact step's figures, which verify meets to the byte)."""
    from fivefold.config import Layout, RunConfig, TrainSpec, load_model
    from fivefold.plan.activations import planned_activations
    from fivefold.plan.step import plan_step

    model = load_model("tiny")
    layout = Layout(fsdp=2).resolve(2)
    cfg = RunConfig(model=model, train=TrainSpec(seq_len=64, micro_batch=2, global_batch=8), layout=layout)
    coords = {"pp": 0, "dp": 0, "fsdp_cp": 0, "tp": 0, "cp": 0, "ep": 0}
    state = plan_step(model, layout, 2, 64, 2, "fp32", coords).state
    saved = planned_activations(model, layout, 2, 64, 2, "fp32", coords)
    run = tmp_path / "fsdp2"
    run.mkdir()
    (run / "config.toml").write_text(cfg.to_toml())
    memory = {**state, "activations": int(saved), "rss_peak": 1 << 28}
    steps = [{"step": i, "loss": 5.0, "step_time_s": 0.05, "memory": memory} for i in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert main(["plan", "--validate", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["memory"]
    assert {r["part"] for r in rows} == {"params", "grads", "optimizer", "activations"}
    assert all(r["planned"] == r["measured"] for r in rows), rows
    assert main(["plan", "--validate", str(run)]) == 0
    out = capsys.readouterr().out
    assert "rank 0's memory" in out and "+0.0%" in out
    # `fivefold report` sets them beside the plan too
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "memory of rank 0" in out
    line = next(x for x in out.splitlines() if "saved activations" in x)
    assert f"{saved / 1e6:.3f} MB  (plan {saved / 1e6:.3f})" in line


def test_the_plan_names_what_its_buffers_hold(capsys) -> None:
    """The buffers bar is several things: the text says which, in the chart's unit."""
    argv = ["plan", "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--fsdp", "8", "--zero", "2"]
    assert main([*argv, "--sp", "--seq-len", "8192", "--global-batch", "64"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("(buffers:"))
    assert "logits" in line and "compute-dtype weight copies" in line and "GB" in line


def test_a_serving_plan_says_which_training_flags_it_ignores(capsys) -> None:
    """--mode inference has no optimizer, backward or micro-batches: each training flag given is
    named once on stderr, and the serving plan stands (the training plan does the same for --batch)."""
    argv = ["plan", "--model", "tiny", "--hardware", "cpu", "--gpus", "2", "--mode", "inference", "--tp", "2"]
    assert main(argv) == 0
    assert "note:" not in capsys.readouterr().err
    assert main([*argv, "--zero", "0", "--compile", "--recompute", "full", "--micro-batch", "2"]) == 0
    err = capsys.readouterr().err
    for flag in ("--zero", "--compile", "--recompute", "--micro-batch"):
        assert f"note: {flag} is a flag of a training plan" in err, flag
    # flags whose defaults are values or that serving has no use for are named as well, and --dtype,
    # which serving's weights and KV cache do follow, changes the plan instead
    training = ["--trainer", "megatron", "--sp", "--cp-impl", "ulysses", "--attention", "flash3"]
    assert main([*argv, *training]) == 0
    err = capsys.readouterr().err
    for flag in ("--trainer", "--sp", "--cp-impl", "--attention"):
        assert f"note: {flag} is a flag of a training plan" in err, flag
    weights = {}
    for dtype in ("bf16", "fp32"):
        assert main([*argv, "--dtype", dtype, "--json"]) == 0
        out = capsys.readouterr()
        assert "note:" not in out.err
        weights[dtype] = json.loads(out.out)["memory"]["params"]
    assert weights["fp32"] == 2 * weights["bf16"]


def test_the_nearest_fit_of_a_named_trainer_is_one_it_runs(capsys) -> None:
    """Where the typed flags cannot fit, the free search's nearest layout stays among what `--trainer`
    runs (nanotron: no ZB-V, ZeRO-1 at most), as the pinned search already did."""
    argv = ["plan", "--model", "llama3-70b", "--gpus", "64", "--tp", "1", "--pp", "1", "--dp", "64"]
    argv += ["--zero", "0", "--seq-len", "4096", "--global-batch", "64", "--trainer", "nanotron", "--json"]
    assert main(argv) == 0
    nearest = json.loads(capsys.readouterr().out)["nearest_fit"]
    assert nearest is not None and not nearest["keeps_given_flags"]
    layout = nearest["plan"]["layout"]
    assert layout["pp_schedule"] in ("1f1b", "gpipe") and layout["zero"] <= 1, layout
    assert "--trainer nanotron" in nearest["command"]


def test_a_serving_plan_notes_what_its_figures_assume(capsys) -> None:
    """A serving plan says what its numbers do not show, in the text and in --json, as a training
    plan does: an uneven layer split, KV heads held whole past tp = kv_heads, one batch in a pipeline."""
    argv = [
        "plan",
        "--model",
        "llama3-70b",
        "--hardware",
        "h100-80gb",
        "--mode",
        "inference",
        "--context",
        "4096",
    ]
    assert main([*argv, "--gpus", "8", "--tp", "8", "--json"]) == 0
    tp8 = json.loads(capsys.readouterr().out)
    assert tp8["notes"] == []  # 8 KV heads on 8 ranks, one stage
    assert main([*argv, "--gpus", "24", "--tp", "8", "--pp", "3", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("80 layers do not split evenly over pp 3: stages hold 26 to 27" in n for n in notes)
    assert any("one batch passing the 3 stages" in n for n in notes)
    assert main([*argv, "--gpus", "16", "--tp", "16", "--json"]) == 0
    wide = json.loads(capsys.readouterr().out)
    assert any("each head's cache is whole on 2 ranks" in n for n in wide["notes"])
    assert wide["memory"]["kv_cache"] == tp8["memory"]["kv_cache"]  # as the note says
    assert wide["memory"]["params"] < 0.6 * tp8["memory"]["params"]
    assert main([*argv, "--gpus", "16", "--tp", "16"]) == 0
    assert "note: tp 16 over 8 KV head(s)" in capsys.readouterr().out


def test_a_calibration_no_knob_can_reach_is_refused(capsys, tmp_path) -> None:
    """Steps of a million seconds: the fit runs every knob to the end of its range and still misses by
    orders of magnitude. The calibration names the run and writes nothing, where it wrote a file of
    knobs at their floors and exited 0; a run with its threads unrecorded gets no '0 thread(s)' note."""
    run = _small_dp2_run(tmp_path / "run-slow")
    _write_steps(run, (9e6, 2e6, 1.9e6, 2e6))
    out_file = tmp_path / "cpu-here.toml"
    assert main(["plan", "--calibrate", str(run), "--out", str(out_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no knobs within their physical ranges" in err[0] and "run-slow" in err[0]
    assert not out_file.exists()
    (run / "run.json").write_text("not json")  # the run's facts (its threads) unreadable
    _write_steps(run, (9.0, 2.1, 1.9, 2.0))
    assert main(["plan", "--calibrate", str(run), "--out", str(out_file)]) == 0
    assert "0 thread(s)" not in capsys.readouterr().err


def test_a_serving_plan_holds_weights_as_generate_does(capsys) -> None:
    """Left out, the weights and KV cache are what `fivefold generate` holds a fivefold model in on a
    CPU device (fp32, the weights' own) and bf16 on GPUs; the JSON and the text say which."""
    argv = ["plan", "--model", "small", "--gpus", "2", "--tp", "2", "--mode", "inference"]
    widths = {}
    for hw in ("cpu", "h100-80gb"):
        assert main([*argv, "--hardware", hw, "--json"]) == 0
        served = json.loads(capsys.readouterr().out)
        widths[hw] = (served["dtype"], served["memory"]["params"])
        assert main([*argv, "--hardware", hw]) == 0
        assert f"weights and KV cache in {served['dtype']}" in capsys.readouterr().out.splitlines()[0]
    assert widths["cpu"][0] == "fp32" and widths["h100-80gb"][0] == "bf16"
    assert widths["cpu"][1] == 2 * widths["h100-80gb"][1]


@pytest.mark.parametrize(
    ("definition", "causal"),
    [
        ("MFU, no causal halving", False),
        ("non-causal", False),
        ("MFU, non causal", False),
        ("noncausal (full s^2)", False),
        ("attention counted without causal masking", False),
        ("attention not halved for causality", False),
        ("model FLOPs with causal attention", True),
        ("causal half counted; no recompute", True),
        ("MFU as plotted", False),
    ],
)
def test_a_flop_count_is_causal_only_where_its_definition_says_so(definition: str, causal: bool) -> None:
    from fivefold.plan.runs import counts_causal_half

    assert counts_causal_half({"flops_definition": definition}) is causal


def test_a_runs_facts_are_read_in_its_sources_words(capsys, tmp_path) -> None:
    """Words a user's own runs file says its facts in: each read as what it says, and what it denies
    ("no fp8", "non-interleaved") not read as what it names."""
    from fivefold.plan import validation as V
    from fivefold.plan.runs import load_runs, published_year

    def case(layout: str = "", hardware: str = "", measured: str = "", source: str = "a made-up source"):
        run = (
            BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")
            .replace("tp = 1\npp = 1", f"tp = 1\npp = 2\n{layout}")
            .replace(
                'gpu = "H100 80GB"', f'gpu = "H100 80GB"\n{hardware}' if "gpu =" not in hardware else hardware
            )
            .replace("tokens_per_s_per_gpu = 1000", measured or "tokens_per_s_per_gpu = 1000")
            .replace("a made-up source", source)
        )
        path = tmp_path / "runs.toml"
        path.write_text(run)
        return V.cases(load_runs(path))[0]

    assert case('precision = "bf16, no fp8"').inputs.shape.fp8 is False
    assert case('precision = "fp8 (Transformer Engine)"').inputs.shape.fp8 is True
    assert case('pipeline_schedule = "non-interleaved 1F1B"').inputs.layout.pp_schedule == "1f1b"
    assert case('pipeline_schedule = "Interleaved 1F1B"').inputs.layout.pp_schedule == "interleaved-1f1b"
    assert case('recompute = "activation checkpointing"').inputs.layout.recompute == "full"
    assert case('recompute = "no activation checkpointing"').inputs.layout.recompute == "none"
    assert case(hardware='gpu = "A100 (40 GiB)"').inputs.hw.gpu_memory_gb == 40
    hardware = case(measured='tflops_per_gpu = 150\ntflops_basis = "Hardware FLOPs (incl. recompute)"')
    assert hardware.target.metric == "TFLOP/s (hardware)"
    assert published_year({"source": "https://arxiv.org/abs/2211.05100"}) == 2022
    assert published_year({"source": "Dubey et al., arXiv:2407.21783"}) == 2024
    # a run whose axes do not make its GPUs is left out, cp unstated; a rate no run reaches likewise
    path = tmp_path / "two.toml"
    other = BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048")
    wrong = other.replace('id = "bad-run"', 'id = "wrong-world"').replace("tp = 1", "dp = 4\ntp = 4")
    idle = other.replace('id = "bad-run"', 'id = "idle"').replace(
        "tokens_per_s_per_gpu = 1000", "mfu = 1e-300"
    )
    path.write_text(other + wrong + idle)
    assert main(["plan", "--validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "run wrong-world: left out, its facts contradict: dp×fsdp×tp×pp×cp = 16 but gpus = 8" in err
    assert "run idle: left out" in err and "a unit slip?" in err
    assert "bad-run" in out and "e+" not in out


def test_validate_on_another_gpu_names_the_runs_it_moves(capsys, tmp_path) -> None:
    """--hardware plans every run on one device: a run stating another GPU is named, not moved quietly."""
    path = tmp_path / "runs.toml"
    path.write_text(BAD_RUN.replace("vocab = 32000", "vocab = 32000\nseq_len = 2048"))
    assert main(["plan", "--validate", str(path), "--hardware", "a100-80gb"]) == 0
    err = capsys.readouterr().err
    assert "note: --hardware a100-80gb (312 TFLOP/s, 80 GB) plans every run on it" in err
    assert "1 state another GPU: bad-run (h100-80gb)" in err
    assert main(["plan", "--validate", str(path), "--hardware", "h100-80gb"]) == 0
    assert "another GPU" not in capsys.readouterr().err


THEIR_NAMES = """
[[run]]
id = "moe-run"
source = "a made-up source"
[run.hardware]
gpu = "H100 80GB"
[run.model]
num_layers = 32
hidden_size = 4096
num_attention_heads = 32
vocab_size = 32000
seq_length = 4096
intermediate_size = 14336
num_local_experts = 8
top_k = 2
[run.layout]
gpus = 8
tensor_model_parallel_size = 2
pp = 1
ep = 4
global_batch_size = 64
micro_batch_sz = 1
[run.measured]
tokens_per_s_per_gpu = 1000
"""


def test_a_runs_file_in_another_frameworks_key_names(capsys, tmp_path) -> None:
    """HF's and Megatron's names for a run's facts read as this file's; a key the reader does not take
    is named once with the one it most likely meant, not planned around in silence."""
    from fivefold.plan import validation as V
    from fivefold.plan.runs import load_runs

    theirs = tmp_path / "theirs.toml"
    theirs.write_text(THEIR_NAMES)
    ours = tmp_path / "ours.toml"
    ours.write_text(
        THEIR_NAMES.replace("num_layers", "layers").replace("hidden_size", "hidden")
        .replace("num_attention_heads", "heads").replace("vocab_size", "vocab")
        .replace("seq_length", "seq_len")
        .replace("intermediate_size", "ffn_hidden").replace("num_local_experts", "experts")
        .replace("top_k", "experts_per_token").replace("tensor_model_parallel_size", "tp")
        .replace("global_batch_size", "global_batch").replace("micro_batch_sz", "micro_batch")
    )  # fmt: skip
    (a,), (b,) = V.cases(load_runs(ours)), V.cases(load_runs(theirs))
    assert a.inputs.model == b.inputs.model and b.inputs.model.experts == 8
    assert b.inputs.model.expert_ffn_hidden == 14336  # an expert without its own width has the model's
    assert b.inputs.layout.tp == 2 and b.inputs.shape.global_batch == 64 == a.inputs.shape.global_batch
    assert main(["plan", "--validate", str(theirs)]) == 0
    err = capsys.readouterr().err
    assert "note: run moe-run: layout.micro_batch_sz is not read (planned without it)" in err
    assert "(did you mean micro_batch?)" in err and err.count("is not read") == 1
    assert main(["plan", "--validate", str(ours)]) == 0
    assert "is not read" not in capsys.readouterr().err
