"""Planner time: FLOPs against Megatron's closed forms, the bubble and ring theorems and
exercises, and rankings that must follow the physics."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config import Layout, ModelSpec, load_hardware, load_model
from fivefold.plan import TrainShape, plan
from fivefold.plan.comm import wire_factor
from fivefold.plan.pipeline import bubble_fraction, min_microbatches
from fivefold.plan.search import data_parallel_replicas, min_tp_for_weights


def gpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, ffn_hidden=4 * hidden)


A100 = load_hardware("a100-80gb")


def test_flops_match_megatron_formulas() -> None:
    """Narayanan et al. 2021 Eq. 3 (full recompute) and Korthikanti et al. 2022 App. A (model FLOPs)."""
    L, h, s, V, B = 40, 6144, 2048, 51200, 8
    model = gpt(L, h, 48)
    lay = Layout(tp=8, recompute="full").resolve(8)
    p = plan(model, A100, lay, TrainShape(seq_len=s, global_batch=B, micro_batch=B))
    tokens = B * s
    model_flops = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    hw_full = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert p.model_flops_per_token * tokens == pytest.approx(model_flops, rel=2e-3)  # + norms/biases
    assert p.hardware_flops_per_token * tokens == pytest.approx(hw_full, rel=2e-3)


def test_causal_half_is_reported_separately() -> None:
    model = load_model("llama3-8b")
    p = plan(model, load_hardware("h100-80gb"), Layout(fsdp=8).resolve(8), TrainShape(8192, 64))
    attn = 3 * 2 * 2 * 8192 * model.heads * model.head_dim * model.layers
    assert p.mfu / p.mfu_causal == pytest.approx(
        p.model_flops_per_token / (p.model_flops_per_token - attn / 2)
    )


@pytest.mark.parametrize("p_stages, m", [(4, 8), (8, 64), (16, 3)])
def test_bubble_theorem(p_stages: int, m: int) -> None:
    assert bubble_fraction("1f1b", p_stages, m, 1) == pytest.approx((p_stages - 1) / (m + p_stages - 1))
    assert bubble_fraction("gpipe", p_stages, m, 1) == pytest.approx((p_stages - 1) / (m + p_stages - 1))


def test_seed_exercise_microbatches_for_bubble() -> None:
    """8 stages: bubble ≤ 10% needs m ≥ 7·0.9/0.1 = 63; ≤ 1% needs m ≥ 7·0.99/0.01 = 693."""
    assert min_microbatches(8, 0.10) == 63
    assert min_microbatches(8, 0.01) == 693
    assert bubble_fraction("1f1b", 8, 63, 1) <= 0.10 < bubble_fraction("1f1b", 8, 62, 1)
    assert bubble_fraction("1f1b", 8, 693, 1) <= 0.01 < bubble_fraction("1f1b", 8, 692, 1)


def test_seed_exercise_70b_on_80gb() -> None:
    """70B params in fp16 = 140 GB: minimum TP 2; TP 2 × PP 4 on 256 GPUs leaves 32 DP replicas."""
    assert min_tp_for_weights(70e9, 2, 80) == 2
    assert data_parallel_replicas(256, 2, 4) == 32
    assert Layout(tp=2, pp=4, dp=-1).resolve(256).dp == 32


def test_ring_all_reduce_wire_bytes() -> None:
    for n in (2, 8, 64, 1024):
        assert wire_factor("all-reduce", n) == (2 * (n - 1) / n, 2 * (n - 1))
        assert wire_factor("all-gather", n)[0] == pytest.approx((n - 1) / n)


def test_schedule_rankings() -> None:
    """Interleaving and zero-bubble schedules shrink the bubble; more micro-batches shrink it too."""
    model = gpt(48, 8192, 64)
    shape = TrainShape(seq_len=2048, global_batch=64, micro_batch=1)

    def step(**kw: object) -> float:
        lay = Layout(tp=8, pp=4, sp=True, recompute="selective", **kw).resolve(32)
        return plan(model, A100, lay, shape)

    plain = step(pp_schedule="1f1b")
    inter = step(pp_schedule="interleaved-1f1b", virtual_stages=3)
    zb = step(pp_schedule="zero-bubble")
    assert inter.bubble_time_s < plain.bubble_time_s and inter.step_time_s < plain.step_time_s
    assert zb.bubble_time_s < plain.bubble_time_s
    assert inter.bubble_time_s == pytest.approx(plain.bubble_time_s / 3, rel=0.05)


def test_selective_beats_full_recompute() -> None:
    model = gpt(48, 6144, 64)
    # Korthikanti's runs are Megatron's: sequence parallelism gathers the matmul inputs again backward
    shape = TrainShape(seq_len=2048, global_batch=4, micro_batch=4, tp_regather=True, fused=True)
    full = plan(model, A100, Layout(tp=8, recompute="full").resolve(8), shape)
    sel = plan(model, A100, Layout(tp=8, sp=True, recompute="selective").resolve(8), shape)
    none = plan(model, A100, Layout(tp=8, sp=True, recompute="none").resolve(8), shape)
    assert none.step_time_s < sel.step_time_s < full.step_time_s
    assert none.memory.activations > sel.memory.activations > full.memory.activations
    # Korthikanti Table 5: 1.42 s vs 1.10 s: full recompute costs ~30% more
    assert 1.15 < full.step_time_s / sel.step_time_s < 1.45
    assert full.hfu > full.mfu and sel.hfu > sel.mfu


def test_tp_across_nodes_is_slow() -> None:
    model = load_model("llama3-70b")
    hw = load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=64, micro_batch=1)
    inside = plan(model, hw, Layout(tp=8, pp=2, dp=1, sp=True, recompute="selective").resolve(16), shape)
    across = plan(model, hw, Layout(tp=16, pp=1, dp=1, sp=True, recompute="selective").resolve(16), shape)
    # the same tp=8 group placed with stride 2 (pp innermost) straddles nodes
    strided = plan(
        model,
        hw,
        Layout(tp=8, pp=2, sp=True, recompute="selective", order="pp,tp,cp,fsdp,dp").resolve(16),
        shape,
    )
    assert {c.link for c in across.comm if c.axis == "tp"} != {"intra"}
    assert across.step_time_s > 1.3 * inside.step_time_s
    # half its ring hops stay on NVLink (4 ranks a node), so it pays less latency than tp 16 (1.19x
    # with DTensor's sequence parallelism, 1.26x with Megatron's, which gathers the inputs again)
    assert strided.step_time_s > 1.15 * inside.step_time_s
    megatron = dataclasses.replace(shape, tp_regather=True)
    assert (
        plan(model, hw, strided.layout, megatron).step_time_s
        > 1.2 * plan(model, hw, inside.layout, megatron).step_time_s
    )


def test_strong_scaling_loses_efficiency_weak_scaling_keeps_it() -> None:
    model = load_model("llama3-8b")
    # a 2.5 GB/s network per GPU, so that the gathers of one micro-batch outlast its compute
    hw = dataclasses.replace(load_hardware("h100-80gb"), inter_node_gbps=2.5)
    strong = [plan(model, hw, Layout(fsdp=g).resolve(g), TrainShape(8192, 256, 1)) for g in (16, 64, 256)]
    mfu = [p.mfu for p in strong]
    # fixed batch: fewer micro-batches to hide the gathers behind
    assert mfu[0] > mfu[1] > mfu[2]
    assert strong[0].step_time_s > strong[1].step_time_s > strong[2].step_time_s
    weak = [plan(model, hw, Layout(fsdp=g).resolve(g), TrainShape(8192, 4 * g, 1)) for g in (16, 64, 256)]
    assert max(p.mfu for p in weak) / min(p.mfu for p in weak) < 1.1


def test_bigger_hardware_knobs_go_faster() -> None:
    model = gpt(24, 2304, 24)
    shape = TrainShape(seq_len=2048, global_batch=512, micro_batch=16)
    lay = Layout(dp=32, recompute="full").resolve(32)
    base = plan(model, A100, lay, shape)
    faster = plan(model, dataclasses.replace(A100, matmul_efficiency=0.9), lay, shape)
    slow_net = plan(model, dataclasses.replace(A100, inter_node_gbps=0.25), lay, shape)
    assert faster.step_time_s < base.step_time_s < slow_net.step_time_s


def test_link_kinds_agree_with_the_mesh() -> None:
    """The planner asks the mesh on a reduced world; the answer must equal the mesh's on the full one."""
    import random

    from fivefold.mesh import axis_link_kinds
    from fivefold.plan.comm import links

    rng = random.Random(0)
    checked = 0
    for world in (16, 48, 96, 256, 1024):
        sizes = [d for d in range(1, world + 1) if world % d == 0]
        for gpn in (4, 6, 8):
            for _ in range(120):
                dp, fsdp, cp, tp = (rng.choice(sizes) for _ in range(4))
                if world % (dp * fsdp * cp * tp):
                    continue
                order = ",".join(rng.sample(["dp", "fsdp", "cp", "tp", "pp"], 5))
                lay = Layout(
                    dp=dp,
                    fsdp=fsdp,
                    cp=cp,
                    tp=tp,
                    pp=world // (dp * fsdp * cp * tp),
                    order=order,
                    zero=3 if fsdp > 1 else 0,
                )
                assert links(lay, gpn) == axis_link_kinds(lay, gpn), (lay, gpn)
                checked += 1
    assert checked > 50


def test_the_busiest_pipeline_rank_sets_the_step() -> None:
    """The balanced split gives the ends fewer layers (they also run the embedding or the head): a
    middle rank holds the most and the step is timed on it, not on rank 0 alone."""
    from fivefold.layout_math import stage_split
    from fivefold.plan.memory import stage_counts, stage_names, stage_weights
    from fivefold.plan.pipeline import in_flight

    model, hw = load_model("llama3-405b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=8192, global_batch=2048)
    for sched in ("zbv", "1f1b"):
        lay = Layout(
            dp=64, tp=8, pp=32, zero=1, sp=True, pp_schedule=sched, virtual_stages=2 if sched == "zbv" else 1
        )
        lay = lay.resolve(16384)
        names = stage_names(lay, model)
        counts = {n: sum(stage_counts(model, lay.pp, n, lay)) for n in names}
        assert sum(stage_weights(lay, model).values()) == lay.pp  # every rank stands for itself or a twin
        assert max(counts.values()) == max(stage_split(model, lay, model.max_seq_len)) * lay.virtual_stages
        p = plan(model, hw, lay, shape)
        busiest = max(names, key=counts.get)
        assert p.stage_times["stage"] == busiest and busiest.startswith("mid")
        # the busiest rank's layers set the forward: its layer count times one layer's forward
        assert p.stage_times["forward_s"] >= counts[busiest] * p.stage_times["layer_forward_s"] * 0.999
    # micro-batches in flight fall with the rank in 1F1B; Megatron's interleaved warm-up at both ends
    assert [in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("interleaved-1f1b", 4, 8, 2, 0) == 4 * (1 + 3 / 8)
    assert in_flight("interleaved-1f1b", 4, 8, 2, 3) == (4 + 1) / 2
    assert in_flight("zbv", 4, 8, 2, 3) == 4


def test_fsdp_inside_a_pipeline_reduces_gradients_once_a_step() -> None:
    """torch's pipeline stage keeps FSDP gradients unsynced until the step's last backward, as the
    ledger counts it: the time model reduce-scatters a step's gradients once, not once per
    micro-batch; outside a pipeline FSDP reduce-scatters every micro-batch's."""
    model = load_model("llama3-8b")
    hw = load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=64, micro_batch=1)

    def reduced(lay: Layout) -> float:
        p = plan(model, hw, lay.resolve(64), shape)
        return sum(c.bytes for c in p.comm if c.axis == "fsdp" and c.op == "reduce_scatter")

    piped = reduced(Layout(fsdp=16, tp=2, pp=2, zero=3))  # 4 micro-batches a step
    flat = reduced(Layout(fsdp=32, tp=2, zero=3))  # 2 micro-batches a step
    grads_per_rank_piped = 4 * model.num_params() / (2 * 2)  # fp32, one tp rank's half of one stage
    assert piped == pytest.approx(grads_per_rank_piped, rel=0.1)
    assert flat == pytest.approx(2 * 4 * model.num_params() / 2, rel=0.1)


def test_fsdp_zero2_inside_a_pipeline_gathers_once_a_step() -> None:
    """ZeRO-2 over fsdp in a pipeline keeps the stage's weights gathered from the first forward on:
    one gather a step in the time model, as in the ledger (fsdp_gathers), against m + 1 under ZeRO-3."""
    model = load_model("llama3-8b")
    hw = load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=64, micro_batch=1)

    def gathered(zero: int) -> float:
        p = plan(model, hw, Layout(fsdp=16, tp=2, pp=2, zero=zero).resolve(64), shape)
        return sum(c.bytes for c in p.comm if c.axis == "fsdp" and c.op == "all_gather")

    m = 64 // 16  # micro-batches a step: one sequence each, 4 per data rank
    assert gathered(3) == pytest.approx((m + 1) * gathered(2), rel=1e-6)
    bf16_stage_half = 2 * model.num_params() / (2 * 2)  # one stage's tp half in bf16
    assert gathered(2) == pytest.approx(bf16_stage_half, rel=0.1)


def test_published_fsdp_with_a_pipeline_keeps_weights_gathered(tmp_path) -> None:
    """A run that states fsdp and pp but no ZeRO stage is planned as torchtitan and Llama 3 run it:
    no reshard after forward (ZeRO-2 in fivefold's words); without a pipeline FSDP stays ZeRO-3."""
    from fivefold.plan.runs import build

    run = {
        "id": "fsdp-pp",
        "source": "example",
        "hardware": {"gpu": "H100 80GB", "gpus_per_node": 8},
        "model": {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 4096},
        "layout": {"gpus": 64, "tp": 2, "pp": 2, "fsdp": 16, "global_batch": 64},
        "measured": {"mfu": 0.4},
    }
    assert build(run).layout.zero == 2
    run["layout"] = {"gpus": 64, "tp": 2, "fsdp": 32, "global_batch": 64}
    assert build(run).layout.zero == 3


def test_the_step_overhead_is_synchronisation_none_on_one_gpu() -> None:
    """One GPU pays Adam's stream and nothing fixed (measured: benchmarks/bench_gpu.md); the overhead
    grows with the reduction tree's depth and is the knob's value at 64 GPUs."""
    from fivefold.plan.compute import step_overhead

    hw = dataclasses.replace(load_hardware("h100-80gb"), step_overhead_s=0.03)
    assert step_overhead(hw, 1) == 0.0
    assert step_overhead(hw, 64) == pytest.approx(0.03)
    assert step_overhead(hw, 8) < step_overhead(hw, 64) < step_overhead(hw, 4096) == pytest.approx(0.06)
    shape = TrainShape(seq_len=2048, global_batch=8, micro_batch=1)
    slow = dataclasses.replace(hw, step_overhead_s=10.0)
    one = [plan(load_model("llama3-8b"), h, Layout(), shape).optimizer_time_s for h in (hw, slow)]
    assert one[0] == pytest.approx(one[1])  # the knob never reaches a single GPU
    eight = [plan(load_model("llama3-8b"), h, Layout(fsdp=8), shape).optimizer_time_s for h in (hw, slow)]
    assert eight[1] - eight[0] == pytest.approx((10.0 - 0.03) / 2)  # log2(8) / log2(64)


def test_a_tp_group_spanning_nodes_stripes_its_rings_over_the_nics() -> None:
    """tp 16 on 8-GPU nodes: each ring crosses the network through one of the node's 8 NICs, as the
    data-parallel rings do, so a collective runs at 8 NICs' bandwidth (capped by the node's own links);
    tp 8 placed with stride 2 has 4 members a node and gets 4 NICs. One ring hop in `nics` crosses
    the network; the others stay on NVLink and pay its latency."""
    from fivefold.plan.comm import collective_time

    model = load_model("llama3-70b")
    hw = load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=64, micro_batch=1)
    for layout, nics in (
        (Layout(tp=16, sp=True, recompute="selective").resolve(16), 8),
        (Layout(tp=8, pp=2, sp=True, recompute="selective", order="pp,tp,cp,fsdp,dp").resolve(16), 4),
    ):
        p = plan(model, hw, layout, shape)
        gather = next(c for c in p.comm if c.axis == "tp" and c.op == "all_gather")
        assert gather.link == "mixed"
        payload = gather.bytes / gather.count
        one = collective_time(hw, "all_gather", payload, layout.tp, "mixed", nics)[1]
        assert gather.time_s == pytest.approx(one * gather.count)
        wire = (layout.tp - 1) / layout.tp * payload
        bandwidth = min(hw.inter_node_gbps * nics, hw.intra_node_gbps) * 1e9 * hw.link_efficiency
        alpha = (hw.inter_node_latency_us + (nics - 1) * hw.intra_node_latency_us) / nics
        assert one == pytest.approx(wire / bandwidth + (layout.tp - 1) * alpha * 1e-6)


def test_a_live_parameter_bound_serialises_the_gathers_after_big_modules() -> None:
    """DeepSpeed ZeRO-3 prefetches nothing while a module of `stage3_max_live_parameters` or more
    computes: the gather after it waits in line. Small modules keep every gather overlapped."""
    from fivefold.plan.dataparallel import sub_module_gathers

    def waiting(modules: list[float], bound: float) -> tuple[float, float]:
        forward, _, backward = sub_module_gathers(modules, bound, 0.0, False)
        return forward, backward

    assert waiting([1.0, 1.0, 1.0, 1.0], 0.0) == (0.0, 0.0)  # no bound: all prefetched
    assert waiting([1.0, 1.0, 1.0, 1.0], 5.0) == (0.0, 0.0)
    assert waiting([6.0, 6.0, 6.0, 6.0], 5.0) == (1.0, 1.0)
    # qkv 3, out 1, up 4, down 4 (a GPT block of h² = 1), bound 2. Forward: out after qkv, down after
    # up, the next block's qkv after down are serialised (1 + 4 + 3 of 12); up after out is prefetched.
    # Backward (down, up, out, qkv): down after the previous block's qkv, up after down, out after up
    # (4 + 4 + 1); qkv after the small out is prefetched.
    forward, backward = waiting([3.0, 1.0, 4.0, 4.0], 2.0)
    assert forward == pytest.approx(8 / 12)
    assert backward == pytest.approx((4 + 1 + 4) / 12)

    model = gpt(layers=8, hidden=16384, heads=128)  # 3h² = 805M, 4h² = 1.07B parameters
    hw = A100
    layout = Layout(fsdp=64, zero=3, recompute="full").resolve(64)
    shape = TrainShape(seq_len=1024, global_batch=64 * 8, micro_batch=8)
    free = plan(model, hw, layout, shape)
    bound = plan(model, hw, layout, dataclasses.replace(shape, live_params=1e9))
    gathers = [next(c for c in p.comm if c.op == "all_gather") for p in (free, bound)]
    assert gathers[1].time_s == pytest.approx(gathers[0].time_s)  # the same traffic
    assert gathers[1].exposed_s > gathers[0].exposed_s + 0.5 * gathers[0].time_s / 2
    assert bound.step_time_s > free.step_time_s
    roomy = plan(model, hw, layout, dataclasses.replace(shape, live_params=1e10))
    assert roomy.step_time_s == pytest.approx(free.step_time_s)


def test_sub_module_gathers_under_full_recompute_gather_again() -> None:
    """DeepSpeed under full recompute: the recomputed forward gathers the block again, and every
    module whose backward comes more than the reuse distance after it (the rest of the block, there
    and back) is released and gathered a third time; the last module is used at once and kept."""
    from fivefold.plan.dataparallel import sub_module_gathers

    assert sub_module_gathers([3.0, 1.0, 4.0, 4.0], 0.0, 0.0, True) == (0.0, 1.0, 0.0)  # torch FSDP
    # bound 10 (nothing large enough to stop prefetching), reuse distance 5: qkv (2·9), out (2·8) and
    # up (2·4) come back, down (0) stays: 8 of 12 gathered a third time
    waiting_f, passes, waiting_b = sub_module_gathers([3.0, 1.0, 4.0, 4.0], 10.0, 5.0, True)
    assert (waiting_f, waiting_b) == (0.0, 0.0)
    assert passes == pytest.approx(1 + 8 / 12)
    # bound 2: the recomputed forward waits as the forward does (8 of 12); of the third gathers, up
    # (after down) and out (after up) wait, qkv (after the small out) is prefetched
    waiting_f, passes, waiting_b = sub_module_gathers([3.0, 1.0, 4.0, 4.0], 2.0, 5.0, True)
    assert waiting_f == pytest.approx(8 / 12)
    assert waiting_b == pytest.approx(8 / 12 + 5 / 12)
    # without recompute the backward gathers once, in backward order
    assert sub_module_gathers([3.0, 1.0, 4.0, 4.0], 2.0, 5.0, False)[1:] == (1.0, pytest.approx(9 / 12))


def test_a_blocks_sub_modules_add_up_to_its_shard() -> None:
    """The sub-modules DeepSpeed gathers one by one are the same parameters the memory plan holds:
    fused q·k·v (K/V kept whole where tp > kv_heads), output, MLP in and out."""
    from fivefold.plan.spec import block_modules, layer_shard, resolve_arch

    for name in ("llama3-70b", "llama3-8b"):
        model = load_model(name)
        arch = resolve_arch(model)
        for tp in (1, 8, 16):
            modules = block_modules(model, arch, Layout(tp=tp))
            assert modules is not None and len(modules) == 4
            assert sum(modules) == pytest.approx(layer_shard(model, arch, Layout(tp=tp), False).dense)
    gpt_block = gpt(layers=2, hidden=1024, heads=16)
    assert block_modules(gpt_block, resolve_arch(gpt_block), Layout()) == [
        3 * 2**20,
        2**20,
        4 * 2**20,
        4 * 2**20,
    ]


@pytest.mark.parametrize(
    ("name", "axes", "world"),
    [
        ("small", {"tp": 2, "sp": True}, 2),
        ("small", {"cp": 2, "dp": 1}, 2),  # gradients over the cp ranks: the ledger's "cp"
        ("small", {"cp": 2, "fsdp": 2, "zero": 3}, 4),  # FSDP over fsdp×cp: "fsdp_cp"
        ("small", {"cp": 2, "dp": 2}, 4),  # DDP over dp×cp: "dp_fsdp_cp"
        ("small", {"pp": 2, "fsdp": 2, "zero": 2}, 4),  # sends and receives, the tied weight's sum
        ("small", {"dp": 2, "fsdp": 2, "zero": 3}, 4),
        ("small", {"cp": 2, "cp_impl": "ulysses", "dp": 1}, 2),
        ("tiny-moe", {"ep": 2, "fsdp": 2, "dp": 2, "zero": 2}, 4),
    ],
)
def test_the_plan_names_its_collectives_as_the_ledger_does(name: str, axes: dict, world: int) -> None:
    """Every (axis, op) of the layout plan is one the exact step (what the ledger records) has too:
    the same group and op names, whatever the two count."""
    from fivefold.plan.step import plan_step

    model, layout = load_model(name), Layout(**axes).resolve(world)
    shape = TrainShape(seq_len=256, global_batch=16, micro_batch=2, act_bytes=4, param_bytes=4)
    p = plan(model, load_hardware("cpu"), layout, shape)
    origin = {"pp": 0, "fsdp_cp": 0, "dp": 0, "cp": 0}
    step = plan_step(model, layout, 2, 256, p.microbatches, "fp32", origin)
    assert {(c.axis, c.op) for c in p.comm} <= set(step.comm)
    if layout.pp > 1:  # one rank's activations out and gradients in: as many sends as receives
        sends, recvs = (next(c for c in p.comm if c.axis == "pp" and c.op == op) for op in ("send", "recv"))
        assert sends.count == recvs.count == step.comm[("pp", "send")][0]


@pytest.mark.parametrize(
    ("axes", "world"),
    [
        ({"tp": 2, "sp": True}, 2),
        ({"tp": 2}, 2),
        ({"tp": 2, "sp": True, "recompute": "full"}, 2),
        ({"tp": 2, "sp": True, "recompute": "full", "recompute_layers": 1}, 2),
        ({"tp": 2, "sp": True, "fsdp": 2, "zero": 3}, 4),
        ({"tp": 4, "sp": True}, 4),  # 4 KV heads over tp 4, and over tp 8 below: replicated, reduced
        ({"tp": 8, "sp": True}, 8),
        ({"tp": 8, "fsdp": 2, "zero": 3}, 16),  # replicated K/V reduced with each of FSDP's syncs
    ],
)
def test_tp_collectives_are_counted_as_the_ledger_counts_them(axes: dict, world: int) -> None:
    """fivefold's tensor parallelism (DTensor's SP, torch's checkpoint): the layout plan's tp calls and
    bytes are the exact step's, collective by collective; Megatron's adds the backward re-gathers."""
    from fivefold.plan.step import plan_step

    model, layout = load_model("small"), Layout(**axes).resolve(world)
    shape = TrainShape(seq_len=256, global_batch=16, micro_batch=2, act_bytes=4, param_bytes=4)
    p = plan(model, load_hardware("cpu"), layout, shape)
    origin = {"pp": 0, "fsdp_cp": 0, "dp": 0, "cp": 0}
    step = plan_step(model, layout, 2, 256, p.microbatches, "fp32", origin).comm
    planned = {(c.axis, c.op): (c.count, int(c.bytes)) for c in p.comm if c.axis == "tp"}
    assert planned == {k: v for k, v in step.items() if k[0] == "tp"}
    if layout.sp:
        megatron = plan(model, load_hardware("cpu"), layout, dataclasses.replace(shape, tp_regather=True))
        gathers = next(c.count for c in megatron.comm if c.axis == "tp" and c.op == "all_gather")
        assert gathers == planned[("tp", "all_gather")][0] + 2 * model.layers * p.microbatches


def test_ddp_buckets_as_torch_rebuilds_them() -> None:
    """The first bucket closes at 1 MiB, every later one at 25 MiB, each on the gradient that fills it."""
    from fivefold.plan.dataparallel import ddp_buckets

    mib = 2**20
    assert ddp_buckets([mib // 4] * 3) == [3 * mib // 4]  # under the first cap: one bucket
    assert ddp_buckets([mib // 2] * 3) == [mib, mib // 2]
    assert ddp_buckets([mib] + [5 * mib] * 6) == [mib, 25 * mib, 5 * mib]
    assert ddp_buckets([]) == []


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_ep_all_to_alls_are_counted_as_the_ledger_counts_them(recompute: str) -> None:
    """Dispatch and combine both ways, and before each forward dispatch the per-expert row counts:
    the layout plan's expert all-to-alls are the exact step's under balanced routing."""
    from fivefold.plan.step import plan_step

    model = load_model("tiny-moe")
    layout = Layout(ep=2, fsdp=2, zero=3, recompute=recompute).resolve(2)
    shape = TrainShape(seq_len=256, global_batch=16, micro_batch=2, act_bytes=4, param_bytes=4)
    p = plan(model, load_hardware("cpu"), layout, shape)
    step = plan_step(model, layout, 2, 256, p.microbatches, "fp32", {"pp": 0, "fsdp_cp": 0, "dp": 0})
    planned = next(c for c in p.comm if c.axis == "ep" and c.op == "all_to_all")
    assert (planned.count, int(planned.bytes)) == step.comm[("ep", "all_to_all")]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("zero", "pp"), [(3, 1), (2, 1), (3, 2)])
def test_fsdp_collectives_are_counted_per_unit_as_the_ledger_counts_them(
    tied: bool, zero: int, pp: int
) -> None:
    """FSDP gathers and reduces one unit (block, embedding, head) at a time: the plan's calls are the
    exact step's (what `verify` checks against the ledger), and each call pays the ring's latency."""
    from fivefold.plan.comm import collective_time
    from fivefold.plan.step import plan_step

    model = dataclasses.replace(load_model("small"), tie_embeddings=tied)
    hw = load_hardware("h100-80gb")
    layout = Layout(fsdp=4, pp=pp, zero=zero).resolve(4 * pp)
    shape = TrainShape(seq_len=256, global_batch=32, micro_batch=2)
    p = plan(model, hw, layout, shape)
    step = plan_step(model, layout, 2, 256, p.microbatches, "bf16", {"pp": 0, "fsdp_cp": 0})
    for op in ("all_gather", "reduce_scatter"):
        planned = next(c for c in p.comm if c.axis == "fsdp" and c.op == op)
        assert planned.count == step.comm[("fsdp", op)][0], op
        one = collective_time(hw, op, planned.bytes / planned.count, 4, planned.link)[1]
        assert planned.time_s == pytest.approx(one * planned.count)


def test_on_a_cpu_no_collective_overlaps_the_compute() -> None:
    """The cores that compute also run gloo: every collective's time is exposed on the `cpu` preset,
    while a GPU hides the same collectives behind the backward."""
    model = load_model("small")
    shape = TrainShape(seq_len=256, global_batch=16, micro_batch=4)
    for layout in (
        Layout(fsdp=2, zero=3).resolve(2),
        Layout(tp=2, sp=True).resolve(2),
        Layout(dp=2).resolve(2),
        Layout(cp=2, dp=1).resolve(2),  # ring attention's K/V sends
    ):
        cpu = plan(model, load_hardware("cpu"), layout, shape)
        megatron = dataclasses.replace(shape, tp_backward_overlap=True)  # tp's grad-input beside wgrads
        cpu_megatron = plan(model, load_hardware("cpu"), layout, megatron)
        gpu = plan(model, dataclasses.replace(load_hardware("cpu"), comm_overlap=True), layout, megatron)
        for p in (cpu, cpu_megatron):
            assert all(c.exposed_s == pytest.approx(c.time_s) for c in p.comm if c.axis != "pp")
        # DDP's one bucket is exposed either way (the last bucket never hides); the others hide on a GPU
        assert cpu.step_time_s > gpu.step_time_s or layout.dp > 1


@pytest.mark.parametrize(
    ("layout", "axis", "knob"),
    [
        (Layout(tp=2, sp=True), "tp", "tp_dispatch_us"),  # DTensor's host work
        (Layout(tp=2), "tp", "tp_dispatch_us"),
        (Layout(fsdp=2, zero=3), "fsdp", "fsdp_dispatch_us"),  # FSDP's per-unit hooks
        (Layout(fsdp=2, zero=2), "fsdp", "fsdp_dispatch_us"),
        (Layout(pp=2, fsdp=1, dp=1), "fsdp", "fsdp_dispatch_us"),  # no FSDP: nothing added
        (Layout(cp=2, dp=1, cp_impl="ulysses"), "cp", "cp_dispatch_us"),  # functional collectives
        (Layout(cp=2, dp=1, cp_impl="allgather"), "cp", "cp_dispatch_us"),
    ],
)
def test_a_cpu_pays_the_host_work_of_each_collective_the_runtime_issues_from_python(
    layout: Layout, axis: str, knob: str
) -> None:
    """Every tp, FSDP and cp-core collective costs the `cpu` preset its ring time plus its host dispatch
    (work the cores that compute must do), all of it exposed; other axes pay none, GPU presets none."""
    from fivefold.plan.comm import collective_time

    model = load_model("small")
    shape = TrainShape(seq_len=256, global_batch=16, micro_batch=4)
    cpu = load_hardware("cpu")
    per_call = getattr(cpu, knob) * 1e-6
    assert per_call > 0
    assert all(getattr(load_hardware(name), knob) == 0 for name in ("h100-80gb", "a100-80gb", "b200"))
    layout = layout.resolve(2)
    with_dispatch = plan(model, cpu, layout, shape)
    without = plan(model, dataclasses.replace(cpu, **{knob: 0.0}), layout, shape)
    for c, bare in zip(with_dispatch.comm, without.comm, strict=True):
        assert (c.axis, c.op, c.count) == (bare.axis, bare.op, bare.count)
        ring = collective_time(cpu, c.op, c.bytes / c.count, c.group, c.link)[1]
        # over cp, the data-parallel gradient all-reduce is DDP's (dp 1: its group is cp's), no core's
        if c.axis == axis and not (axis == "cp" and c.op == "all_reduce"):
            assert c.time_s == pytest.approx(c.count * (ring + per_call))
            assert c.exposed_s == pytest.approx(c.time_s)
        else:
            assert c.time_s == pytest.approx(bare.time_s)
    calls = sum(
        c.count for c in with_dispatch.comm if c.axis == axis and not (axis == "cp" and c.op == "all_reduce")
    )
    assert calls > 0 or layout.fsdp == 1
    said = any("host dispatch" in note for note in with_dispatch.notes)  # the plan says what it added
    assert said == (calls > 0) and not any("host dispatch" in note for note in without.notes)
    added = with_dispatch.step_time_s - without.step_time_s
    assert added == pytest.approx(calls * per_call, rel=0.02, abs=1e-9)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fsdp_bytes_are_the_exact_steps_in_either_dtype(dtype: str) -> None:
    """`plan --dtype` sets what FSDP gathers (the compute dtype) beside what it reduces (fp32
    gradients): the plan's bytes are the exact step's, which `verify` checks against the ledger."""
    from fivefold.plan.step import plan_step

    model = load_model("small")
    width = 4 if dtype == "fp32" else 2
    layout = Layout(fsdp=2, zero=3).resolve(2)
    shape = TrainShape(seq_len=256, global_batch=16, micro_batch=4, act_bytes=width, param_bytes=width)
    p = plan(model, load_hardware("cpu"), layout, shape)
    step = plan_step(model, layout, 4, 256, p.microbatches, dtype, {"pp": 0, "fsdp_cp": 0, "dp": 0})
    for c in p.comm:
        assert (c.count, c.bytes) == pytest.approx(step.comm[(c.axis, c.op)]), (c.axis, c.op)


def test_thin_matmuls_pay_the_tile_penalty() -> None:
    """A GPU preset halves a matmul's rate at 128 wide (`gemm_half_dim`); the `cpu` preset's vector
    units run 128-wide and wider matmuls about alike (benchmarks/bench_gemm_shapes.py --device cpu)
    and only thinner ones slower, at half rate 32 wide (fitted to tiny's and small's steps)."""
    from fivefold.plan.compute import Rates

    for name, half in (("h100-80gb", 128.0), ("a100-80gb", 128.0), ("cpu", 32.0)):
        rates = Rates.of(load_hardware(name))
        assert rates.half_dim == half
        thin, wide = rates.gemm(16384, 16384, 256), rates.gemm(16384, 16384, 8192)  # both compute-bound
        # seconds per FLOP, thin over wide: (d + half) / d of each, equal without the penalty
        ratio = (thin / 256) / (wide / 8192)
        assert ratio == pytest.approx((256 + half) / 256 * 8192 / (8192 + half), rel=1e-6), name


def test_a_cpu_serving_plan_pays_the_tp_dispatch_of_each_decode_all_reduce() -> None:
    """Serving runs the same DTensor tensor parallelism: each layer's two tp all-reduces per decoded
    token cost the `cpu` preset their host dispatch on top of the ring."""
    from fivefold.plan.inference import InferenceShape, inference_plan

    model = load_model("small")
    shape = InferenceShape(batch=2, context=128, prompt=64)
    layout = Layout(tp=2)
    cpu = load_hardware("cpu")
    served = inference_plan(model, cpu, layout, shape)
    bare = inference_plan(model, dataclasses.replace(cpu, tp_dispatch_us=0.0), layout, shape)
    added = served.decode_time_per_token_s - bare.decode_time_per_token_s
    assert added == pytest.approx(model.layers * 2 * cpu.tp_dispatch_us * 1e-6)


def test_dualpipe_hides_expert_all_to_alls_only_behind_the_paired_compute() -> None:
    """DualPipe runs one chunk's dispatch and combine under another micro-batch's compute: an
    all-to-all shorter than that compute is hidden whole, a longer one shows its excess."""
    model = load_model("deepseek-v3")
    shape = TrainShape(seq_len=4096, global_batch=1920, micro_batch=1, fp8=True)
    layout = Layout(pp=16, ep=64, fsdp=128, zero=2, pp_schedule="dualpipev", virtual_stages=2)
    p = plan(model, load_hardware("h800"), layout.resolve(2048), shape)
    a2a = next(c for c in p.comm if c.axis == "ep" and c.op == "all_to_all" and c.bytes > 1e9)
    assert a2a.time_s > p.compute_time_s  # more traffic than compute on this network ...
    assert a2a.exposed_s >= a2a.time_s - p.compute_time_s  # ... so at least the excess shows
    fast = dataclasses.replace(load_hardware("h800"), inter_node_gbps=50_000.0)  # no network bound
    p_fast = plan(model, fast, layout.resolve(2048), shape)
    a2a_fast = next(c for c in p_fast.comm if c.axis == "ep" and c.op == "all_to_all" and c.bytes > 1e9)
    assert a2a_fast.time_s < p_fast.compute_time_s
    # what shows is the small exchange of per-expert row counts before each dispatch, no payload
    assert a2a_fast.exposed_s < 0.1 * a2a_fast.time_s


def test_dtensor_tensor_parallelism_hides_no_backward_collective_behind_the_weight_gradients() -> None:
    """Megatron issues a tp matmul's grad-input collective beside its weight-gradient matmul; DTensor
    (fivefold, torchtitan eager) waits on it at the next op, so on a GPU only Megatron's hides."""
    model = load_model("llama3-8b")
    layout = Layout(tp=8, sp=True).resolve(8)
    shape = TrainShape(seq_len=8192, global_batch=8, micro_batch=1)
    h100 = load_hardware("h100-80gb")
    dtensor = plan(model, h100, layout, shape)
    megatron = plan(model, h100, layout, dataclasses.replace(shape, tp_backward_overlap=True))
    tp_exposed = {
        name: sum(c.exposed_s for c in p.comm if c.axis == "tp")
        for name, p in (("dtensor", dtensor), ("megatron", megatron))
    }
    tp_time = sum(c.time_s for c in dtensor.comm if c.axis == "tp")
    assert tp_exposed["dtensor"] == pytest.approx(tp_time)
    assert tp_exposed["megatron"] < 0.75 * tp_time
    assert megatron.step_time_s < dtensor.step_time_s


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("cp_impl", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_collectives_are_counted_as_the_ledger_counts_them(cp: int, cp_impl: str, recompute: str) -> None:
    """Ring hops as a send and a receive each, the backward's gradient buffer one hop more (fp32);
    all-gather's K and V in calls of their own: the layout plan's cp rows are the exact step's."""
    from fivefold.plan.step import plan_step

    model = load_model("small")
    layout = Layout(cp=cp, dp=1, cp_impl=cp_impl, recompute=recompute).resolve(cp)
    shape = TrainShape(seq_len=256, global_batch=8, micro_batch=2, act_bytes=4, param_bytes=4)
    p = plan(model, load_hardware("cpu"), layout, shape)
    step = plan_step(model, layout, 2, 256, p.microbatches, "fp32", {"pp": 0, "fsdp_cp": 0})
    ops = ("send", "recv") if cp_impl == "ring" else ("all_gather", "reduce_scatter")
    for op in ops:
        planned = next(c for c in p.comm if c.axis == "cp" and c.op == op)
        assert (planned.count, int(planned.bytes)) == step.comm[("cp", op)], op


def test_ddp_buckets_are_planned_as_torch_rebuilds_them() -> None:
    """fivefold's DDP: the first bucket 1 MiB, then 25 MiB; the exact step has those buckets and the
    reported loss's 4-byte all-reduce, which the layout plan leaves to the step overhead."""
    from fivefold.plan.step import plan_step

    model = load_model("small")  # 3 MB of fp32 gradients: two buckets
    layout = Layout(dp=2, zero=0).resolve(2)
    shape = TrainShape(seq_len=256, global_batch=16, micro_batch=4, act_bytes=4, param_bytes=4)
    p = plan(model, load_hardware("cpu"), layout, shape)
    step = plan_step(model, layout, 4, 256, p.microbatches, "fp32", {"pp": 0, "dp": 0})
    planned = next(c for c in p.comm if c.axis == "dp" and c.op == "all_reduce")
    calls, nbytes = step.comm[("dp", "all_reduce")]
    assert (planned.count, int(planned.bytes)) == (calls - 1, nbytes - 4) == (2, nbytes - 4)
    published = plan(model, load_hardware("cpu"), layout, dataclasses.replace(shape, torch_ddp_buckets=False))
    assert next(c for c in published.comm if c.axis == "dp" and c.op == "all_reduce").count == 1


def test_fivefolds_masked_cp_cores_are_planned_with_the_whole_square() -> None:
    """fivefold's ring and all-gather cores score every key block under a position mask (the CPU
    all-gather run of the small model at cp 2 measured 0.373 s against 0.368 s planned so, 0.272 s
    with the causal half); Ulysses runs the causal kernel, and published rings skip the blocks."""
    model = load_model("small")
    shape = TrainShape(seq_len=1024, global_batch=8, micro_batch=2, act_bytes=4, param_bytes=4)
    cpu = load_hardware("cpu")

    def compute(impl: str, skip: bool) -> float:
        layout = Layout(cp=2, dp=1, cp_impl=impl).resolve(2)
        return plan(model, cpu, layout, dataclasses.replace(shape, cp_causal_skip=skip)).compute_time_s

    for impl in ("ring", "allgather"):
        assert compute(impl, False) > 1.3 * compute(impl, True)
    assert compute("ulysses", False) == compute("ulysses", True)
    # the same causal FLOPs as a skipping ring, and Ulysses' layout copies of q, k, v and the output
    assert compute("ulysses", True) > compute("ring", True)


def test_an_all_to_all_across_nodes_sends_only_the_other_nodes_share_through_the_nic() -> None:
    """Of an all-to-all over 64 ranks, 8 to a node, each rank's share for the 7 others on its node
    goes over NVLink beside the 56 shares that cross the network; a ring's every hop shares a NIC."""
    from fivefold.plan.comm import collective_time, ep_members_per_node

    hw = load_hardware("h800")
    payload = 4e9  # latency is noise beside it
    all_network = collective_time(hw, "all_to_all", payload, 64, "mixed", 1)[1]
    eight_a_node = collective_time(hw, "all_to_all", payload, 64, "mixed", 8)[1]
    assert eight_a_node == pytest.approx(all_network * 56 / 63, rel=0.01)
    # the NVLink share is the bound where the network is the faster link
    fast_net = dataclasses.replace(hw, inter_node_gbps=10 * hw.intra_node_gbps)
    nvlink_bound = collective_time(fast_net, "all_to_all", payload, 64, "mixed", 8)[1]
    share = payload * 7 / 64 / (hw.intra_node_gbps * 1e9)
    assert nvlink_bound > share
    # an expert group's members on a node follow the mesh: ep 64 over fsdp holds 8 a node; over
    # cp 2 inside tp 4, two
    assert ep_members_per_node(Layout(pp=16, ep=64, fsdp=128, zero=2).resolve(2048), 8) == 8
    assert ep_members_per_node(Layout(tp=4, cp=2, ep=8, fsdp=8, pp=8).resolve(512), 8) == 2


@pytest.mark.parametrize(
    ("model", "gpus", "flags"),
    [
        ("mixtral-8x7b", 64, {"fsdp": 64, "zero": 3}),
        ("qwen3-30b-a3b", 16, {"tp": 4, "sp": True, "fsdp": 4, "zero": 2}),
        # DTensor's full recompute stops before a block's last reduce-scatter: counted, not exposed
        ("llama3-70b", 64, {"tp": 8, "pp": 2, "sp": True, "fsdp": 4, "zero": 2, "recompute": "full"}),
        # DualPipeV's hidden all-to-alls run again in the recomputed forward: exposed as the step has it
        (
            "qwen3-30b-a3b",
            128,
            {"pp": 2, "fsdp": 64, "ep": 64, "zero": 2, "pp_schedule": "dualpipev", "recompute": "full"},
        ),
    ],
)
def test_no_collective_shows_more_time_than_it_takes(model: str, gpus: int, flags: dict) -> None:
    """With ep 1 the experts' FSDP group is as large as the dense one: the two shards' gathers were
    keyed by group size, so the experts' overwrote the dense ones and each row took the experts'
    whole exposure (a reduce-scatter 'exposed' 1.55 s of its 1.35 s, the step 42% too slow)."""
    spec = load_model(model)
    shape = TrainShape(seq_len=4096, global_batch=32 if gpus == 16 else 128, micro_batch=1)
    p = plan(spec, load_hardware("h100-80gb"), Layout(**flags).resolve(gpus), shape)
    for c in p.comm:
        assert c.exposed_s <= c.time_s * (1 + 1e-9), (c.axis, c.op, c.exposed_s, c.time_s)
    # and the rows' exposed seconds are the step's: nothing charged that no row shows, or the reverse
    assert sum(c.exposed_s for c in p.comm) == pytest.approx(p.exposed_comm_s)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_a_short_pipelines_fill_and_drain_wait_in_the_bubble_not_in_its_sends(schedule: str) -> None:
    """Two micro-batches through 8 stages: the fill and drain cross 7 boundaries each, more than the
    4 transfers this rank makes. The rest is a wait on other ranks' links, in the bubble; the step
    does not change."""
    spec, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    v = 2 if schedule == "interleaved-1f1b" else 1
    layout = Layout(pp=8, pp_schedule=schedule, virtual_stages=v).resolve(8)
    p = plan(spec, hw, layout, TrainShape(seq_len=4096, global_batch=2, micro_batch=1))
    sends = [c for c in p.comm if c.axis == "pp"]
    assert sends and all(c.exposed_s <= c.time_s * (1 + 1e-9) for c in sends)
    # the critical path's hops are all in the step: the bubble holds those this rank does not make
    long = plan(spec, hw, layout, TrainShape(seq_len=4096, global_batch=64, micro_batch=1))
    assert sum(c.exposed_s for c in long.comm if c.axis == "pp") > sum(c.exposed_s for c in sends)
    assert p.step_time_s == pytest.approx(
        p.compute_time_s + p.bubble_time_s + p.exposed_comm_s + p.optimizer_time_s
    )


@pytest.mark.parametrize(
    ("model", "hardware", "axes"),
    [
        ("llama3-8b", "a100-80gb", {"tp": 4, "fsdp": 4, "dp": 16}),
        ("llama3-70b", "mi300x", {"tp": 4, "fsdp": 4, "dp": 4}),
    ],
)
def test_collectives_behind_one_backward_share_its_window(model: str, hardware: str, axes: dict) -> None:
    """HSDP's reduce-scatter and its replicas' all-reduce queue behind the same backward: the window
    hides each second once. When each hid behind the whole backward, full recompute, which only
    lengthens that window, planned a faster step than no recompute (by 7% on the first)."""
    spec, hw = load_model(model), load_hardware(hardware)
    gpus = axes["tp"] * axes["fsdp"] * axes["dp"]
    shape = TrainShape(seq_len=4096, global_batch=gpus // axes["tp"] * 2)
    steps = {
        rc: plan(spec, hw, Layout(**axes, sp=True, zero=3, recompute=rc).resolve(gpus), shape)
        for rc in ("none", "full")
    }
    assert steps["none"].fits
    assert steps["full"].step_time_s > steps["none"].step_time_s
    none = steps["none"]
    hidden_b = sum(
        c.time_s - c.exposed_s for c in none.comm if c.axis in ("fsdp", "dp") and c.op != "all_gather"
    )
    assert hidden_b <= none.microbatches * none.stage_times["backward_s"] * (1 + 1e-9)


def test_a_step_lasts_at_least_its_nics_traffic() -> None:
    """Every collective that leaves the node goes through the rank's NICs one after another: what
    each hides behind its own compute window cannot add up to more than the step. Here the experts'
    all-to-alls and FSDP's gathers and reductions had 5.6 s of NIC traffic in a 4.1 s step."""
    spec, hw = load_model("qwen3-30b-a3b"), load_hardware("b200")
    layout = Layout(tp=16, sp=True, fsdp=64, zero=3, ep=2, cp_impl="ulysses", recompute="full").resolve(1024)
    p = plan(spec, hw, layout, TrainShape(seq_len=8192, global_batch=128, micro_batch=2))
    off_node = [c for c in p.comm if c.link == "inter"]
    assert {c.axis for c in off_node} >= {"ep", "fsdp"}
    assert p.step_time_s >= sum(c.time_s for c in off_node) * (1 - 1e-9)
    assert all(c.exposed_s <= c.time_s * (1 + 1e-9) for c in p.comm)
    parts = p.compute_time_s + p.bubble_time_s + p.exposed_comm_s + p.optimizer_time_s
    assert p.step_time_s == pytest.approx(parts)


def test_an_all_reduce_over_thousands_of_ranks_takes_the_tree() -> None:
    """Across nodes NCCL runs all-reduce down and up a tree when the ring's 2(n-1) latencies dominate:
    DDP of an 8B model over 4,096 H100 is not ten times slower a step than over 8 (a ring-only plan
    had 42.9 s against 4.2 s)."""
    spec, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    steps = {
        g: plan(spec, hw, Layout(dp=g, zero=0).resolve(g), TrainShape(seq_len=4096, global_batch=2 * g))
        for g in (8, 4096)
    }
    assert steps[4096].step_time_s < 1.5 * steps[8].step_time_s
    ring = 2 * (4096 - 1) * hw.inter_node_latency_us * 1e-6  # one bucket's ring latency alone
    ar = next(c for c in steps[4096].comm if c.op == "all_reduce")
    assert ar.time_s / ar.count < ring


def test_attention_pays_a_fixed_cost_per_query_block_that_long_sequences_amortise() -> None:
    """A FlashAttention-class core costs its scores plus a fixed share per query block worth
    `attention_fixed_keys` keys: per causal score, 1k tokens run 1.5x slower than 16k ones at 256 keys
    (FlashAttention-2's published A100 rates: 134 and 189 TFLOP/s). A non-causal core, and a ring
    call that sees one peer's chunk, are judged by the keys each call visits; a CPU preset has none."""
    from fivefold.plan.compute import Rates, layer_time
    from fivefold.plan.spec import resolve_arch

    model = load_model("llama3-8b")
    arch = resolve_arch(model)

    def core(hw, seq: int, causal: bool = True, cp: int = 1) -> tuple[float, float]:
        """The attention core's forward seconds with the hardware's fixed cost, and without it."""
        layout = Layout(cp=cp, dp=1).resolve(cp)
        rates = Rates.of(hw)
        with_fixed, without = (
            layer_time(model, arch, layout, 1, seq, r, False, causal_skip=causal).attn_core_fwd
            for r in (rates, dataclasses.replace(rates, fixed_keys=0.0))
        )
        return with_fixed, without

    h100 = load_hardware("h100-80gb")
    assert h100.attention_fixed_keys == 256
    cases = ((1024, True, 1, 1.5), (16384, True, 1, 1 + 256 / 8192), (1024, False, 1, 1.25))
    # a ring of 4 over 16k tokens: each call sees a 4k chunk, of which a causal query visits half
    cases += ((16384, True, 4, 1 + 256 / 2048),)
    for seq, causal, cp, factor in cases:
        with_fixed, without = core(h100, seq, causal, cp)
        assert with_fixed == pytest.approx(without * factor)
    # per causal score, the short sequence is the slower one
    short, long = core(h100, 1024)[0] / 1024**2, core(h100, 16384)[0] / 16384**2
    assert short / long == pytest.approx(1.5 / (1 + 256 / 8192))
    cpu = load_hardware("cpu")
    assert cpu.attention_fixed_keys == 0 and core(cpu, 1024)[0] == core(cpu, 1024)[1]
