"""Layout search: fits, ranks by step time, explains itself in the decision order, and is fast."""

from __future__ import annotations

import copy
import math
import re
import time

import pytest

from fivefold.config import Layout, load_hardware, load_model
from fivefold.plan import TrainShape, plan
from fivefold.plan.result import capacity
from fivefold.plan.search import layout_flags, search


def test_405b_on_16k_gpus_is_fast_and_sensible() -> None:
    model, hw = load_model("llama3-405b"), load_hardware("h100-80gb")
    start = time.process_time()  # this process's CPU time: other load on the machine does not count
    result = search(model, hw, 16384, TrainShape(seq_len=8192, global_batch=2048))
    elapsed = time.process_time() - start
    assert elapsed < 2.0  # 1.2 s measured cold; benchmarks/bench_plan_search.py measures wall time
    assert result.plans and result.fitting > 0
    best = result.plans[0]
    times = [p.step_time_s for p in result.plans]
    assert times == sorted(times)
    assert all(p.memory.total <= capacity(hw) for p in result.plans)
    lay = best.layout
    assert lay.world == 16384
    # 810 GB of weights: tp inside the node, then pipeline stages (tp 4 with cp 8 and tp 8 with cp 4
    # come out within 0.1% of each other)
    assert 1 < lay.tp <= hw.gpus_per_node and lay.pp > 1
    text = "\n".join(result.explanation)
    assert f"Tensor parallel {lay.tp} inside one node" in text and "Pipeline parallel" in text
    assert text.index("Tensor parallel") < text.index("Pipeline parallel") < text.index("Data parallel")
    # the gradient traffic it quotes is the plan's, whatever the data group is called (cp folds in)
    quoted = float(re.search(r"gradient traffic ([0-9.e-]+) s a step", text).group(1))
    data_axes = {"dp", "fsdp", "batch", "fsdp_cp", "dp_fsdp_cp"}
    assert quoted > 0 and quoted == float(f"{sum(c.time_s for c in best.comm if c.axis in data_axes):.3g}")


def test_search_agrees_with_plan_and_prefers_simple_layouts_for_small_models() -> None:
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=256)
    result = search(model, hw, 64, shape, top=5)
    best = result.plans[0]
    again = plan(model, hw, best.layout, best.shape)
    assert again.step_time_s == best.step_time_s
    # an 8B model needs no tensor parallelism and no pipeline: plain FSDP is within 1% of the best
    # (a pipeline of 2 halves the FSDP traffic of each rank, which buys about that much)
    assert best.layout.tp == 1 and best.layout.pp <= 2
    simple = [p for p in result.plans if p.layout.pp == 1 and p.layout.tp == 1]
    assert simple and simple[0].step_time_s <= 1.01 * best.step_time_s
    zero1 = plan(model, hw, Layout(dp=64, zero=1).resolve(64), best.shape)
    # fivefold's ZeRO-1 broadcasts every fp32 weight after the step, behind nothing
    assert zero1.step_time_s > best.step_time_s and ("dp", "broadcast") in {
        (c.axis, c.op) for c in zero1.comm
    }


def test_search_reports_when_nothing_fits() -> None:
    model, hw = load_model("llama3-405b"), load_hardware("a100-80gb")
    result = search(model, hw, 8, TrainShape(seq_len=4096, global_batch=8))
    assert not result.plans
    assert "no layout fits" in result.explanation[0]


def test_moe_search_uses_expert_parallelism() -> None:
    model, hw = load_model("mixtral-8x7b"), load_hardware("h100-80gb")
    result = search(model, hw, 64, TrainShape(seq_len=4096, global_batch=256), top=3)
    assert result.plans
    assert any("Expert parallel" in line for line in result.explanation)


def test_pinned_search_keeps_the_given_flags_and_searches_the_rest() -> None:
    model, hw = load_model("llama3-405b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=8192, global_batch=2048)
    free = search(model, hw, 16384, shape, top=3)
    start = time.process_time()
    pinned = search(model, hw, 16384, shape, top=3, pins={"tp": 8, "pp": 16, "recompute": None})
    assert time.process_time() - start < 2.0  # the benchmark measures about 0.1 s
    assert pinned.plans
    for p in pinned.plans:
        assert (p.layout.tp, p.layout.pp) == (8, 16)
    # pinning may only cost time: the free search's best is at least as fast
    assert free.plans[0].step_time_s <= pinned.plans[0].step_time_s + 1e-9
    # the rest is still searched: the free axes and the micro-batch vary among the results
    varied = {
        (
            p.layout.pp_schedule,
            p.layout.virtual_stages,
            p.layout.dp,
            p.layout.zero,
            p.layout.cp,
            p.shape.micro_batch,
        )
        for p in pinned.plans
    }
    assert len(varied) > 1
    one = search(
        model, hw, 16384, shape, top=2, pins={"tp": 8, "pp": 16, "recompute": "full", "micro_batch": 1}
    )
    assert all(p.layout.recompute == "full" and p.shape.micro_batch == 1 for p in one.plans)
    none = search(model, hw, 16384, shape, pins={"tp": 1, "pp": 1, "zero": 0})  # 6.5 TB of state per GPU
    assert not none.plans and "fixed" in none.explanation[0]


def test_search_recomputes_the_fewest_blocks_that_fit() -> None:
    """GPT-3 175B on 96 H100s, tp 4 × pp 8 interleaved: keeping every activation does not fit and
    recomputing every block wastes time, so the search recomputes some blocks of each chunk: the
    fewest that fit (one block fewer does not)."""
    from fivefold.config import Layout, ModelSpec

    model = ModelSpec(layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=4 * 12288, vocab=51200)
    hw = load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=1152)
    pins = {"tp": 4, "pp": 8, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batch": 1}
    best = search(model, hw, 96, shape, top=1, pins=pins).plans[0]
    lay = best.layout
    assert lay.recompute == "full" and 0 < lay.recompute_layers < 6 and best.fits
    for fewer in range(lay.recompute_layers):  # 0 blocks: keep every activation
        rc = {"recompute": "full", "recompute_layers": fewer} if fewer else {"recompute": "none"}
        assert not plan(model, hw, Layout(**{**vars(lay), **rc}), best.shape).fits
    every = plan(model, hw, Layout(**{**vars(lay), "recompute_layers": 0}), best.shape)
    assert best.step_time_s < every.step_time_s
    assert f"--recompute full --recompute-layers {lay.recompute_layers}" in layout_flags(lay)
    # pinned: a given block count is kept, and implies full recompute
    two = search(model, hw, 96, shape, top=1, pins={**pins, "recompute_layers": 5}).plans[0]
    assert (two.layout.recompute, two.layout.recompute_layers) == ("full", 5)


def test_a_pinned_schedule_or_chunk_count_searches_pipelines_that_can_hold_it() -> None:
    """--pp-schedule or --virtual-stages asks for a pipeline: pp 1 is not an answer, and a stage
    count with more chunks than layers (pp 64 × 2 on 80) is skipped, not a crash of the search."""
    from fivefold.errors import FivefoldError

    model, hw = load_model("llama3-70b"), load_hardware("h100-80gb")
    # (GPipe keeps every micro-batch's activations: at 8,192 tokens fivefold's eager blocks fit no GPipe
    # layout of this batch on 64 GPUs, even recomputing every block)
    shape = TrainShape(seq_len=4096, global_batch=256)
    gpipe = search(model, hw, 64, shape, top=3, pins={"pp_schedule": "gpipe"})
    assert gpipe.plans and all(p.layout.pp > 1 and p.layout.pp_schedule == "gpipe" for p in gpipe.plans)
    chunks = search(model, hw, 64, shape, top=3, pins={"virtual_stages": 2})
    assert chunks.plans and all(p.layout.pp > 1 and p.layout.virtual_stages == 2 for p in chunks.plans)
    for pins, needle in (
        ({"pp": 32, "virtual_stages": 4}, "exceeds the 80 layers"),
        ({"ep": 2}, "needs a mixture-of-experts model"),
    ):
        try:
            search(model, hw, 64, shape, pins=pins)
        except FivefoldError as exc:
            assert needle in str(exc)
        else:
            raise AssertionError(f"search with {pins} was not refused")


def test_pinned_flags_that_contradict_or_that_train_refuses_are_named() -> None:
    """--fsdp 8 --zero 1 is refused as the plan and train refuse it; --sp asks for tp > 1; a pinned
    combination every candidate of which train refuses says why, not that nothing fits."""
    from fivefold.errors import FivefoldError

    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=8192, global_batch=512)
    try:
        search(model, hw, 64, shape, pins={"fsdp": 8, "zero": 1})
    except FivefoldError as exc:
        assert "--zero must be 2 or 3" in str(exc)
    else:
        raise AssertionError("--fsdp 8 --zero 1 was searched")
    sp = search(model, hw, 64, shape, top=3, pins={"sp": True})
    assert sp.plans and all(p.layout.tp > 1 and p.layout.sp for p in sp.plans)
    split = search(model, hw, 64, shape, pins={"pp_schedule": "zero-bubble", "zero": 3, "fsdp": 8})
    assert not split.plans and "can be trained" in split.explanation[0]
    assert "use --zero 2" in split.explanation[0]
    # without fsdp pinned, zero 3 stands where no data rank shards anything (tp × pp fill the world)
    moot = search(model, hw, 64, shape, pins={"pp_schedule": "zero-bubble", "zero": 3})
    assert moot.plans and all(p.layout.dp * p.layout.fsdp == 1 for p in moot.plans)
    # chunks that differ by a layer are trained (the cost-balanced split), so they are searched
    uneven = search(model, hw, 64, shape, pins={"pp_schedule": "interleaved-1f1b", "virtual_stages": 3})
    assert uneven.plans and all(p.layout.virtual_stages == 3 for p in uneven.plans)


def test_pins_train_refuses_are_named_by_trains_own_check_not_as_memory() -> None:
    """Pins whose every layout train refuses say so in train's words, as an input error: not that the
    model state or the activations do not fit (the search had blamed memory for a 0.2 MB model)."""
    tiny, moe, cpu = load_model("tiny"), load_model("tiny-moe"), load_hardware("cpu")
    shape = TrainShape(seq_len=16, global_batch=8)
    for model, pins, words in (
        (tiny, {"dp": 4, "zero": 2}, "--zero 2 shards gradients with FSDP"),
        (moe, {"ep": 2, "zero": 1}, "must divide fsdp×cp"),
        (
            tiny,
            {"pp": 2, "pp_schedule": "dualpipev", "recompute": "full"},
            "cannot run with --recompute full",
        ),
        # a block count is full recompute, which DualPipeV refuses on every pipeline
        (tiny, {"pp_schedule": "dualpipev", "recompute_layers": 1}, "cannot run with --recompute full"),
        # chunks no pipeline of this world holds: named on the smallest pipeline, as train names it
        (moe, {"virtual_stages": 3, "pp_schedule": "zero-bubble"}, "exceeds the 4 layers"),
    ):
        result = search(model, cpu, 4, shape, pins=dict(pins))
        assert not result.plans and result.input_error, pins
        assert "can be trained" in result.explanation[0] and words in result.explanation[0], (
            result.explanation
        )
    # the tp shards ZeRO-1 cannot take, where the layouts without a pipeline are also too big
    big = search(
        load_model("llama3-405b"),
        load_hardware("h100-80gb"),
        16384,
        TrainShape(8192, 2048),
        pins={"tp": 8, "zero": 1},
    )
    assert big.input_error and "ZeroRedundancyOptimizer" in big.explanation[0]


def test_the_flags_a_search_prints_train_the_plan_it_scored() -> None:
    """The layouts a search proposes, free or pinned, their flags given to train as printed: train takes
    them, and splits a pipelined data rank's batch into the plan's micro-batch count and size."""
    import argparse
    import shlex

    from fivefold.commands import train as train_command
    from fivefold.plan.search import plan_flags
    from fivefold.train.loop import runtime_layout

    seen = 0
    for name, gpus, seq, batch, pins in (
        ("tiny", 4, 128, 32, {}),
        ("tiny-moe", 8, 128, 16, {}),
        # pinned searches too: each pin restricts the search, none may take it outside what train runs
        ("tiny-moe", 8, 128, 16, {"ep": 2}),
        ("tiny-moe", 8, 128, 16, {"ep": 2, "tp": 2}),
        ("tiny-moe", 8, 128, 16, {"cp": 2, "ep": 2}),
        ("tiny", 8, 128, 16, {"tp": 2, "pp": 2}),
        ("tiny", 4, 128, 16, {"pp": 2, "zero": 3}),
        ("tiny", 4, 128, 16, {"sp": True, "recompute": "full"}),
        # a ZeRO stage pinned where no data rank shards it: train takes it, so the search keeps it
        ("tiny", 2, 128, 8, {"tp": 2, "zero": 1}),
        ("tiny", 4, 128, 8, {"tp": 2, "pp": 2, "zero": 1}),
        ("tiny-moe", 4, 128, 8, {"cp": 4, "ep": 2, "zero": 1}),
    ):
        result = search(
            load_model(name), load_hardware("cpu"), gpus, TrainShape(seq, batch), top=6, pins=pins
        )
        assert result.plans, pins
        for p in result.plans:
            parser = argparse.ArgumentParser()
            train_command.add_arguments(parser)
            argv = ["--model", name, "--seq-len", str(seq), "--global-batch", str(batch)]
            cfg = train_command.build_run_config(parser.parse_args(argv + shlex.split(plan_flags(p))))
            lay = runtime_layout(cfg.layout, gpus, cfg.model, seq)  # raises where train refuses
            local = cfg.train.micro_batch * cfg.train.grad_accum(lay.dp * lay.fsdp)
            if lay.pp > 1:
                assert (lay.microbatches, local // lay.microbatches) == (p.microbatches, p.shape.micro_batch)
                seen += 1
    assert seen >= 5


def test_a_pinned_expert_degree_is_searched_over_the_data_ranks_that_hold_it() -> None:
    """--ep 2 alone: fsdp × cp is searched to hold it, not checked at its default of 1."""
    result = search(
        load_model("mixtral-8x7b"), load_hardware("h100-80gb"), 64, TrainShape(4096, 256), pins={"ep": 2}
    )
    assert result.plans and all(p.layout.ep == 2 for p in result.plans)
    tiny = search(load_model("tiny-moe"), load_hardware("cpu"), 8, TrainShape(128, 16), top=0, pins={"ep": 2})
    assert tiny.plans
    for pinned, gpus in ((result, 64), (tiny, 8)):  # each as train resolves it: ep folds onto fsdp × cp
        for p in pinned.plans:
            assert (p.layout.fsdp * p.layout.cp) % 2 == 0
            copy.copy(p.layout).resolve(gpus)


def test_the_explanation_says_what_a_small_layout_is() -> None:
    """Two CPU ranks of a tiny MoE: the stages sit inside one node (not "across nodes"), the weights
    are fp32 and counted in MB (not "16-bit ... 0.0 GB"), and an axis at 1 is said to be absent."""
    model, hw = load_model("tiny-moe"), load_hardware("cpu")
    shape = TrainShape(seq_len=128, global_batch=16, act_bytes=4, param_bytes=4)
    result = search(model, hw, 2, shape, pins={"pp": 2, "dp": 1, "fsdp": 1, "ep": 1})
    text = "\n".join(result.explanation)
    assert "Pipeline parallel 2 inside one node" in text and "across nodes" not in text
    assert re.search(r"the 32-bit weights \(0\.\d MB\)", text), text
    assert "No data parallelism" in text and "No expert parallelism: every rank holds all 4 experts" in text


def test_a_data_axis_pinned_to_fill_keeps_the_other_data_axis_at_one() -> None:
    """--dp -1 pinned (as `plan` pins the flags of a layout that does not fit, to suggest the nearest):
    dp takes the data ranks the other axes leave, so fsdp is 1; and the other way round."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=4096, global_batch=1024)
    for fill, other in (("dp", "fsdp"), ("fsdp", "dp")):
        result = search(model, hw, 8, shape, top=5, pins={fill: -1})
        assert result.plans and all(getattr(p.layout, other) == 1 for p in result.plans)


def test_random_pinned_searches_propose_only_what_train_runs_or_name_why_not() -> None:
    """Pins drawn at random over every pinnable flag, on tiny models whose state fits anywhere: each
    search ends in layouts that train takes as printed, or in an input error naming train's reason;
    never in 'nothing fits', which for a 0.2 MB model would be a wrong diagnosis."""
    import argparse
    import random
    import shlex

    from fivefold.commands import train as train_command
    from fivefold.errors import FivefoldError
    from fivefold.plan.search import plan_flags
    from fivefold.train.loop import runtime_layout

    cpu = load_hardware("cpu")
    models = {name: load_model(name) for name in ("tiny", "tiny-moe")}
    choices = {
        "dp": [1, 2, 4, -1],
        "fsdp": [1, 2, 4, -1],
        "tp": [1, 2, 4],
        "pp": [1, 2, 4],
        "cp": [1, 2, 4],
        "ep": [1, 2, 4],
        "zero": [0, 1, 2, 3],
        "sp": [True, False],
        "pp_schedule": ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"],
        "virtual_stages": [1, 2, 3],
        "recompute": ["none", "selective", "full"],
        "recompute_layers": [1, 2],
        "cp_impl": ["ring", "allgather", "ulysses"],
    }
    draw = random.Random(7)
    proposals = answered = 0
    for _ in range(160):
        name, gpus = draw.choice(sorted(models)), draw.choice([2, 4, 8])
        seq, batch = draw.choice([64, 128]), draw.choice([8, 16])
        pins = {k: draw.choice(choices[k]) for k in draw.sample(sorted(choices), draw.randint(1, 3))}
        try:
            result = search(models[name], cpu, gpus, TrainShape(seq, batch), top=2, pins=dict(pins))
        except FivefoldError:  # pins no world holds (--fsdp 4 --zero 1): refused before any search
            continue
        assert result.plans or result.input_error, (name, gpus, pins, result.explanation)
        answered += 1
        for p in result.plans:
            parser = argparse.ArgumentParser()
            train_command.add_arguments(parser)
            argv = ["--model", name, "--seq-len", str(seq), "--global-batch", str(batch)]
            cfg = train_command.build_run_config(parser.parse_args(argv + shlex.split(plan_flags(p))))
            runtime_layout(cfg.layout, gpus, cfg.model, seq)  # raises where train refuses
            proposals += 1
    assert answered >= 100 and proposals >= 150


def test_the_layout_plan_issues_zero1_as_the_runtime_does() -> None:
    """fivefold's ZeRO-1 is torch's ZeroRedundancyOptimizer: DDP's all-reduce of the whole gradient,
    then one broadcast of each parameter tensor from its owner. The layout plan counts those calls
    and bytes, as the exact step verify judges (plan/step.py) counts them."""
    from fivefold.plan.step import plan_step

    model, cpu = load_model("tiny"), load_hardware("cpu")
    layout = Layout(dp=2, zero=1).resolve(2)
    fp32 = TrainShape(seq_len=16, global_batch=4, micro_batch=2, act_bytes=4, param_bytes=4)
    p = plan(model, cpu, layout, fp32, 8)
    ops = {(c.axis, c.op): c for c in p.comm}
    assert set(ops) == {("dp", "all_reduce"), ("dp", "broadcast")}
    exact = plan_step(
        model, layout, 2, 16, 1, "fp32", {"dp": 0, "fsdp_cp": 0, "tp": 0, "pp": 0, "cp": 0}
    ).comm
    assert (ops[("dp", "broadcast")].count, ops[("dp", "broadcast")].bytes) == exact[("dp", "broadcast")]
    # beside cp, DDP reduces over dp×cp but ZeroRedundancyOptimizer partitions over dp alone: the
    # broadcasts' group and each rank's share of the moments are dp's
    cp = Layout(dp=2, cp=2, zero=1).resolve(4)
    p = plan(model, cpu, cp, fp32, 8)
    ops = {(c.axis, c.op): c for c in p.comm}
    coords = {"dp": 0, "fsdp_cp": 0, "tp": 0, "pp": 0, "cp": 0}
    step = plan_step(model, cp, 2, 16, 1, "fp32", coords)
    assert ops[("dp", "broadcast")].group == 2
    assert (ops[("dp", "broadcast")].count, ops[("dp", "broadcast")].bytes) == step.comm[("dp", "broadcast")]
    assert p.memory.optimizer == pytest.approx(step.state["optimizer"], rel=0.01)
    # an MoE stage's experts go out in the same broadcasts as its dense weights: every byte once, one
    # call per tensor of the runtime's (router, stacked experts, shared expert: 13 a block, not 9),
    # on each stage of a pipeline too
    moe = load_model("tiny-moe")
    for lay in (layout, Layout(dp=2, pp=2, zero=1).resolve(4)):
        ops = {(c.axis, c.op): c for c in plan(moe, cpu, lay, fp32, 8).comm}
        per_stage = [
            plan_step(moe, lay, 2, 16, 2, "fp32", {"dp": 0, "fsdp_cp": 0, "tp": 0, "pp": r, "cp": 0}).comm[
                ("dp", "broadcast")
            ]
            for r in range(lay.pp)
        ]
        assert (ops[("dp", "broadcast")].count, ops[("dp", "broadcast")].bytes) in per_stage, lay


def test_the_layout_plan_names_expert_shards_as_the_ledger_does() -> None:
    """fsdp × ep: each MoE layer's experts are an FSDP unit of their own over expert_fsdp (the
    ledger's word). The layout plan counted them as more fsdp units (24 gathers where the runtime
    issues 12 over fsdp and 8 over expert_fsdp), without ep counted a block's experts as a unit of
    their own, and did not pad their shards (2 local experts over 4 ranks: each holds a whole one);
    its rows and model state now are the exact step's."""
    from fivefold.plan.step import plan_step

    model, cpu = load_model("tiny-moe"), load_hardware("cpu")
    coords = {"dp": 0, "fsdp_cp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0}
    for fsdp, cp, ep, zero in ((4, 1, 2, 2), (4, 1, 2, 3), (2, 2, 2, 3), (2, 1, 1, 3)):
        layout = Layout(fsdp=fsdp, cp=cp, ep=ep, zero=zero).resolve(fsdp * cp)
        fp32 = TrainShape(seq_len=128, global_batch=8 * fsdp, micro_batch=8, act_bytes=4, param_bytes=4)
        p = plan(model, cpu, layout, fp32, 8)
        ops = {(c.axis, c.op): (c.count, c.bytes) for c in p.comm}
        step = plan_step(model, layout, 8, 128, 1, "fp32", coords)
        data = "fsdp_cp" if cp > 1 else "fsdp"
        for key in ((data, "all_gather"), (data, "reduce_scatter")):
            assert ops[key] == step.comm[key], (layout, key)
        for key in (("expert_fsdp", "all_gather"), ("expert_fsdp", "reduce_scatter")):
            assert ops.get(key) == step.comm.get(key), (layout, key)
        assert p.memory.params == pytest.approx(step.state["params"], rel=0.01)


def test_the_layout_plan_sums_nothing_over_tp_for_a_whole_moe_block() -> None:
    """fivefold's MoE block runs whole on every tp rank: without sp it needs no all-reduce (its output
    is the same on each rank), under sp it gathers its input and slices its output. The layout plan
    gave it a dense MLP's two collectives a layer and pass (22 all-reduces where the runtime issues 14)."""
    from fivefold.plan.step import plan_step

    model, cpu = load_model("tiny-moe"), load_hardware("cpu")
    fp32 = TrainShape(seq_len=128, global_batch=8, micro_batch=8, act_bytes=4, param_bytes=4)
    coords = {"dp": 0, "fsdp_cp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0}
    for sp in (False, True):
        layout = Layout(tp=2, sp=sp).resolve(2)
        ops = {(c.axis, c.op): (c.count, c.bytes) for c in plan(model, cpu, layout, fp32, 8).comm}
        exact = plan_step(model, layout, 8, 128, 1, "fp32", coords).comm
        tp_ops = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        for op in tp_ops:
            assert ops[("tp", op)] == exact[("tp", op)], (sp, op)


@pytest.mark.parametrize(
    ("model_name", "flags", "key"),
    [
        ("tiny", {"dp": 2, "tp": 2}, ("dp", "all_reduce")),  # torch's replicate: one a unit
        ("tiny", {"dp": 2, "fsdp": 2, "zero": 3}, ("dp", "all_reduce")),  # HSDP: one a unit
        ("tiny-moe", {"dp": 2, "fsdp": 2, "ep": 2, "zero": 3}, ("dp", "all_reduce")),  # + 3 an expert unit
        ("small", {"dp": 2, "zero": 1}, ("dp", "broadcast")),  # a tied head is the embedding's tensor
    ],
)
def test_the_layout_plan_issues_data_parallel_calls_as_the_runtime_does(model_name, flags, key) -> None:
    """The data-parallel calls the runtime issues: beside tp, torch's `replicate` all-reduces each
    FSDP2 unit (the plan counted DDP's buckets: 1 where it issues 6), HSDP each unit's shard and each
    expert unit's three tensors, and ZeRO-1 broadcasts each tensor once (a tied pair once). The exact
    step adds the gradient norm's scalar all-reduces; the layout plan leaves those out."""
    from fivefold.plan.step import plan_step

    model, cpu = load_model(model_name), load_hardware("cpu")
    layout = Layout(**flags).resolve(math.prod(flags.get(a, 1) for a in ("dp", "fsdp", "tp")))
    data = layout.dp * layout.fsdp
    fp32 = TrainShape(seq_len=128, global_batch=8 * data, micro_batch=8, act_bytes=4, param_bytes=4)
    ops = {(c.axis, c.op): (c.count, c.bytes) for c in plan(model, cpu, layout, fp32, 8).comm}
    coords = {"dp": 0, "fsdp_cp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0}
    exact = plan_step(model, layout, 8, 128, 1, "fp32", coords).comm
    (count, nbytes), (want_count, want_bytes) = ops[key], exact[key]
    scalars = 2 if key[1] == "all_reduce" else 0  # the gradient norm's, in the exact step only
    assert want_count - scalars <= count <= want_count
    assert nbytes == pytest.approx(want_bytes, abs=8 * scalars)


def test_the_layout_plan_averages_pipeline_replicas_one_tensor_at_a_time() -> None:
    """pp × dp: fivefold's pipeline runner averages each gradient tensor over the replicas once the
    schedule has run, one all-reduce each (20 on a stage of tiny), which the plan counted as DDP's one
    bucket beside the backward."""
    from fivefold.plan.step import plan_step

    model, cpu = load_model("tiny"), load_hardware("cpu")
    layout = Layout(dp=2, pp=2, microbatches=2).resolve(4)
    fp32 = TrainShape(seq_len=128, global_batch=16, micro_batch=4, act_bytes=4, param_bytes=4)
    p = plan(model, cpu, layout, fp32, 8)
    reduce = next(c for c in p.comm if (c.axis, c.op) == ("dp", "all_reduce"))
    coords = {"dp": 0, "fsdp_cp": 0, "tp": 0, "cp": 0, "ep": 0}
    counts = {plan_step(model, layout, 4, 128, 2, "fp32", {**coords, "pp": s}).comm[("dp", "all_reduce")][0]
              for s in range(2)}  # fmt: skip
    assert min(counts) - 2 <= reduce.count <= max(counts) and reduce.count > 2
    assert reduce.overlap == "none"  # after the schedule: nothing left to hide behind
