"""The bubble of torch's own schedule tables against the closed forms of the papers."""

from __future__ import annotations

import pytest

from fivefold.measure.bubble import (
    COST_MODELS,
    action_table,
    closed_form,
    published_form,
    simulate,
    simulated_bubble,
)

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("model", ["unit", "1:2"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fill_drain_schedules_match_p_minus_1_over_m_plus_p_minus_1(schedule, model):
    for p, m in GRID:
        sim = simulated_bubble(schedule, p, m, 1, model)
        assert sim.idle_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)


@pytest.mark.parametrize("model", ["unit", "1:2"])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_shrinks_the_bubble_by_v(v, model):
    for p, m in GRID:
        sim = simulated_bubble("interleaved-1f1b", p, m, v, model)
        assert sim.idle_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)


@pytest.mark.parametrize("v", [1, 2])
def test_zero_bubble_fills_the_drain_with_weight_gradients(v):
    for p, m in GRID:
        for model in COST_MODELS:
            c = COST_MODELS[model]
            bubble = (p - 1) * (c["F"] + c["I"] - c["W"]) / v  # ZB-H1, Qi et al. 2024
            expect = bubble / (bubble + m * (c["F"] + c["B"]))
            sim = simulated_bubble("zero-bubble", p, m, v, model)
            assert sim.idle_fraction == pytest.approx(expect, abs=1e-12)
        # and it beats interleaved 1F1B with the same chunks under the 1:2 costs
        assert (
            simulated_bubble("zero-bubble", p, m, v, "1:2").idle_fraction
            < simulated_bubble("interleaved-1f1b", p, m, v, "1:2").idle_fraction
        )


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_reach_the_fill_bound(schedule):
    for p, m in GRID:
        if m < 2 * p:
            continue
        # with t_F = t_I = t_W (1:2) both reach the single-step bound (p-1)·t_F/2 exactly
        bound = (p - 1) * 0.5
        assert simulated_bubble(schedule, p, m, 2, "1:2").idle_fraction == pytest.approx(
            bound / (bound + 3 * m), abs=1e-12
        )
        unit = simulated_bubble(schedule, p, m, 2, "unit").idle_fraction
        assert unit >= closed_form(schedule, p, m, 2, "unit") - 1e-12
        # and both beat 1F1B by a wide margin
        assert unit < 0.5 * (p - 1) / (m + p - 1)


def test_dualpipev_reaches_the_bound_with_unequal_costs_and_zbv_does_not():
    p, m = 4, 8
    assert simulated_bubble("dualpipev", p, m, 2, "unit").idle_fraction == pytest.approx(
        closed_form("dualpipev", p, m, 2, "unit"), abs=1e-12
    )
    zbv = simulated_bubble("zbv", p, m, 2, "unit").idle_fraction
    assert zbv > closed_form("zbv", p, m, 2, "unit") + 0.01
    # the published steady-state forms are the lower numbers the papers quote
    assert published_form("zbv", p, m, "1:2") == 0.0
    assert published_form("dualpipev", p, m, "1:2") > 0.0


def test_closed_forms_by_hand():
    assert closed_form("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert closed_form("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert closed_form("zero-bubble", 4, 8, 1, "1:2") == pytest.approx(3 / 27)
    assert closed_form("gpipe", 1, 8) == 0.0


def test_table_repair_is_reported_and_tables_are_complete():
    table, repaired = action_table("1f1b", 4, 8)
    assert repaired  # torch numbers the last rank's 1F1B forwards from 1
    p, m = 4, 8
    for sched, v in [("gpipe", 1), ("zero-bubble", 2), ("zbv", 2), ("dualpipev", 2)]:
        table, repaired = action_table(sched, p, m, v)
        assert not repaired
        for stage in range(p * v):
            forwards = sorted(j for ops in table for s, k, j in ops if s == stage and k == "F")
            backwards = sorted(j for ops in table for s, k, j in ops if s == stage and k in ("B", "I"))
            assert forwards == backwards == list(range(m))


def test_simulator_detects_a_deadlock():
    # rank 0 waits for stage 1's gradient before stage 1 has run its forward
    table = [[(0, "F", 0), (0, "B", 0)], [(1, "B", 0), (1, "F", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(table, 2, COST_MODELS["unit"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_planner_bubble_equals_the_schedule_table(schedule: str, p: int, m: int) -> None:
    """The pure-Python planner's bubble must agree with torch's own action table at F:B = 1:2."""
    from fivefold.plan.pipeline import bubble_fraction

    v = 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1
    table = simulated_bubble(schedule, p, m, v, "1:2").idle_fraction
    assert bubble_fraction(schedule, p, m, v, 1.0, 2.0) == pytest.approx(table, abs=1e-9)
