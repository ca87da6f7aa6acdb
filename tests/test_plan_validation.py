"""Predicted vs published for every run of ../shared/reference/published_runs.toml.

Bounds (stated in docs/planner.md): step time, TFLOP/s, MFU and HFU within 16% per run and 8% on
average with the presets' knobs (fitted to every bundled source, not to these runs alone); analytic
activation memory within 1% and Figure 7's activation ratios within 2%; model-state
memory within 10% (we count the embedding the first pipeline stage really holds; the paper's formula
leaves it out); the ZeRO example exactly, up to the paper's rounding to 0.1 GB.
"""

from __future__ import annotations

import pytest

from fivefold.errors import FivefoldError
from fivefold.plan.runs import builtin_paths
from fivefold.plan.validation import compare, load_runs, table, validate

REFERENCE = builtin_paths()[0]  # the bundled copy of the published set

TIME_METRICS = (
    "step time s",
    "TFLOP/s (hardware)",
    "TFLOP/s (model)",
    "MFU",
    "HFU",
    "layer forward ms",
    "layer backward ms",
)


@pytest.fixture(scope="module")
def results():
    out, skipped = {}, []
    for run in load_runs(REFERENCE):
        try:
            out[run["id"]] = compare(run)
        except (FivefoldError, KeyError, TypeError, ValueError) as exc:  # a layout fivefold cannot express
            skipped.append(f"{run['id']}: {exc}")
    rows = [row for _, comparisons in out.values() for row in comparisons]
    print("\n" + table(rows) + "".join(f"\nskipped {line}" for line in skipped))
    return out, rows


def test_time_and_throughput_within_bounds(results) -> None:
    _, rows = results
    timed = [r for r in rows if r.metric in TIME_METRICS]
    assert len(timed) >= 30
    worst = max(timed, key=lambda r: abs(r.error))
    # the knobs are fitted to all the bundled sources, not to these 2021-22 runs alone
    assert abs(worst.error) <= 0.16, f"{worst.run} {worst.metric}: {worst.error:+.1%}"
    mean = sum(abs(r.error) for r in timed) / len(timed)
    assert mean <= 0.08, f"mean |error| {mean:.1%}"


def test_memory_within_bounds(results) -> None:
    _, rows = results
    for r in rows:
        if r.metric == "activations GiB":
            assert abs(r.error) <= 0.01, (r.run, r.error)
        elif r.metric == "activations % of base":  # Figure 7, read off a chart
            assert abs(r.error) <= 0.02, (r.run, r.error)
        elif r.metric == "model state GiB":
            assert abs(r.error) <= 0.10, (r.run, r.error)
        elif r.metric == "model state GB":  # ZeRO Figure 1, rounded to 0.1 GB by the paper
            assert abs(r.predicted - r.published) <= 0.05, (r.run, r.predicted)


def test_rankings_follow_published_runs(results) -> None:
    plans, _ = results

    def step(run_id: str) -> float:
        return plans[run_id][0].step_time_s

    # selective + sequence parallel is faster than full recompute, as Table 5 measured
    for size in ("22b", "175b", "530b", "1t"):
        assert step(f"korthikanti-{size}-seq-selective") < step(f"korthikanti-{size}-full-recompute")
    # adding 8-way data parallelism at a fixed batch per replica costs a little efficiency
    single = plans["korthikanti-530b-seq-selective"][0]
    scaled = plans["korthikanti-530b-dp8-2240gpu-seq-selective"][0]
    assert scaled.mfu < single.mfu
    assert scaled.step_time_s > single.step_time_s
    # weak scaling in the Megatron table: the largest models reach the highest TFLOP/s
    small = plans["megatron-a100-2021-1.7b"][0].hardware_tflops_per_gpu
    large = plans["megatron-a100-2021-1t"][0].hardware_tflops_per_gpu
    assert large > small
    # every layout that was run fits; the no-recompute baselines of Figure 1 do not fit 80 GB
    runs = {run["id"]: run for run in load_runs(REFERENCE)}
    for run_id, (p, _) in plans.items():
        if p is None:
            continue
        if runs[run_id]["kind"] == "measured":
            assert p.fits, run_id
        if run_id.endswith("no-recompute-analytic"):
            assert not p.fits, run_id


def test_llama3_405b_table4() -> None:
    """Dubey et al. 2024 (Llama 3), Table 4: bf16 MFU of 405B on H100 (causal attention FLOPs).

    Layout details the paper leaves open are fixed here: interleaved 1F1B with 4 chunks per rank,
    micro-batch 1, the optimizer sharded over the data-parallel ranks (zero 1), all-gather CP,
    Hopper-native attention and tp communication overlap.
    """
    from fivefold.config import Layout, load_hardware, load_model
    from fivefold.plan import TrainShape, plan

    model, hw = load_model("llama3-405b"), load_hardware("h100-80gb")
    rows = ((8192, 1, 64, 8192, 32, 0.43), (16384, 1, 128, 8192, 16, 0.41), (16384, 16, 8, 131072, 16, 0.38))
    for gpus, cp, dp, seq, per_replica, published in rows:
        lay = Layout(
            dp=dp,
            tp=8,
            cp=cp,
            pp=16,
            zero=1,
            sp=True,
            pp_schedule="interleaved-1f1b",
            virtual_stages=4,
            cp_impl="allgather",
        ).resolve(gpus)
        # a tuned Hopper stack: Hopper-native attention, tp collectives overlapped with the matmuls,
        # context parallelism that skips the key blocks above the causal diagonal, and the optimizer
        # sharded as Megatron's distributed optimizer does it (not torch's ZeroRedundancyOptimizer)
        shape = TrainShape(
            seq_len=seq,
            global_batch=per_replica * dp,
            attention="flash3",
            tp_overlap=True,
            tp_backward_overlap=True,
            cp_causal_skip=True,
            zero1_broadcasts=False,
        )
        p = plan(model, hw, lay, shape)
        # held out from the fit (the paper is not among the bundled runs): +0% and -7% at 8k tokens,
        # -20% at 131k (the fitted attention efficiency is a mean over slower stacks)
        band = 0.10 if seq <= 8192 else 0.25
        assert p.mfu_causal == pytest.approx(published, rel=band), (gpus, seq, p.mfu_causal)


def test_reader_handles_other_published_formats(tmp_path) -> None:
    """GQA + context parallel on H100 with causal FLOPs, experts over data ranks, a GPU without preset."""
    (tmp_path / "runs.toml").write_text("""
[[run]]
id = "gqa-cp"
source = "a made-up source"
flops_definition = "model FLOPs with causal attention (half the square)"
[run.hardware]
gpu = "H100-SXM 80GB"
peak_bf16_tflops = 989
gpus_per_node = 8
[run.model]
layers = 32
hidden = 4096
ffn_hidden = 14336
heads = 32
kv_heads = 8
vocab = 128256
seq_len = 32768
[run.layout]
gpus = 64
tp = 4
cp = 4
pp = 1
zero_stage = 1
sequence_parallel = true
recompute = "selective"
micro_batch = 1
global_batch_tokens = 4194304
[run.measured]
mfu = 0.40
tokens_per_s = 250000.0

[[run]]
id = "moe-ep"
source = "another made-up source"
[run.hardware]
gpu = "V100-SXM2 32GB"
peak_bf16_tflops = 125
gpu_memory_gb = 32
gpus_per_node = 8
[run.model]
layers = 8
hidden = 1024
heads = 16
vocab = 32000
experts = 8
experts_per_token = 2
expert_ffn_hidden = 2816
seq_len = 2048
[run.layout]
gpus = 16
dp = 16
ep = 8
global_batch = 64
[run.measured]
iteration_time_s = 1.0
""")
    skipped: list[str] = []
    rows = validate(tmp_path / "runs.toml", skipped)
    assert not skipped
    metrics = {(r.run, r.metric) for r in rows}
    assert {("gqa-cp", "MFU"), ("gqa-cp", "tokens/s"), ("moe-ep", "step time s")} <= metrics
    assert all(r.predicted > 0 for r in rows)


def test_a_stated_optimizer_state_dtype_sets_the_optimizer_memory(tmp_path) -> None:
    """NeMo's Nemotron-4 340B recipe keeps apex DistributedFusedAdam's state in bf16 (`dtype: bf16`):
    6 bytes a parameter instead of 12, which is what lets it fit at tp 8 pp 8 on 128 H100s."""
    from fivefold.plan import validation as V
    from fivefold.plan.runs import load_runs as load_many

    nemotron = [r for r in load_many(*builtin_paths()) if r["id"].startswith("dgxc-nemotron4-340b-h100-g128")]
    assert nemotron and nemotron[0]["layout"]["optimizer_state_dtype"] == "bf16"
    stated = V.build(nemotron[0])
    fp32 = V.build({**nemotron[0], "layout": {**nemotron[0]["layout"], "optimizer_state_dtype": "fp32"}})
    assert stated.shape.optimizer_bytes == 6 and fp32.shape.optimizer_bytes == 12
    plan_bf16 = V.plan(stated.model, stated.hw, stated.layout, stated.shape)
    plan_fp32 = V.plan(fp32.model, fp32.hw, fp32.layout, fp32.shape)
    assert plan_bf16.memory.optimizer == pytest.approx(plan_fp32.memory.optimizer / 2)
    assert plan_bf16.fits and not plan_fp32.fits  # the recipe's fact is what makes it fit
    # the ZeRO paper's K is read the same way; a dtype the planner does not know is one clear line
    k8 = {**nemotron[0], "layout": {**nemotron[0]["layout"], "optimizer_bytes_per_param": 8}}
    assert V.build(k8).shape.optimizer_bytes == 8
    bad = {**nemotron[0], "layout": {**nemotron[0]["layout"], "optimizer_state_dtype": "int4"}}
    with pytest.raises(FivefoldError, match="optimizer_state_dtype = 'int4'.*bf16"):
        V.build(bad)


@pytest.fixture(scope="module")
def loso():
    from fivefold.plan import validation as V

    cases = V.cases(load_runs_all())
    return V.cross_validate(cases)


def load_runs_all() -> list:
    from fivefold.plan.runs import load_runs as load_many

    return load_many(*builtin_paths())


def test_leave_one_source_out_beats_the_median_constant(loso) -> None:
    """The thresholds the planner reaches on unseen sources (docs/planner.md has the tables).

    Reached: mean ≤ 10% over all runs (9.13%) and over those without an `uncertain` note (7.4%), under
    half the median constant's error (43.4% over all runs), and every run that ran judged to fit. Not
    reached: worst ≤ 25% over all runs (nanotron's 80B on 4 nodes, whose shape, peak and network are
    unpublished, misses by 2.7×).
    """
    from fivefold.plan.result import MFU_BAND

    print("\n" + "\n".join(f"{p.run}: {p.error:+.1%}" for p in loso.predictions))
    every = loso.summary()
    certain = loso.summary(loso.certain())
    assert every["runs"] >= 130 and certain["runs"] >= 100
    assert every["mean"] <= 0.5 * every["constant_mean"], every
    assert every["mean"] <= 0.10, every
    assert certain["mean"] <= 0.10 and certain["mean"] <= 0.5 * certain["constant_mean"], certain
    assert every["not_fitting"] == 0, every
    by = {s: loso.summary(preds) for s, preds in loso.by_source().items()}
    assert by["NVIDIA/Megatron-LM"]["mean"] <= 0.10 and by["Dao-AILab/flash-attention"]["mean"] <= 0.10
    assert every["mean"] <= MFU_BAND  # the band printed with every plan is the cross-validated error


UNSEEN = """
[[run]]
id = "dense-pp-unstated"
source = "an unseen source"
kind = "measured"
unknown = ["micro_batch", "recompute", "pipeline_schedule"]
[run.hardware]
gpu = "H100 80GB"
gpus_per_node = 8
[run.model]
arch = "Llama (RMSNorm, RoPE, SwiGLU, GQA)"
layers = 80
hidden = 8192
ffn_hidden = 28672
heads = 64
kv_heads = 8
vocab = 128256
seq_len = 8192
[run.layout]
gpus = 1024
tp = 8
pp = 8
dp = 16
global_batch = 512
[run.measured]
mfu = 0.40

[[run]]
id = "volta"
source = "an unseen source"
kind = "measured"
[run.hardware]
gpu = "V100-SXM2 16GB"
[run.model]
layers = 24
hidden = 2048
heads = 16
vocab = 50257
seq_len = 1024
[run.layout]
gpus = 64
tp = 2
dp = 32
micro_batch = 4
global_batch = 512
recompute = "full"
[run.measured]
mfu = 0.3
"""


def test_unseen_runs_are_predicted_as_shipped_and_unknowns_filled(tmp_path, capsys) -> None:
    """A user's runs file is predicted with the shipped knobs (nothing refitted to it); what a run
    leaves unpublished is filled with the fastest choice that fits; GPUs of other generations
    get their preset (memory from the name, no FlashAttention on Volta)."""
    from fivefold.cli import main
    from fivefold.plan import validation as V

    path = tmp_path / "runs.toml"
    path.write_text(UNSEEN)
    cases = {c.id: c for c in V.cases(load_runs(path))}
    dense = cases["dense-pp-unstated"]
    assert dense.inputs.layout.pp_schedule == "interleaved-1f1b"  # a smaller bubble than 1F1B, still fits
    assert V.predict(dense).fits
    volta = cases["volta"].inputs.hw
    assert (volta.gpu_memory_gb, volta.peak_tflops, volta.flash_attention) == (16, 125, False)
    shipped = {p.run: p.predicted for p in V.as_shipped(list(cases.values())).predictions}
    refit = {p.run: p.predicted for p in V.in_sample(list(cases.values())).predictions}
    assert shipped == {c.id: V.predict(c).predicted for c in cases.values()}
    assert shipped != refit  # a fit to these two runs would move them
    assert main(["plan", "--validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "as shipped" in out and "in-sample" not in out


def test_validation_and_calibration_speak_json(tmp_path, capsys) -> None:
    """--json gives one object on stdout: each run's prediction beside the constant's, the summaries,
    the knobs, and the runs left out; the same numbers as the tables."""
    import json

    import tomli_w

    from fivefold.cli import main
    from fivefold.plan import validation as V
    from fivefold.plan.runs import source_of

    path = tmp_path / "runs.toml"
    path.write_text(UNSEEN)
    assert main(["plan", "--validate", str(path), "--json"]) == 0
    shipped = json.loads(capsys.readouterr().out)["as_shipped"]
    cases = V.cases(load_runs(path))
    assert [r["predicted"] for r in shipped["runs"]] == [V.predict(c).predicted for c in cases]
    assert shipped["all"]["runs"] == len(cases) and shipped["all"]["mean"] == pytest.approx(
        sum(abs(r["error"]) for r in shipped["runs"]) / len(cases)
    )
    # two sources are enough to leave each out in turn; a run without a throughput is named
    rows = [r for r in load_runs_all() if r["id"].startswith(("megatron-a100-2021-", "korthikanti"))]
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows[:3] + rows[-3:]]
    assert len({source_of(r) for r in rows}) == 2
    silent = {**rows[0], "id": "no-throughput", "measured": {}}
    two = tmp_path / "two.toml"
    two.write_text(tomli_w.dumps({"run": [*rows, silent]}))
    assert main(["plan", "--cross-validate", str(two), "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert set(both) == {"in_sample", "leave_one_source_out", "left_out"}
    assert len(both["leave_one_source_out"]["knobs"]) == 2
    assert len(both["in_sample"]["runs"]) == len(both["leave_one_source_out"]["runs"]) == len(V.cases(rows))
    assert any(line.startswith("run no-throughput: left out") for line in both["left_out"])
    assert main(["plan", "--calibrate", str(path), "--json"]) == 2  # two GPUs: one line, no JSON
    assert capsys.readouterr().out == ""


ACCUMULATION_ONLY = """
[[run]]
id = "zero3-batch-unstated"
source = "example"
kind = "measured"
unknown = ["micro_batch", "global_batch"]
[run.hardware]
gpu = "A100 80GB"
gpus_per_node = 8
[run.model]
layers = 24
hidden = 4096
heads = 32
vocab = 50257
seq_len = 1024
[run.layout]
gpus = 64
fsdp = 64
zero_stage = 3
grad_accum = 2
recompute = "full"
[run.measured]
tflops_per_gpu = 150.0
tflops_basis = "hardware"
"""


def test_an_unstated_global_batch_follows_the_filled_micro_batch(tmp_path) -> None:
    """Only the accumulation count published: every filled micro-batch brings its own global batch
    (micro-batch x accumulation x data ranks), so the fill is not stuck at one sequence per rank."""
    from fivefold.plan import validation as V

    path = tmp_path / "runs.toml"
    path.write_text(ACCUMULATION_ONLY)
    (case,) = V.cases(load_runs(path))
    assert "global_batch" in case.inputs.free
    variants = V._variants(case.inputs)
    assert {s.global_batch for _, s in variants} == {mb * 2 * 64 for mb in (1, 2, 4, 8, 16, 32)}
    assert all(s.global_batch == s.micro_batch * 2 * 64 for _, s in variants)
    assert case.inputs.shape.micro_batch > 1  # one sequence per rank keeps ZeRO-3 waiting on gathers
    assert case.inputs.shape.global_batch == case.inputs.shape.micro_batch * 2 * 64


MEGATRON_HOPPER = """
[[run]]
id = "megatron-h100-interleaved"
source = "NVIDIA/Megatron-LM README (scaling table)"
kind = "measured"
unknown = ["micro_batch", "recompute", "virtual_stages"]
[run.hardware]
gpu = "{gpu}"
gpus_per_node = 8
[run.model]
arch = "GPT (GeLU MLP 4h)"
layers = 96
hidden = 12288
heads = 96
vocab = 131072
seq_len = 4096
[run.layout]
gpus = 4608
tp = 8
pp = 12
pipeline_schedule = "interleaved"
global_batch = 1152
[run.measured]
mfu = 0.42
"""


def test_megatron_on_hopper_runs_transformer_engine_and_tunes_the_chunk_count(tmp_path) -> None:
    """Megatron-LM on Hopper is planned as Megatron-Core with Transformer Engine runs there (cuDNN
    attention, tp collectives overlapped), as NeMo's and dgxc's runs are; on A100 it keeps the plain
    kernels. An interleaved pipeline without a published chunk count is filled with the count that
    pays, even or not (a chunk may hold a layer more): 24 micro-batches over 12 stages leave v=2 a
    17% bubble."""
    from fivefold.plan import validation as V

    path = tmp_path / "runs.toml"
    path.write_text(MEGATRON_HOPPER.format(gpu="H100 80GB"))
    (hopper,) = V.cases(load_runs(path))
    assert hopper.inputs.shape.attention == "flash3" and hopper.inputs.shape.tp_overlap
    assert "virtual_stages" in hopper.inputs.free
    chunks = {lay.virtual_stages for lay, _ in V._variants(hopper.inputs)}
    assert chunks == set(range(2, 9))  # 8 layers a stage
    assert hopper.inputs.layout.virtual_stages > 2
    path.write_text(MEGATRON_HOPPER.format(gpu="A100 80GB"))
    (ampere,) = V.cases(load_runs(path))
    assert ampere.inputs.shape.attention == "flash" and not ampere.inputs.shape.tp_overlap


ONE_GPU_NAME = """
[[run]]
id = "{id}"
source = "an unseen source"
kind = "measured"
[run.hardware]
gpu = "{gpu}"
[run.model]
layers = 12
hidden = 1024
heads = 16
vocab = 32000
seq_len = 2048
[run.layout]
gpus = 16
tp = 1
dp = 16
micro_batch = 1
global_batch = 64
[run.measured]
mfu = 0.4
"""


def test_export_and_other_accelerators_get_their_own_presets(tmp_path) -> None:
    """A run's GPU name picks the most specific preset: the H800 and A800 carry their cut NVLink (200 GB/s
    per direction, not the H100's or A100's) and keep their generation's fitted knobs; "H20" does not
    swallow the H200 or GH200; a TPU v5e run, with no GPU in its name, is planned."""
    from fivefold.plan import validation as V
    from fivefold.plan.runs import family

    names = {
        "h800": "H800 SXM5 80GB",
        "a800": "A800-SXM4-80GB",
        "h200": "NVIDIA H200",
        "gh200": "GH200",
        "h20": "H20 96GB",
        "v5e": "TPU v5e",
        "h100_96": "H100 96GB HBM2e",
        "pcie": "NVIDIA H100 PCIe",
        "nvl": "H100 NVL",
        "ampere": "NVIDIA Ampere GPUs",  # a generation without its part: that generation's training GPU
        "ampere_40": "Ampere 40GB",
    }
    path = tmp_path / "runs.toml"
    path.write_text("".join(ONE_GPU_NAME.format(id=k, gpu=g) for k, g in names.items()))
    cases = {c.id: c for c in V.cases(load_runs(path))}
    hw = {k: c.inputs.hw for k, c in cases.items()}
    assert (hw["h800"].name, hw["h800"].intra_node_gbps, family(hw["h800"])) == ("h800", 200, "hopper")
    assert (hw["a800"].name, hw["a800"].intra_node_gbps, family(hw["a800"])) == ("a800-80gb", 200, "a100")
    assert hw["h800"].peak_tflops == hw["h200"].peak_tflops == 989
    assert (hw["h200"].name, hw["gh200"].name, hw["h20"].name) == ("h200", "h100-80gb", "h20")
    assert (hw["h20"].peak_tflops, hw["h20"].gpu_memory_gb, family(hw["h20"])) == (148, 96, "hopper")
    assert (hw["v5e"].name, family(hw["v5e"])) == ("tpu-v5e", "other")
    # the PCIe and NVL cards: their own clocks and memory, the H100's knobs
    assert (hw["pcie"].peak_tflops, hw["pcie"].gpu_memory_gb, family(hw["pcie"])) == (756, 80, "hopper")
    assert (hw["nvl"].peak_tflops, hw["nvl"].gpu_memory_gb, family(hw["nvl"])) == (835, 94, "hopper")
    # a preset's name follows the memory the run states, and keeps its generation's knobs
    assert (hw["h100_96"].name, hw["h100_96"].gpu_memory_gb, family(hw["h100_96"])) == (
        "h100-96gb",
        96,
        "hopper",
    )
    assert (hw["ampere"].name, family(hw["ampere"])) == ("a100-80gb", "a100")
    assert (hw["ampere_40"].gpu_memory_gb, family(hw["ampere_40"])) == (40, "a100")
    prediction = V.predict(cases["v5e"])
    assert prediction.fits and prediction.predicted > 0


def _typed_run(source: str, gpu: str, model: dict, layout: dict, measured: dict) -> dict:
    """One run as a runs file from elsewhere types it (id "r", kind measured)."""
    return {
        "id": "r",
        "source": source,
        "kind": "measured",
        "hardware": {"gpu": gpu},
        "model": model,
        "layout": layout,
        "measured": measured,
    }


def test_runs_published_before_flash_attention_plan_materialised_scores() -> None:
    """A run's year (read from its source) decides the attention kernel it left unstated: up to 2022
    the scores were materialised; later, or with no year, FlashAttention; a trainer that says (the
    FlashAttention repository) or a stated `attention` wins. So the shared reference file, which lacks
    the bundled copy's derived `attention` keys, plans its 2021-22 runs as the bundled copy does."""
    from fivefold.plan.runs import build, published_year

    assert published_year({"source": "Korthikanti et al. 2022 (arXiv:2205.05198) Table 3"}) == 2022
    assert published_year({"source": "README @50a4b5fa (2021-04-08) images/cases_april2021.png"}) == 2021
    assert published_year({"source": "benchmarks/llama3_h100_202412_torchtitan.md @b5bcd76c"}) == 2024
    assert published_year({"source": "mosaicml/llm-foundry README @8c8dd48f"}) is None

    def run(source: str, **layout) -> dict:
        return _typed_run(
            source,
            "A100 80GB",
            {"layers": 4, "hidden": 1024, "heads": 16, "vocab": 32000, "seq_len": 2048},
            {"gpus": 8, "tp": 1, "pp": 1, "global_batch": 8, **layout},
            {"tflops_per_gpu": 100.0},
        )

    assert build(run("Narayanan et al. 2021 (SC21)")).shape.attention == "materialized"
    assert build(run("a 2023 blog post")).shape.attention == "flash"
    assert build(run("a table without a date")).shape.attention == "flash"
    assert build(run("Dao-AILab/flash-attention training/README.md (2022)")).shape.attention == "flash"
    assert build(run("Narayanan et al. 2021", attention="flash")).shape.attention == "flash"


def test_a_runs_year_says_what_its_trainer_had_then() -> None:
    """Unstated sequence parallelism and selective recompute (both Korthikanti et al. 2022, one Megatron
    release) are assumed only for runs published once the trainer had them: 2022 for Megatron, 2023 for
    Megatron-DeepSpeed (its rebase on Megatron-LM). A run up to 2019 ran unfused elementwise kernels.
    What a run states wins."""
    import dataclasses

    from fivefold.plan import plan
    from fivefold.plan import validation as V
    from fivefold.plan.runs import build

    def run(source: str, framework: str = "", **layout) -> dict:
        return _typed_run(
            source,
            "V100 32GB",
            {"layers": 24, "hidden": 3072, "heads": 32, "vocab": 51200, "seq_len": 1024},
            {"gpus": 64, "tp": 8, "pp": 1, "global_batch": 64, "framework": framework, **layout},
            {"tflops_per_gpu": 30.0},
        )

    old, new = build(run("Shoeybi et al. 2019")), build(run("a 2024 report"))
    assert not old.layout.sp and not old.selective and not old.shape.fused
    assert new.layout.sp and new.selective and new.shape.fused
    ds = build(run("Smith et al. 2022", framework="Megatron-DeepSpeed"))
    assert not ds.layout.sp and not ds.selective and ds.shape.fused
    assert build(run("Smith et al. 2022", framework="Megatron-LM")).layout.sp
    assert build(run("Shoeybi et al. 2019", sequence_parallel=True)).layout.sp
    assert build(run("Shoeybi et al. 2019", torch_compile=True)).shape.fused
    # the fill then chooses among none and full only, and the older kernels plan slower
    old_fill = V.fill(old, V.START.apply(old.hw))
    assert old_fill.layout.recompute in ("none", "full")
    slow = plan(old.model, old.hw, old.layout, old.shape)
    fast = plan(new.model, new.hw, dataclasses.replace(new.layout, sp=False), new.shape)
    assert slow.compute_time_s > fast.compute_time_s


@pytest.mark.parametrize(
    ("framework", "interleaves"),
    [
        ("Megatron-LM", True),
        ("torchtitan", True),
        ("DeepSpeed", False),
        ("Megatron-DeepSpeed", False),
        ("nanotron", False),
    ],
)
def test_an_unpublished_schedule_is_filled_from_the_trainers_own(framework: str, interleaves: bool) -> None:
    """Whether an unpublished schedule may be interleaved follows the schedules the trainer runs (the
    facts `plan --search --trainer` keeps to): DeepSpeed's pipeline engine and nanotron's do not."""
    from fivefold.plan.runs import build

    model = {"layers": 32, "hidden": 2048, "heads": 16, "vocab": 32000, "seq_len": 2048}
    layout = {
        "gpus": 16,
        "tp": 1,
        "pp": 4,
        "dp": 4,
        "zero_stage": 1,
        "global_batch": 64,
        "framework": framework,
    }
    inputs = build(_typed_run("a 2024 report", "H100 80GB", model, layout, {"mfu": 0.4}))
    assert inputs.interleaved == interleaves and "pipeline_schedule" in inputs.free


def test_a_tpu_run_is_planned_as_xla_compiles_it_whatever_its_framework_says() -> None:
    """Nothing but XLA drives a TPU: a run on one that names no framework (PaLM's tp 12 over 2,048
    tokens, 2022) keeps its activations sharded over tp, as a JAX run does, not replicated."""
    from fivefold.plan.runs import build
    from fivefold.plan.trainers import runs_on_xla

    assert runs_on_xla("", "TPU v4") and runs_on_xla("MaxText", "H100") and not runs_on_xla("", "A100")
    run = _typed_run(
        "Chowdhery et al. 2022",
        "TPU v4",
        {"layers": 8, "hidden": 1536, "heads": 12, "vocab": 32000, "seq_len": 2048},
        {"gpus": 48, "tp": 12, "pp": 1, "dp": 4, "global_batch": 64},
        {"mfu": 0.4},
    )
    tpu = build(run)
    assert tpu.layout.sp and tpu.shape.fused
    gpu = build({**run, "hardware": {"gpu": "A100 80GB"}, "layout": {**run["layout"]}})
    assert not gpu.layout.sp  # Megatron's SP splits each sequence evenly: 12 does not divide 2,048


@pytest.mark.parametrize(
    ("stated", "policy"),
    [
        ({"recompute": True}, "full"),
        ({"recompute": "no"}, "none"),
        ({"recompute": "Full (uniform)"}, "full"),
        ({"activation_checkpointing": True}, "full"),  # MosaicML's column, as a yes or no
        ({"activation_checkpointing": False}, "none"),
    ],
)
def test_a_recompute_stated_as_yes_or_no_is_read(stated: dict, policy: str) -> None:
    from fivefold.plan.runs import build

    model = {"layers": 4, "hidden": 1024, "heads": 16, "vocab": 32000, "seq_len": 2048}
    layout = {"gpus": 8, "fsdp": 8, "global_batch": 8, **stated}
    inputs = build(_typed_run("a 2023 table", "A100 80GB", model, layout, {"tflops_per_gpu": 100.0}))
    assert inputs.recompute_known and inputs.layout.recompute == policy


def test_an_unpublished_schedule_is_filled_with_the_chunk_count_that_pays(tmp_path) -> None:
    """A deep pipeline with few micro-batches and no published schedule: its authors would interleave
    finely (up to 8 chunks of one layer here), not stop at 2 or 4."""
    from fivefold.plan import validation as V

    (tmp_path / "runs.toml").write_text("""
[[run]]
id = "deep-pipeline"
kind = "measured"
source = "a made-up source"
[run.hardware]
gpu = "H100-SXM 80GB"
peak_bf16_tflops = 989
gpus_per_node = 8
[run.model]
layers = 128
hidden = 4096
ffn_hidden = 14336
heads = 32
kv_heads = 8
vocab = 128256
seq_len = 4096
[run.layout]
gpus = 256
tp = 8
pp = 16
dp = 2
zero_stage = 1
sequence_parallel = true
recompute = "none"
micro_batch = 1
global_batch = 32
[run.measured]
mfu = 0.40
""")
    (case,) = V.cases(V.load_runs(tmp_path / "runs.toml"))
    layout = case.inputs.layout
    assert layout.pp_schedule == "interleaved-1f1b" and layout.virtual_stages > 4
    # the per-run table says what was chosen for the unpublished facts, and only for those
    assert V.predict(case).filled == f"interleaved-1f1b ×{layout.virtual_stages}"
    table = V.per_run_table(V.in_sample([case]))
    assert table.splitlines()[0].endswith("filled (unpublished)")
    assert table.splitlines()[1].endswith(f"interleaved-1f1b ×{layout.virtual_stages}")
    megatron = [c for c in V.cases(load_runs_all()) if c.id.startswith("megatron-a100-2021")]
    assert megatron and all(V.predict(c).filled == "" for c in megatron)  # every fact published


def test_a_run_that_gives_only_its_hfu_or_its_aggregate_rate_is_still_judged() -> None:
    """Megatron's 1.7B row states the same throughput three ways (137 TFLOP/s of hardware FLOPs per
    GPU, 4.4 PFLOP/s over 32 GPUs, 44% HFU of the A100's 312): each alone is a target, and the three
    judge the plan alike."""
    from fivefold.plan import validation as V

    (row,) = [r for p in builtin_paths() for r in load_runs(p) if r["id"] == "megatron-a100-2021-1.7b"]
    errors = {}
    for kept in (("tflops_per_gpu", "tflops_basis"), ("aggregate_pflops", "tflops_basis"), ("hfu",)):
        run = {**row, "measured": {k: row["measured"][k] for k in kept}}
        (case,) = V.cases([run])
        errors[kept[0]] = V.predict(case).error
    assert case.target.metric == "HFU"
    assert max(errors.values()) - min(errors.values()) < 0.01, errors
    with pytest.raises(FivefoldError, match="hfu is a fraction"):
        V.cases([{**row, "measured": {"hfu": 44}}])


def test_a_measured_run_without_a_throughput_is_named_not_dropped_silently(tmp_path, capsys) -> None:
    import tomli_w

    from fivefold.cli import main

    rows = [r for p in builtin_paths() for r in load_runs(p) if r["id"].startswith("megatron-a100-2021-")]
    silent, judged = ({k: v for k, v in r.items() if not k.startswith("_")} for r in rows[:2])
    silent["measured"] = {"memory_peak_gib_per_gpu": 30.0}
    path = tmp_path / "runs.toml"
    path.write_text(tomli_w.dumps({"run": [silent, judged]}))
    assert main(["plan", "--validate", str(path)]) == 0
    captured = capsys.readouterr()
    assert f"run {silent['id']}: left out, its [measured] table states no throughput" in captured.err
    assert judged["id"] in captured.out and silent["id"] not in captured.out


def test_a_users_runs_file_need_not_say_its_runs_were_measured(tmp_path, capsys) -> None:
    """`kind` is the reference files' word: a run of one's own without it is a measurement and is
    judged; an `analytic` run (a formula's figures) and one without a model shape are named as left
    out, with why; a `kind` that is no string is one line and exit 2."""
    import tomli_w

    from fivefold.cli import main

    rows = [r for p in builtin_paths() for r in load_runs(p) if r["id"].startswith("megatron-a100-2021-")]
    plain, formula, shapeless = ({k: v for k, v in r.items() if not k.startswith("_")} for r in rows[:3])
    del plain["kind"]
    plain["id"] = "a-run-of-ours-whose-id-is-longer-than-the-fifty-characters-a-column-once-kept"
    formula["kind"] = "analytic"
    shapeless["model"] = {k: v for k, v in shapeless["model"].items() if k != "layers"}
    path = tmp_path / "runs.toml"
    path.write_text(tomli_w.dumps({"run": [plain, formula, shapeless]}))
    assert main(["plan", "--validate", str(path)]) == 0
    captured = capsys.readouterr()
    judged = {line.split()[0] for line in captured.out.splitlines() if line.strip()}
    # (the first, 77 characters, whole: the table's column had cut ids at 49)
    assert plain["id"] in judged and formula["id"] not in judged and shapeless["id"] not in judged
    assert f"run {formula['id']}: left out, its kind 'analytic' is no measurement" in captured.err
    assert f"run {shapeless['id']}: left out, its [model] table states no shape" in captured.err
    plain["kind"] = 3
    path.write_text(tomli_w.dumps({"run": [plain]}))
    assert main(["plan", "--validate", str(path)]) == 2
    assert "kind must be" in capsys.readouterr().err


def test_a_tp_that_does_not_divide_the_sequence_is_planned_without_sp_or_named(tmp_path, capsys) -> None:
    """PaLM's tp 12 over 2,048 tokens: SP, unstated, is not assumed (it splits each sequence evenly);
    a run that states it is left out with its reason, and the other runs of the file are still judged;
    under JAX (XLA pads a short shard) SP stays on."""
    import tomli_w

    from fivefold.cli import main
    from fivefold.plan.runs import contradictions

    rows = [r for p in builtin_paths() for r in load_runs(p) if r["id"].startswith("megatron-a100-2021-")]
    unstated, stated, judged = ({k: v for k, v in r.items() if not k.startswith("_")} for r in rows[:3])
    for run in (unstated, stated):
        run["model"] = {**run["model"], "heads": 48, "kv_heads": 48, "hidden": 6144, "seq_len": 2048}
        run["layout"] = {**run["layout"], "tp": 12, "pp": 1}
        run["layout"]["gpus"] = 12 * run["layout"].get("dp", 1)
        run["layout"].pop("sequence_parallel", None)
        run["unknown"] = [k for k in run.get("unknown", []) if k != "sequence_parallel"]
    stated["id"], stated["layout"]["sequence_parallel"] = "stated-sp", True
    path = tmp_path / "runs.toml"
    path.write_text(tomli_w.dumps({"run": [unstated, stated, judged]}))
    assert main(["plan", "--validate", str(path)]) == 0
    captured = capsys.readouterr()
    rows = {line.split()[0]: line for line in captured.out.splitlines() if line.strip()}
    assert unstated["id"] in rows and judged["id"] in rows and "stated-sp" not in rows
    assert "run stated-sp: left out, its facts contradict: sequence_parallel" in captured.err
    assert "not a multiple of 12" in captured.err
    # XLA's partitioner pads a short shard: a JAX run keeps its activations sharded over tp, stated or not
    from fivefold.plan import validation as V

    xla = [{**run, "layout": {**run["layout"], "framework": "jax"}} for run in (unstated, stated)]
    assert not contradictions(xla[1])
    cases = V.cases(xla)
    assert [c.inputs.layout.sp for c in cases] == [True, True]
    megatron = V.cases([unstated])[0]
    assert not megatron.inputs.layout.sp
    assert V.predict(cases[0]).margin_gb > V.predict(megatron).margin_gb  # its activations over tp


@pytest.mark.parametrize(
    ("stated", "planned"),
    [
        ("DualPipe", "dualpipev"),
        ("DualPipeV", "dualpipev"),
        ("ZB-V", "zbv"),
        ("ZB-H1", "zero-bubble"),
        ("1F1B", "1f1b"),
        ("GPipe", "gpipe"),
        ("interleaved 1F1B", "interleaved-1f1b"),
        ("AFAB", "gpipe"),
        ("1F1B with VPP", "interleaved-1f1b"),
        ("LoopedBFS", "interleaved-1f1b"),
        ("PipeDream-Flush (1F1B)", "1f1b"),
    ],
)
def test_a_runs_files_schedule_name_is_read_as_the_planner_names_it(stated: str, planned: str) -> None:
    from fivefold.plan.runs import _schedule

    assert _schedule(stated, 16, 1) == planned
    if planned in ("dualpipev", "zbv"):  # two chunks a rank, as a run directory states them
        assert _schedule(stated, 16, 2) == planned
    for run_dir_name in ("1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev", "gpipe"):
        v = 2 if run_dir_name in ("interleaved-1f1b", "zbv", "dualpipev") else 1
        assert _schedule(run_dir_name, 4, v) == run_dir_name


@pytest.mark.parametrize(
    ("source", "framework", "trainer"),
    [
        ("NVIDIA/NeMo performance summary", "", "NVIDIA/NeMo"),  # a bundled source, as it is
        ("Jiang et al. 2024, Megatron-LM baseline", "", "NVIDIA/Megatron-LM"),
        ("BigScience 2022", "Megatron-DeepSpeed", "microsoft/Megatron-DeepSpeed"),
        ("Smith et al. 2022, Megatron DeepSpeed", "", "microsoft/Megatron-DeepSpeed"),
        ("BigScience BLOOM paper 2022", "", "microsoft/Megatron-DeepSpeed"),  # its fork
        ("Black et al. 2022 GPT-NeoX-20B", "", "microsoft/Megatron-DeepSpeed"),  # DeepSpeed's pipeline
        ("microsoft/DeepSpeed ZeRO-3 blog", "", "microsoft/DeepSpeed"),
        ("Some blog 2025", "torchtitan", "pytorch/torchtitan"),
        ("NeMo 24.07 recipes", "", "NVIDIA/NeMo"),
        ("Nemotron report 2024", "", "Nemotron"),  # not the framework's word
        ("Dubey et al. 2024", "", "Dubey"),  # no trainer named: no trainer facts
        ("Le Scao et al. 2022, the 176B model", "", "Le Scao"),  # the first author whole
        ("anything", "fivefold", "fivefold"),
    ],
)
def test_the_trainer_is_read_from_what_a_run_names(source: str, framework: str, trainer: str) -> None:
    from fivefold.plan.runs import trainer_name

    run = {"id": "r", "source": source, "layout": {"framework": framework} if framework else {}}
    assert trainer_name(run) == trainer


def test_deepspeeds_pipeline_engine_is_filled_with_1f1b_and_zero1(tmp_path) -> None:
    """Megatron-DeepSpeed's pipeline runs 1F1B only, and ZeRO-2/3 refuse a pipeline there: an MT-NLG
    shaped run that leaves both unstated is planned so; a trainer the run does not name may do either."""
    from fivefold.plan import validation as V

    run = {
        "id": "mtnlg-like",
        "source": "a 2022 report",
        "kind": "measured",
        "hardware": {"gpu": "A100 80GB", "gpus_per_node": 8},
        "model": {"layers": 105, "hidden": 20480, "heads": 128, "vocab": 51200, "seq_len": 2048},
        "layout": {"gpus": 3360, "tp": 8, "pp": 35, "dp": 12, "global_batch": 1920, "micro_batch": 1},
        "measured": {"tflops_per_gpu": 113},
    }
    deepspeed = {**run, "layout": {**run["layout"], "framework": "Megatron-DeepSpeed"}}
    ds, other = (V.cases([r])[0].inputs.layout for r in (deepspeed, run))
    assert (ds.pp_schedule, ds.virtual_stages, ds.zero, ds.fsdp) == ("1f1b", 1, 1, 1)
    assert (other.pp_schedule, other.zero) == ("interleaved-1f1b", 2)  # faster, and not DeepSpeed's


def test_an_unknown_hopper_trainer_since_2024_is_planned_with_flash3_class_attention() -> None:
    from fivefold.plan.runs import build

    def run(gpu: str, source: str, framework: str = "") -> dict:
        return {
            "id": "r",
            "source": source,
            "hardware": {"gpu": gpu},
            "model": {"layers": 2, "hidden": 256, "heads": 4, "seq_len": 1024},
            "layout": {"gpus": 8, "fsdp": 8, **({"framework": framework} if framework else {})},
        }

    assert build(run("H100 80GB", "Dubey et al. 2024")).shape.attention == "flash3"
    assert build(run("A100 80GB", "Dubey et al. 2024")).shape.attention == "flash"  # no FA3 on Ampere
    assert build(run("H100 80GB", "Someone 2023")).shape.attention == "flash"
    assert build(run("A100 80GB", "Someone 2021")).shape.attention == "materialized"
    # a trainer whose kernels are known keeps them: torchtitan's SDPA runs FlashAttention-2 on Hopper
    assert build(run("H100 80GB", "A blog 2025", "torchtitan")).shape.attention == "flash"
    assert build(run("H100 80GB", "A blog 2025", "MaxText (JAX)")).shape.attention == "flash3"


def test_sdpa_runs_cudnn_attention_on_hopper_from_torch_2_11() -> None:
    """torch's SDPA (fivefold's and torchtitan's attention) prefers cuDNN's fused kernels on Hopper and
    newer from torch 2.11 (measured: cuDNN's sm90 kernels on an H200): a run is planned with the kernel
    of the torch it names; fivefold's own run directories record theirs in run.json."""
    from fivefold.plan.runs import build
    from fivefold.plan.trainers import sdpa_attention

    assert sdpa_attention(True, "2.11.0+cu130") == "flash3" and sdpa_attention(True, "3.0") == "flash3"
    assert sdpa_attention(True, "2.10.1") == "flash" and sdpa_attention(True, "2.6.0a0+git") == "flash"
    assert sdpa_attention(False, "2.13.0") == "flash"  # no FlashAttention-3 class kernels on Ampere
    assert sdpa_attention(True, "") == "flash" and sdpa_attention(True, "nightly") == "flash"

    def run(gpu: str, framework: str, torch_version: str | None) -> dict:
        stated = {"torch_version": torch_version} if torch_version else {}
        return {
            "id": "r",
            "source": "A blog 2025",
            "hardware": {"gpu": gpu},
            "model": {"layers": 2, "hidden": 256, "heads": 4, "seq_len": 1024},
            "layout": {"gpus": 8, "fsdp": 8, "framework": framework, **stated},
        }

    assert build(run("H100 80GB", "torchtitan", None)).shape.attention == "flash"  # its published runs
    assert build(run("H100 80GB", "torchtitan", "2.11.0")).shape.attention == "flash3"
    assert build(run("H200", "fivefold", "2.10.0")).shape.attention == "flash"
    assert build(run("H200", "fivefold", "2.12.1+cu130")).shape.attention == "flash3"
    assert build(run("A100 80GB", "fivefold", "2.12.1")).shape.attention == "flash"
    # a fivefold run directory that predates the record: the torch installed here
    assert build(run("H200", "fivefold", None)).shape.attention == sdpa_attention(True)
    # a stated kernel still wins
    stated = run("H100 80GB", "torchtitan", "2.11.0")
    stated["layout"]["attention"] = "flash"
    assert build(stated).shape.attention == "flash"


def test_nanotrons_sharded_optimizer_reduces_after_the_backward() -> None:
    """nanotron with ZeRO-1 and fp32 accumulation builds no DDP: its gradient reduce-scatter and the
    shards' gather wait for the backward and the step; with ZeRO-0 its DDP overlaps them."""
    from fivefold.plan import plan
    from fivefold.plan.runs import build

    def run(zero: int, source: str = "huggingface/nanotron docs") -> dict:
        return {
            "id": "r",
            "source": source,
            "hardware": {"gpu": "H100 80GB"},
            "model": {"layers": 4, "hidden": 1024, "heads": 8, "seq_len": 2048},
            "layout": {"gpus": 16, "dp": 16, "zero_stage": zero},
        }

    def data_parallel(zero: int, source: str = "huggingface/nanotron docs") -> list:
        inputs = build(run(zero, source))
        p = plan(inputs.model, inputs.hw, inputs.layout, inputs.shape)
        return [c for c in p.comm if c.axis == "dp"]

    # the trainer fact travels as plan and CLI (`--trainer nanotron`) read it
    assert (
        not build(run(1)).shape.sharded_overlap and build(run(1, "NVIDIA/Megatron-LM")).shape.sharded_overlap
    )
    assert all(c.exposed_s == pytest.approx(c.time_s) for c in data_parallel(1))  # after the backward
    assert all(c.exposed_s < c.time_s for c in data_parallel(0))  # DDP: beside the backward
    assert all(c.exposed_s < c.time_s for c in data_parallel(1, "NVIDIA/Megatron-LM"))


def test_deepspeeds_pipeline_engine_waits_on_its_hand_overs_and_reduces_after_the_schedule() -> None:
    """DeepSpeed's pipeline engine (Megatron-DeepSpeed: BLOOM, MT-NLG) blocks on every stage hand-over
    and all-reduces the gradients once its schedule ends; Megatron's own hides both beside compute.
    Without sequence parallelism both send each tp rank's 1/tp of the activation (Megatron's
    scatter-gather, DeepSpeed's pipe_partitioned), where fivefold's runtime sends it whole."""
    import dataclasses

    from fivefold.plan import plan
    from fivefold.plan.runs import build

    def inputs(framework: str):
        return build(
            {
                "id": "r",
                "source": "a 2021 paper",  # before sequence parallelism
                "hardware": {"gpu": "A100 80GB"},
                "model": {"layers": 8, "hidden": 4096, "heads": 32, "seq_len": 2048},
                "layout": {
                    "gpus": 64,
                    "tp": 4,
                    "pp": 4,
                    "dp": 4,
                    "micro_batch": 1,
                    "global_batch": 64,
                    "framework": framework,
                },
            }
        )

    ds, megatron = inputs("Megatron-DeepSpeed"), inputs("Megatron-LM")
    assert not (ds.layout.sp or megatron.layout.sp)
    assert ds.shape.p2p_blocking and ds.shape.reduce_after_pipeline and ds.shape.pp_scatter
    assert not (megatron.shape.p2p_blocking or megatron.shape.reduce_after_pipeline)
    p_ds, p_mg = (plan(i.model, i.hw, i.layout, i.shape) for i in (ds, megatron))
    ds_send, mg_send = (next(c for c in p.comm if c.axis == "pp" and c.op == "send") for p in (p_ds, p_mg))
    m = p_ds.microbatches  # 16 a data rank: 4 transfers each, forward and backward, waited on
    assert m == 16 and ds_send.count == m  # as many receives beside them
    hand_overs = sum(c.exposed_s for c in p_ds.comm if c.axis == "pp" and c.op in ("send", "recv"))
    assert hand_overs == pytest.approx(4 * m * ds_send.time_s / ds_send.count)
    assert mg_send.exposed_s < ds_send.exposed_s / 4
    assert all(c.exposed_s == pytest.approx(c.time_s) for c in p_ds.comm if c.axis == "dp")
    assert any(c.exposed_s < c.time_s for c in p_mg.comm if c.axis == "dp")
    assert p_ds.step_time_s > p_mg.step_time_s
    # a quarter of the [s, h] bf16 activation per tp rank; fivefold's runtime sends it whole
    assert mg_send.bytes / mg_send.count == pytest.approx(2048 * 4096 * 2 / 4)
    whole = plan(
        megatron.model, megatron.hw, megatron.layout, dataclasses.replace(megatron.shape, pp_scatter=False)
    )
    whole_send = next(c for c in whole.comm if c.axis == "pp" and c.op == "send")
    assert whole_send.bytes / whole_send.count == pytest.approx(2048 * 4096 * 2)


def test_nanotrons_gradient_sync_and_gather_cost_what_its_code_issues() -> None:
    """nanotron's ZeRO-1 all-reduces the whole fp32 gradient, gathers the updated weights with a slice
    and a copy per parameter tensor and data rank from the host, and accumulates in fp32 with an add
    after each micro-batch; Megatron reduce-scatters, gathers one flat buffer, and fuses the add."""
    import dataclasses

    from fivefold.plan import plan
    from fivefold.plan.compute import FP32_ACCUMULATE_BYTES, Rates
    from fivefold.plan.dataparallel import EAGER_OP_S
    from fivefold.plan.runs import build

    def inputs(source: str, zero: int = 1):
        return build(
            {
                "id": "r",
                "source": source,
                "hardware": {"gpu": "H100 80GB"},
                "model": {"layers": 4, "hidden": 1024, "heads": 8, "seq_len": 2048},
                "layout": {"gpus": 16, "dp": 16, "zero_stage": zero, "micro_batch": 1, "global_batch": 64},
            }
        )

    nano, megatron = inputs("huggingface/nanotron docs"), inputs("NVIDIA/Megatron-LM")
    assert nano.shape.sharded_copies and nano.shape.fp32_accumulate_pass and nano.shape.block_tensors == 6
    assert not (megatron.shape.sharded_copies or megatron.shape.fp32_accumulate_pass)

    def run(i, **facts):
        shape = dataclasses.replace(i.shape, **facts)
        return plan(i.model, i.hw, i.layout, shape)

    p = run(nano)
    ops = {c.op for c in p.comm if c.axis == "dp"}
    assert ops == {"all_reduce", "all_gather"}  # the gradient all-reduced whole, not reduce-scattered
    assert {c.op for c in run(megatron).comm if c.axis == "dp"} == {"reduce_scatter", "all_gather"}
    # the host's copies: 6 tensors a block, the embedding, the final norm and the head, per data rank
    plain = run(nano, sharded_copies=False, fp32_accumulate_pass=False)
    copies = run(nano, fp32_accumulate_pass=False).optimizer_time_s - plain.optimizer_time_s
    assert copies == pytest.approx(2 * (4 * 6 + 3) * 16 * EAGER_OP_S)
    # the fp32 add streams every local parameter once a micro-batch (4 of them here)
    accumulate = run(nano, sharded_copies=False).optimizer_time_s - plain.optimizer_time_s
    rates = Rates.of(p.hardware, attention=p.shape.attention)
    assert p.microbatches == 4
    assert accumulate == pytest.approx(4 * FP32_ACCUMULATE_BYTES * p.params / rates.hbm, rel=1e-6)
    assert any("per-tensor copies" in n and "fp32 gradient accumulation" in n for n in p.notes)  # said
    # ZeRO-0 builds torch DDP: no sharded gather to copy back
    z0 = inputs("huggingface/nanotron docs", zero=0)
    assert run(z0, fp32_accumulate_pass=False).optimizer_time_s == pytest.approx(
        run(z0, sharded_copies=False, fp32_accumulate_pass=False).optimizer_time_s
    )


def test_checkpoints_on_the_host_cost_their_copies_both_ways() -> None:
    """Full recompute with its checkpoints offloaded (DeepSpeed's cpu_checkpointing) keeps no layer
    input on the device and pays each one's copy to the host and back, in series with the step."""
    import dataclasses

    from fivefold.plan import plan
    from fivefold.plan.compute import HOST_LINK_BPS
    from fivefold.plan.runs import build

    i = build(
        {
            "id": "r",
            "source": "microsoft/DeepSpeed docs",
            "hardware": {"gpu": "A100 80GB"},
            "model": {"layers": 4, "hidden": 1024, "heads": 8, "seq_len": 2048},
            "layout": {"gpus": 8, "fsdp": 8, "zero_stage": 3, "micro_batch": 2, "global_batch": 32},
        }
    )
    assert i.shape.grad_bytes == 2  # DeepSpeed reduces the 16-bit parameters' own gradients
    layout = dataclasses.replace(i.layout, recompute="full")
    shapes = (dataclasses.replace(i.shape, offload_checkpoints=o) for o in (True, False))
    on, off = (plan(i.model, i.hw, layout, shape) for shape in shapes)
    kept = 2 * 2048 * 1024 * i.shape.act_bytes  # a micro-batch's layer input
    assert on.microbatches == 2
    assert on.optimizer_time_s - off.optimizer_time_s == pytest.approx(2 * 2 * 4 * kept / HOST_LINK_BPS)
    assert on.memory.activations < off.memory.activations


def test_torchs_async_tp_leaves_the_backward_scatters_exposed() -> None:
    """torch's micro-pipelined TP (torchtitan's async TP) fuses a reduce-scatter only with the single
    matmul feeding it; the backward's scatters take a sum of matmuls and stay plain collectives, waited
    on. Transformer Engine's overlap hides them behind the backward's matmuls."""
    import dataclasses

    from fivefold.plan import plan
    from fivefold.plan.runs import build

    def run(source: str) -> dict:
        return {
            "id": "r",
            "source": source,
            "hardware": {"gpu": "H100 80GB"},
            "model": {"layers": 4, "hidden": 4096, "heads": 32, "kv_heads": 8, "seq_len": 8192},
            "layout": {"gpus": 8, "tp": 8, "async_tp": True, "micro_batch": 1, "global_batch": 1},
        }

    titan = build(run("pytorch/torchtitan benchmarks"))
    assert titan.shape.tp_overlap and not titan.shape.tp_overlap_backward_scatters
    assert build(run("NVIDIA/NeMo recipes")).shape.tp_overlap_backward_scatters

    def tp_rows(fact: bool) -> dict:
        shape = dataclasses.replace(titan.shape, tp_overlap_backward_scatters=fact)
        p = plan(titan.model, titan.hw, titan.layout, shape)
        return {c.op: c for c in p.comm if c.axis == "tp"}

    torch_tp, te_tp = tp_rows(False), tp_rows(True)
    backward_scatters = torch_tp["reduce_scatter"].time_s / 2  # half the scatters are the backward's
    exposed = {
        name: sum(c.exposed_s for c in rows.values()) for name, rows in (("torch", torch_tp), ("te", te_tp))
    }
    assert exposed["torch"] >= backward_scatters * 0.99  # they wait
    assert exposed["te"] < exposed["torch"] - 0.5 * backward_scatters


def test_plot_draws_each_prediction_against_its_published_mfu(tmp_path, capsys) -> None:
    """--plot FILE.svg: one dot per judged run where its published and predicted MFU put it (hover
    names the run and its error), hollow for an `uncertain` run, a legend line per source; with
    --cross-validate the dots are the leave-one-source-out predictions. A .png, --plot with
    --calibrate, and --plot or --out on a plain plan are one line and exit 2."""
    import json
    import xml.etree.ElementTree as ET

    import tomli_w

    from fivefold.cli import main
    from fivefold.plan import validation as V

    by_id = {r["id"]: r for p in builtin_paths() for r in load_runs(p)}
    picked = ["megatron-a100-2021-1.7b", "megatron-a100-2021-18b", "nanotron-8p86b-hopper-n1-dp2-tp1-pp4-z1"]
    rows = [{k: v for k, v in by_id[i].items() if not k.startswith("_")} for i in picked]
    runs = tmp_path / "runs.toml"
    runs.write_text(tomli_w.dumps({"run": rows}))
    svg = tmp_path / "loso.svg"
    assert main(["plan", "--cross-validate", str(runs), "--plot", str(svg), "--json"]) == 0
    loso = json.loads(capsys.readouterr().out)["leave_one_source_out"]["runs"]
    ns = {"s": "http://www.w3.org/2000/svg"}
    dots = [c for c in ET.parse(svg).getroot().iterfind("s:circle", ns) if c.find("s:title", ns) is not None]
    assert len(dots) == len(loso) == 3
    tips = {c.find("s:title", ns).text.split(",")[0].split(" ")[0]: c for c in dots}
    assert set(tips) == set(picked)
    for run in loso:
        dot = tips[run["run"]]
        assert f"({run['error']:+.1%})" in dot.find("s:title", ns).text
        assert (dot.get("fill") == "none") == run["uncertain"]
    # log axes: of two runs, the one with the higher published MFU sits further right, and the one
    # predicted higher sits higher (smaller y)
    a, b = loso[0], loso[1]
    published = {r["run"]: r["mfu"] / (1 + r["error"]) for r in loso}
    assert (float(tips[a["run"]].get("cx")) > float(tips[b["run"]].get("cx"))) == (
        published[a["run"]] > published[b["run"]]
    )
    assert (float(tips[a["run"]].get("cy")) < float(tips[b["run"]].get("cy"))) == (a["mfu"] > b["mfu"])
    text = svg.read_text()
    assert "leave-one-source-out" in text and "huggingface/nanotron: 1," in text
    assert not (tmp_path / "loso.svg.tmp").exists()
    # --validate on the same file: the predictions as shipped
    assert main(["plan", "--validate", str(runs), "--plot", str(tmp_path / "v.svg")]) == 0
    shipped = V.as_shipped(V.cases(rows))
    assert all(p.run in (tmp_path / "v.svg").read_text() for p in shipped.predictions)
    capsys.readouterr()
    for argv in (
        ["plan", "--validate", str(runs), "--plot", str(tmp_path / "v.png")],
        ["plan", "--calibrate", str(runs), "--plot", str(tmp_path / "c.svg")],
        ["plan", "--model", "tiny", "--gpus", "2", "--plot", str(tmp_path / "p.svg")],
        ["plan", "--model", "tiny", "--gpus", "2", "--out", str(tmp_path / "p.toml")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("--plot" in err or "--out" in err), err
    assert not any((tmp_path / name).exists() for name in ("v.png", "c.svg", "p.svg", "p.toml"))
