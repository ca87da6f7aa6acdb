"""Planner memory against closed forms: ZeRO's model-state example, Korthikanti's activation formulas,
pipeline in-flight micro-batches, GQA and the KV cache."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config import Layout, ModelSpec, load_hardware, load_model
from fivefold.plan import TrainShape, plan
from fivefold.plan.inference import InferenceShape, inference_plan
from fivefold.plan.memory import layer_activations, model_state
from fivefold.plan.spec import resolve_arch

GIB = 2**30


@pytest.mark.parametrize("zero, published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure1(zero: int, published_gb: float) -> None:
    """ZeRO §5 / Figure 1: Ψ = 7.5B, Nd = 64, K = 12, fp16 weights and gradients."""
    psi, nd = 7.5e9, 64
    # the paper's ZeRO-3 keeps fp16 weight shards beside the fp32 optimizer state (fp32_shard=False)
    shape = TrainShape(
        seq_len=1, global_batch=1, param_bytes=2, grad_bytes=2, optimizer_bytes=12, fp32_shard=False
    )
    total = sum(model_state(psi, 0.0, zero, nd, nd, shape))
    closed_form = {
        0: (2 + 2 + 12) * psi,
        1: (2 + 2) * psi + 12 * psi / nd,
        2: 2 * psi + (2 + 12) * psi / nd,
        3: (2 + 2 + 12) * psi / nd,
    }[zero]
    assert total == pytest.approx(closed_form, rel=1e-12)
    assert total / 1e9 == pytest.approx(published_gb, abs=0.05)  # the paper rounds to 0.1 GB
    # torch FSDP's ZeRO-3: the fp32 shard is weight and master at once, 4 + g + 8 bytes per parameter
    fsdp = sum(model_state(psi, 0.0, zero, nd, nd, dataclasses.replace(shape, fp32_shard=True)))
    assert fsdp == pytest.approx((4 + 2 + 8) * psi / nd if zero == 3 else total, rel=1e-12)


def gpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, ffn_hidden=4 * hidden)


def korthikanti_layer(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    core = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if sp:
        return sbh * (34 / t + core)
    return sbh * (10 + 24 / t + core)


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_gpt_layer_activations_match_korthikanti(t: int, sp: bool, recompute: str) -> None:
    model = gpt(4, 6144, 64)
    arch = resolve_arch(model, attention="materialized")  # the paper's kernels keep the s×s scores
    assert arch.name == "gpt"
    layout = Layout(tp=t, sp=sp).resolve(t)
    got = layer_activations(model, arch, layout, 4, 2048, moe=False, recompute=recompute)
    assert got == pytest.approx(korthikanti_layer(2048, 4, 6144, 64, t, layout.sp, recompute), rel=1e-12)


def test_pipeline_first_stage_holds_whole_model_of_activations() -> None:
    """1F1B: p micro-batches × L/p layers on the first stage = L layers of one micro-batch; interleaving
    multiplies by 1 + (p-1)/(p·v) (Korthikanti §4.2.3)."""
    model = gpt(96, 12288, 96)
    hw = load_hardware("a100-80gb")
    shape = TrainShape(seq_len=2048, global_batch=64, micro_batch=1, attention="materialized")
    per_layer = korthikanti_layer(2048, 1, 12288, 96, 8, True, "selective")
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 3)):
        lay = Layout(
            tp=8, pp=8, sp=True, recompute="selective", pp_schedule=schedule, virtual_stages=v
        ).resolve(64)
        p = plan(model, hw, lay, shape)
        factor = 1 + (8 - 1) / (8 * v) if v > 1 else 1.0
        assert p.memory.stage == "first"
        assert p.memory.activations == pytest.approx(96 * per_layer * factor, rel=1e-9)


def test_published_analytic_activation_memory() -> None:
    """Korthikanti Figure 1 (as encoded by Calculon): 175B, tp 8, pp 8, interleaved m=3."""
    model = gpt(96, 12288, 96)
    hw = load_hardware("a100-80gb")
    shape = TrainShape(seq_len=2048, global_batch=64, micro_batch=1, attention="materialized")
    for sp, rc, gib in ((False, "none", 66.84375), (True, "selective", 12.3515625)):
        lay = Layout(
            tp=8, pp=8, sp=sp, recompute=rc, pp_schedule="interleaved-1f1b", virtual_stages=3
        ).resolve(64)
        assert plan(model, hw, lay, shape).memory.activations / GIB == pytest.approx(gib, rel=1e-6)


def test_gqa_shrinks_kv_activations_and_fsdp_shards_state() -> None:
    mha = ModelSpec(layers=2, hidden=4096, heads=32, kv_heads=32, vocab=32000, ffn_hidden=11008)
    gqa = ModelSpec(layers=2, hidden=4096, heads=32, kv_heads=8, vocab=32000, ffn_hidden=11008)
    lay = Layout().resolve(1)
    a_mha = layer_activations(mha, resolve_arch(mha), lay, 1, 4096, False, "none")
    a_gqa = layer_activations(gqa, resolve_arch(gqa), lay, 1, 4096, False, "none")
    # only k and v shrink: 2 tensors × 2 bytes × tokens × (32 - 8) heads × 128
    assert a_mha - a_gqa == pytest.approx(2 * 2 * 4096 * 24 * 128)
    hw = load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=8)
    p1 = plan(gqa, hw, Layout(dp=8, zero=0).resolve(8), shape)
    p3 = plan(gqa, hw, Layout(fsdp=8, zero=3).resolve(8), shape)
    n = p1.memory.detail["params_on_rank"]
    # fivefold's DDP computes under autocast from fp32 weights, their own master: 4 bytes, then Adam's
    # two moments; Megatron-style trainers keep 16-bit weights beside an fp32 master
    assert p1.memory.params == pytest.approx(4 * n) and p1.memory.optimizer == pytest.approx(8 * n)
    published = dataclasses.replace(shape, saved_as_eager=False, fp32_weights=False)
    fused = plan(gqa, hw, Layout(dp=8, zero=0).resolve(8), published)
    assert fused.memory.params == pytest.approx(2 * n) and fused.memory.optimizer == pytest.approx(12 * n)
    # FSDP's fp32 shard is the weight and the master: 4 bytes, then Adam's two moments
    assert p3.memory.params == pytest.approx(4 * n / 8)
    assert p3.memory.optimizer == pytest.approx(8 * n / 8)
    assert p3.memory.buffers > p1.memory.buffers - p1.memory.detail["logits"]  # gather buffers


def test_moe_expert_parallel_splits_expert_state() -> None:
    model = load_model("mixtral-8x7b")
    hw = load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=64)
    p1 = plan(model, hw, Layout(fsdp=8, ep=1).resolve(8), shape)
    p8 = plan(model, hw, Layout(fsdp=8, ep=8).resolve(8), shape)
    # experts are sharded 8 ways either way (ep × fsdp/ep), so state is equal; all-to-all appears with ep
    assert p8.memory.optimizer == pytest.approx(p1.memory.optimizer, rel=1e-9)
    assert any(c.axis == "ep" and c.op == "all_to_all" for c in p8.comm)
    assert not any(c.axis == "ep" for c in p1.comm)


def test_kv_cache_formula() -> None:
    model = load_model("llama3-70b")
    hw = load_hardware("h100-80gb")
    for tp in (1, 4, 8, 16):
        gpus = tp
        p = inference_plan(
            model, hw, Layout(tp=tp).resolve(gpus), InferenceShape(batch=4, context=8192, prompt=1024)
        )
        kv_local = max(model.kv_heads / tp, 1)  # heads replicated once tp exceeds kv_heads
        expected = 2 * model.layers * kv_local * model.head_dim * 2 * 8192 * 4
        assert p.kv_cache == pytest.approx(expected)
    mla = load_model("deepseek-v3")
    p = inference_plan(
        mla, hw, Layout(tp=8, pp=8).resolve(64), InferenceShape(batch=1, context=4096, prompt=4096)
    )
    per_token_layer = (mla.kv_lora_rank + mla.qk_rope_head_dim) * 2  # the latent, not per-head K/V
    assert p.kv_cache == pytest.approx(per_token_layer * 8 * 4096)  # 61 layers → 8 on the worst stage


def test_v_shaped_schedules_put_both_ends_on_rank_zero() -> None:
    """ZB-V and DualPipeV fold the pipeline: rank 0 runs the first and the last chunk, so it holds the
    embedding, the output head and the logits; 1F1B splits them over the first and the last rank."""
    model = load_model("llama3-8b")
    hw = load_hardware("h100-80gb")
    # a published trainer's accounting, whose logits make rank 0 the worst (fivefold's eager blocks
    # keep enough that a middle rank, with more of them, is)
    shape = TrainShape(seq_len=4096, global_batch=32, saved_as_eager=False, fp32_weights=False)
    plain = plan(model, hw, Layout(pp=4, pp_schedule="1f1b").resolve(4), shape)
    vee = plan(model, hw, Layout(pp=4, pp_schedule="zbv").resolve(4), shape)
    assert vee.memory.stage == "first+last"
    head = model.vocab * model.hidden
    layer = model.layer_params(0)
    # the layers each rank holds, split as train splits them for 4K sequences
    from fivefold.layout_math import rank_stages, stage_split

    def layers_on_rank0(lay: Layout) -> int:
        sizes = stage_split(model, lay, 4096)
        return sum(sizes[s] for s in rank_stages(0, lay.pp, lay.virtual_stages, lay.pp_schedule))

    v_layers, plain_layers = (layers_on_rank0(p.layout) for p in (vee, plain))
    assert v_layers < plain_layers  # the folded rank holds the head's work too: fewer layers
    assert vee.memory.detail["params_on_rank"] == pytest.approx(v_layers * layer + 2 * head + model.hidden)
    assert plain.memory.detail["params_on_rank"] == pytest.approx(plain_layers * layer + head)
    assert vee.memory.detail["logits"] > 0 and plain.memory.stage == "first"


def test_fused_loss_keeps_only_16_bit_logits_and_hbm_is_binary() -> None:
    from fivefold.plan.result import MEMORY_RESERVE, capacity

    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    lay = Layout(fsdp=8, zero=3).resolve(8)
    shape = TrainShape(seq_len=4096, global_batch=16, micro_batch=2)
    plain = plan(model, hw, lay, shape)
    fused = plan(model, hw, lay, dataclasses.replace(shape, fused_loss=True))
    tokens_vocab = 2 * 4096 * model.vocab
    assert (
        plain.memory.detail["logits"] == 6 * tokens_vocab
        and fused.memory.detail["logits"] == 2 * tokens_vocab
    )
    assert capacity(hw) == 80 * 2**30 * (1 - MEMORY_RESERVE)  # an "80 GB" H100 holds 80 GiB


def test_recomputing_some_blocks_trades_memory_for_time_linearly() -> None:
    """Full recompute of the first N blocks of each chunk: each further block swaps its kept
    activations for its input (the same bytes for every block) and adds its forward to the
    backward; N at or above a chunk's layers is plain full recompute."""
    model = gpt(96, 12288, 96)
    hw = load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=1152, micro_batch=1)
    base = dict(dp=3, zero=1, tp=4, pp=8, sp=True, pp_schedule="interleaved-1f1b", virtual_stages=2)
    plans = [plan(model, hw, Layout(**base).resolve(96), shape)]
    plans += [
        plan(model, hw, Layout(**base, recompute="full", recompute_layers=n).resolve(96), shape)
        for n in range(1, 7)
    ]
    full = plan(model, hw, Layout(**base, recompute="full").resolve(96), shape)
    acts = [p.memory.activations for p in plans]
    steps = [(acts[i] - acts[i + 1]) for i in range(6)]
    assert all(s > 0 for s in steps) and max(steps) == pytest.approx(min(steps), rel=1e-9)
    assert acts[-1] == pytest.approx(full.memory.activations, rel=1e-12)
    times = [p.compute_time_s for p in plans]
    assert times == sorted(times) and times[-1] == pytest.approx(full.compute_time_s, rel=1e-12)
    hfu = [p.hardware_flops_per_token for p in plans]
    assert hfu == sorted(hfu) and hfu[3] == pytest.approx((hfu[0] + hfu[-1]) / 2, rel=1e-9)
    too_many = Layout(**base, recompute="full", recompute_layers=50).resolve(96)
    assert plan(model, hw, too_many, shape).memory.total == pytest.approx(full.memory.total, rel=1e-12)


def test_moe_activations_split_over_tp_only_with_expert_tensor_parallelism() -> None:
    """fivefold's MoE block runs whole on every tp rank: its experts' saved activations do not shrink
    with tp; published runs (expert tensor parallelism) split them."""
    model = load_model("mixtral-8x7b")
    lay1, lay4 = (Layout(tp=t, sp=True).resolve(t) for t in (1, 4))
    whole, split = (resolve_arch(model, "auto", "flash", expert_tp) for expert_tp in (False, True))

    def experts(arch, lay) -> float:  # the MoE layer's bytes beyond the dense layer's
        moe = layer_activations(model, arch, lay, 1, 4096, True, "none")
        return moe - layer_activations(model, arch, lay, 1, 4096, False, "none")

    assert experts(whole, lay4) > 0.9 * experts(whole, lay1)
    assert experts(split, lay4) < 0.6 * experts(split, lay1)


def test_a_serving_pipeline_counts_its_middle_ranks() -> None:
    """DeepSeek-V3's dense layers sit on the first rank: the middle ranks hold only MoE layers and
    are the fullest. The plan had checked the pipeline's two ends only (68.6 GB: 'fits')."""
    model = load_model("deepseek-v3")
    layout = Layout(tp=8, pp=16).resolve(128)
    shape = InferenceShape(batch=1, context=8192, prompt=4096)
    p = inference_plan(model, load_hardware("h100-80gb"), layout, shape)
    assert p.total > 85e9 and not p.fits


def test_a_pipeline_is_split_for_the_runs_sequence_length() -> None:
    """The planner splits the layers over stages as train does, for the run's sequence (the head's
    cost weighs more at 4K than at the model's 128K positions): the same plan as for a model whose
    positions end at the run's length."""
    model = load_model("llama3-8b")
    layout = Layout(pp=4, dp=2).resolve(8)
    shape = TrainShape(seq_len=4096, global_batch=32, micro_batch=1)
    hw = load_hardware("h100-80gb")
    short = dataclasses.replace(model, max_seq_len=4096)
    planned = plan(model, hw, layout, shape).step_time_s
    assert planned == pytest.approx(plan(short, hw, layout, shape).step_time_s)


def test_a_serving_ranks_experts_see_the_tokens_of_every_expert_parallel_replica() -> None:
    """At batch 1, one replica routes 8 of qwen3's 128 experts a layer; under ep 8 a rank's 16
    experts serve all 8 replicas' tokens (as many as one batch routes): most of them are read each
    step, where the plan had read about one."""
    model = load_model("qwen3-30b-a3b")
    hw = load_hardware("h100-80gb")
    shape = InferenceShape(batch=1, context=4096, prompt=2048)
    alone = inference_plan(model, hw, Layout(fsdp=8).resolve(8), shape)
    folded = inference_plan(model, hw, Layout(fsdp=8, ep=8).resolve(8), shape)
    # a rank reads an eighth of the experts, but nearly all of that eighth: not an eighth of a replica's
    reading = folded.decode_time_per_token_s - folded.comm["ep"]  # the dispatch and combine aside
    assert reading > 0.7 * alone.decode_time_per_token_s


def test_a_serving_plan_charges_context_parallelism_its_communication() -> None:
    """Prefill at cp 8 came out exactly an eighth of cp 1 and cp's communication was 0. Decode now
    sums each layer's partial outputs over the KV shards (an all-reduce across nodes here: tp 8
    fills the node), which grows with cp; prefill's ring hides behind the attention at 128K."""
    model, hw = load_model("llama3-70b"), load_hardware("h100-80gb")
    shape = InferenceShape(batch=1, context=131072, prompt=128000)
    plans = {cp: inference_plan(model, hw, Layout(tp=8, cp=cp).resolve(8 * cp), shape) for cp in (1, 2, 8)}
    assert plans[1].comm["cp"] == 0 < plans[2].comm["cp"] < plans[8].comm["cp"]
    assert plans[8].decode_time_per_token_s > plans[2].decode_time_per_token_s
    assert plans[8].prefill_time_s >= plans[1].prefill_time_s / 8


def test_selective_recompute_holds_one_layers_rebuilt_core_in_the_backward() -> None:
    """Selective recompute drops each layer's attention core and rebuilds it in that layer's
    backward: one layer's core (its s×s scores, where the kernel keeps them) is alive then, as full
    recompute holds one rebuilt layer."""
    model, hw = load_model("llama3-8b"), load_hardware("a100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=8, micro_batch=1, attention="materialized")
    arch = resolve_arch(model, attention="materialized")
    p = plan(model, hw, Layout(tp=8, sp=True, recompute="selective").resolve(8), shape)
    args = (model, arch, p.layout, 1, 4096, False)
    core = layer_activations(*args, "none") - layer_activations(*args, "selective")  # 16-bit bytes
    assert core > 3e8  # 32 heads / tp 8 of 4096² scores, softmax and dropout mask
    assert p.memory.detail["recompute_working"] == pytest.approx(core)
    assert p.memory.buffers >= core


@pytest.mark.parametrize(("schedule", "v"), [("zero-bubble", 1), ("zbv", 2), ("dualpipev", 2)])
def test_the_planners_in_flight_is_what_torchs_schedule_table_holds(schedule: str, v: int) -> None:
    """`fivefold plan` is torch-free, so it counts a split backward's micro-batches in flight in closed
    form; verify's ledger replays torch's own table. The two agree on every rank (whole stages'
    worth, a chunk each 1/v): zero-bubble's weight passes wait in the cool-down, so every rank holds
    p, not 1F1B's p − rank; DualPipeV holds p + ½; ZB-V p once the micro-batches are enough."""
    from fivefold.config import Layout
    from fivefold.plan.activations import schedule_peak
    from fivefold.plan.pipeline import in_flight

    for p in (2, 4, 8):
        for m in range(2 * p if schedule == "dualpipev" else p, 3 * p + 1):  # every count torch takes
            layout = Layout(pp=p, pp_schedule=schedule, virtual_stages=v, microbatches=m).resolve(p)
            each = {stage: 1.0 / v for stage in range(p * v)}
            try:
                held = [schedule_peak(layout, rank, m, each) for rank in range(p)]
            except ValueError:  # a count the schedule runs in no whole number of rounds
                continue
            assert [in_flight(schedule, p, m, v, rank) for rank in range(p)] == held, (p, m)


def test_an_fp32_runs_weights_are_their_own_master_copy() -> None:
    """In fp32 (train's CPU default) AdamW keeps only its two moments beside the weights: the plan
    holds 8 bytes a parameter of optimizer state, sharded over the data ranks at zero 1, as the
    runtime's state (plan/state.py, which verify checks to the byte) holds them."""
    model, cpu = load_model("tiny"), load_hardware("cpu")
    fp32 = TrainShape(seq_len=16, global_batch=4, micro_batch=2, act_bytes=4, param_bytes=4)
    n = model.num_params()
    for zero, ranks in ((0, 1), (1, 2)):
        p = plan(model, cpu, Layout(dp=2, zero=zero).resolve(2), fp32, 8)
        assert p.memory.params == 4 * n and p.memory.optimizer == 8 * n / ranks
    # in bf16 the runtime's DDP computes under autocast from the same fp32 weights (the bf16 copies it
    # makes are saved activations); fused kernels' plans keep 16-bit weights beside an fp32 master
    bf16 = TrainShape(seq_len=16, global_batch=4, micro_batch=2)
    assert plan(model, cpu, Layout(dp=2, zero=0).resolve(2), bf16, 8).memory.optimizer == 8 * n
    fused = dataclasses.replace(bf16, saved_as_eager=False, fp32_weights=False)
    assert plan(model, cpu, Layout(dp=2, zero=0).resolve(2), fused, 8).memory.optimizer == 12 * n


def test_compile_plans_what_fused_kernels_save_and_eager_what_fivefolds_blocks_save(capsys) -> None:
    """fivefold's runtime is eager unless `train --compile`: a plan counts its blocks' saved tensors
    (each norm's fp32 input and reciprocal RMS, SwiGLU's activated gate, the gathered matmul input
    under sp: `fivefold.plan.activations`); `plan --compile`, and the published trainers, count what
    fused kernels keep (Korthikanti et al.)."""
    import json

    from fivefold.cli import main
    from fivefold.plan.activations import block_saved

    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--sp", "--seq-len", "4096"]
    base += ["--global-batch", "8", "--json"]
    detail = {}
    for extra in ([], ["--compile"], ["--trainer", "megatron"]):
        assert main([*base, *extra]) == 0
        detail[" ".join(extra)] = json.loads(capsys.readouterr().out)["memory"]["detail"]
    model = load_model("llama3-8b")
    layout = Layout(tp=8, sp=True).resolve(8)
    eager = block_saved(model, layout, 1, 4096, "bf16", False, "none")
    fused = layer_activations(model, resolve_arch(model), layout, 1, 4096, False, "none")
    assert detail[""]["activations_per_layer"] == int(eager)
    assert detail["--compile"]["activations_per_layer"] == int(fused)
    assert detail["--trainer megatron"]["activations_per_layer"] == int(fused)
    assert eager > 1.5 * fused  # the gathered inputs of the matmuls, fp32 norms, four SwiGLU tensors


def test_a_plan_says_when_selective_recompute_frees_nothing_of_the_eager_blocks() -> None:
    """fivefold's SDPA core saves only its inputs, output and log-sum-exp: re-running it frees about
    nothing (under autocast the checkpoint keeps q and k in fp32: more). The plan says so, and
    points to full recompute; fused kernels' plans (Megatron's count) free the core and say nothing."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=8)
    lay = Layout(dp=8, recompute="selective").resolve(8)
    eager = plan(model, hw, lay, shape)
    assert any("--recompute selective keeps" in n and "--recompute full" in n for n in eager.notes)
    none = plan(model, hw, Layout(dp=8).resolve(8), shape)
    assert eager.memory.activations >= none.memory.activations
    fused = plan(model, hw, lay, dataclasses.replace(shape, saved_as_eager=False, fp32_weights=False))
    assert not any("--recompute selective" in n for n in fused.notes)


def test_one_micro_batch_a_step_never_holds_its_gradients_beside_its_activations(capsys) -> None:
    """fivefold's runtime frees the gradients between steps and builds them as the backward frees the
    activations: with one micro-batch a step, no pipeline and no DDP buckets, the peak holds the larger
    of the two; accumulation, a pipeline, DDP and the published trainers' buffers hold both."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")

    def memory_of(layout: Layout, global_batch: int, **facts: object):
        shape = TrainShape(seq_len=4096, global_batch=global_batch, **facts)
        return plan(model, hw, layout.resolve(layout.world), shape).memory

    def held(m) -> float:  # noqa: ANN001 - Memory
        return m.total - m.params - m.optimizer - m.buffers

    apart = {
        "one GPU": memory_of(Layout(), 1),
        "fsdp 8": memory_of(Layout(fsdp=8, zero=3), 8),
        "tp 8": memory_of(Layout(tp=8, sp=True), 1),
    }
    for name, m in apart.items():
        assert m.grads_apart and m.to_json()["grads_apart"], name
        assert held(m) == pytest.approx(max(m.grads, m.activations), rel=1e-12), name
    both = {
        "two micro-batches": memory_of(Layout(), 2),
        "DDP over 2": memory_of(Layout(dp=2), 2),
        "pp 2": memory_of(Layout(pp=2), 2),
        "Megatron's buffers": memory_of(Layout(), 1, fp32_weights=False, saved_as_eager=False),
    }
    for name, m in both.items():
        assert not m.grads_apart, name
        assert held(m) == pytest.approx(m.grads + m.activations, rel=1e-12), name
    one = apart["one GPU"]
    assert one.apart == "grads" and one.activations > one.grads  # 8B at 4K tokens: the activations
    # the text leaves the smaller part out of the stacked total and says why
    from fivefold.plan import text as view

    p = plan(model, hw, Layout().resolve(1), TrainShape(seq_len=4096, global_batch=1))
    chart = view.plan_text(p)
    assert "(grads left out of the total: one micro-batch a step" in chart
    total_line = next(line for line in chart.splitlines() if line.strip().startswith("total"))
    assert f"{p.memory.total / 1e9:.2f} GB" in total_line
