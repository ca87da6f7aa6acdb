"""The explore page in a real browser: Debian's chromium driven by Playwright (no browser download).

Skipped on a machine without chromium or Playwright; under CI (the `CI` variable set) a missing
browser is a failure, not a skip. Every number the page shows is checked against `fivefold plan
--json` for the layout the page names, formatted as the page formats it. Screenshots of each
view go to $FIVEFOLD_ARTIFACTS (default: a temporary directory).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import time
from pathlib import Path

import pytest

from fivefold.cli import main as fivefold_main
from fivefold.config import Layout, load_hardware, load_model
from fivefold.explore import build_page
from fivefold.mesh import resolve_layout
from fivefold.plan import TrainShape
from test_explore import write_run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
HOSTILE = '<img src=x onerror="window.__owned=1">'


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if not Path(CHROMIUM).exists():
        return "chromium is not installed (apt-get install -y chromium)"
    return None


@pytest.fixture(scope="module")
def browser():
    why = _missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"browser tests must run in CI: {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    out = Path(os.environ.get("FIVEFOLD_ARTIFACTS") or tmp_path_factory.mktemp("explore-shots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _open(browser, html: str, path: Path, view: str | None = None):
    path.write_text(html)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: errors.append("request " + r.url) if not r.url.startswith("file:") else None)
    page.goto(path.as_uri() + (f"#{view}" if view else ""))
    page.wait_for_function("window.__fivefoldReady === true")
    page.errors = errors
    return page


@pytest.fixture(scope="module")
def lab_page(browser, tmp_path_factory):
    """llama3-8b on 16 GPUs with a layout, the search's best two, the lab and a run directory."""
    tmp = tmp_path_factory.mktemp("lab")
    run = write_run(tmp / "run", axis=HOSTILE)
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(tp=2, pp=2, dp=-1, sp=True, zero=1, pp_schedule="zero-bubble"), 16)
    also = [(load_hardware("a100-80gb"), 8, 8)]
    shape = TrainShape(seq_len=2048, global_batch=64)
    html = build_page(model, hw, 16, shape, layout, run_dir=run, top=2, lab_also=also)
    page = _open(browser, html, tmp / "page.html")
    yield page
    assert page.errors == [], page.errors  # no console errors, no request leaving the file
    page.close()


# --- the page's number formats, in Python -------------------------------------------------------


def sig(x: float) -> str:
    s = f"{x:#.4g}"
    if "e" in s:
        mant, exp = s.split("e")
        return f"{mant.rstrip('.')}e{int(exp):+d}"
    return s.rstrip(".")


def scaled(n: float, units: list[str], step: float) -> str:
    i = 0
    while abs(n) >= step and i < len(units) - 1:
        n /= step
        i += 1
    return sig(n) + (" " + units[i] if units[i] else "")


def fbytes(n: float) -> str:
    return scaled(n, ["B", "KB", "MB", "GB", "TB", "PB"], 1000)


def fsecs(s: float) -> str:
    return sig(s) + " s" if s >= 1 else sig(s * 1e3) + " ms" if s >= 1e-3 else sig(s * 1e6) + " µs"


def fpct(x: float) -> str:
    return sig(100 * x) + " %"


def fcount(n: float) -> str:
    return scaled(n, ["", "k", "M", "G"], 1000)


def plan_json(command: str) -> dict:
    """What `fivefold plan --json` prints for the command the page shows."""
    argv = shlex.split(command)
    assert argv[:2] == ["fivefold", "plan"] and "--json" in argv
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fivefold_main(argv[1:]) == 0
    return json.loads(out.getvalue())


def assert_result_matches_plan(page, root: str) -> dict:
    """KPIs, memory legend and the comm table under `root` equal `plan --json` of its command."""
    want = plan_json(page.inner_text(f"{root} [data-role=command]"))
    kpi = lambda k: page.inner_text(f'{root} [data-kpi="{k}"]')  # noqa: E731
    assert kpi("step_time_s") == fsecs(want["step_time_s"])
    assert kpi("mfu") == fpct(want["mfu"])
    assert kpi("tokens_per_s") == fcount(want["tokens_per_s"])
    assert kpi("bubble_fraction") == fpct(want["bubble_fraction"])
    assert kpi("microbatches") == str(want["microbatches"])
    assert kpi("memory_total") == fbytes(want["memory"]["total"])
    for part in ("params", "grads", "optimizer", "activations", "buffers"):
        assert page.inner_text(f'{root} [data-mem="{part}"]') == fbytes(want["memory"][part])
    # every note the page shows is one the plan prints (which adds the command's own about flags)
    shown = page.eval_on_selector_all(f"{root} [data-role=notes] li", "ls => ls.map(l => l.textContent)")
    assert all(n.removeprefix("note: ") in want["notes"] for n in shown), (shown, want["notes"])
    rows = page.eval_on_selector_all(
        f"{root} table[data-role=comm] tr", "rs => rs.slice(1).map(r => [...r.cells].map(c => c.textContent))"
    )
    expected = [
        [
            c["axis"],
            c["op"],
            c["link"],
            str(c["count"]),
            fbytes(c["bytes"]),
            fbytes(c["wire_bytes"]),
            fsecs(c["time_s"]),
            fsecs(c["exposed_s"]),
            c["overlap"] or "",
        ]
        for c in want["comm"]
    ]
    assert rows == expected
    fits = page.inner_text(f"{root} [data-role=fits]")
    assert fits.startswith("fits" if want["fits"] else "does NOT fit")
    return want


def canvas(page, root: str, role: str = "grid") -> str:
    return page.eval_on_selector(f"{root} canvas[data-role={role}]", "c => c.toDataURL()")


# --- the views ----------------------------------------------------------------------------------


def test_every_view_renders_and_is_screenshotted(lab_page, artifacts: Path) -> None:
    for view in ("strategy", "lab", "search", "inference", "run", "glossary"):
        lab_page.click(f'#tabs button[data-view="{view}"]')
        assert lab_page.is_visible(f"#view-{view}")
        # nothing drawn wider than its card: the page never scrolls sideways (a memory bar once did)
        wide = lab_page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert wide <= 0, (view, wide)
        lab_page.screenshot(path=str(artifacts / f"explore-{view}.png"), full_page=True)
        assert (artifacts / f"explore-{view}.png").stat().st_size > 5000
    assert lab_page.errors == []


def test_a_narrow_window_scrolls_inside_the_cards_not_the_page(lab_page) -> None:
    """Half a laptop screen: wide drawings and tables scroll inside their card; the page itself never
    scrolls sideways (the search view's rank grid, timeline and layout list once pushed it 200 px)."""
    for width in (640, 400, 320):  # half a laptop, a phone held upright
        lab_page.set_viewport_size({"width": width, "height": 900})
        try:
            for view in ("strategy", "lab", "search", "inference", "run", "glossary"):
                lab_page.click(f'#tabs button[data-view="{view}"]')
                wide = lab_page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
                assert wide <= 0, (width, view, wide)
        finally:
            lab_page.set_viewport_size({"width": 1280, "height": 900})


def test_strategy_picker_draws_each_cut_and_prices_it_with_the_planner(lab_page) -> None:
    lab_page.click('#tabs button[data-view="strategy"]')
    pictures = {}
    for kind in ("dp", "zero1", "zero2", "fsdp", "hsdp", "tp", "pp", "ep", "cp"):
        lab_page.click(f'#strategyButtons button[data-strategy="{kind}"]')
        pictures[kind] = lab_page.inner_html("#strategyPicture")
        if kind == "ep":  # a dense model: the page says why instead of inventing a price
            assert "no experts" in lab_page.inner_text("#strategyPrice")
            continue
        want = plan_json(lab_page.inner_text("#strategyPrice [data-role=command]"))
        rows = lab_page.eval_on_selector_all(
            "#strategyPrice table[data-role=strategy-comm] tr",
            "rs => rs.slice(1).map(r => [...r.cells].map(c => c.textContent))",
        )
        axes = {"dp": ["dp"], "zero1": ["dp"], "zero2": ["fsdp"], "fsdp": ["fsdp", "fsdp_cp"]}.get(kind)
        axes = axes or {"hsdp": ["fsdp", "fsdp_cp", "dp"], "tp": ["tp"], "pp": ["pp"], "cp": ["cp"]}[kind]
        expected = [
            [f"{c['op']} ({c['axis']})", f"{c['count']} × per step", c["link"], fbytes(c["bytes"])]
            + [fbytes(c["wire_bytes"]), fsecs(c["time_s"])]
            for c in want["comm"]
            if c["axis"] in axes
        ]
        assert rows == expected and rows, kind
        assert lab_page.inner_text("#strategyPrice [data-mem=optimizer]") == fbytes(
            want["memory"]["optimizer"]
        )
    assert len(set(pictures.values())) == len(pictures)  # every strategy cuts something else
    hatched = lambda kind: pictures[kind].count('data-cut="copy"')  # noqa: E731
    assert hatched("dp") > hatched("zero1") > hatched("zero2") > hatched("fsdp")  # less copied, step by step


def test_lab_numbers_are_the_planners_and_follow_the_controls(lab_page) -> None:
    lab_page.click('#tabs button[data-view="lab"]')
    # the lab starts on the given layout (tp 2, pp 2, zero-bubble, ZeRO-1)
    assert (
        lab_page.input_value("[data-control=tp]") == "2" and lab_page.input_value("[data-control=pp]") == "2"
    )
    first = assert_result_matches_plan(lab_page, "#labResult")
    grid, timeline = canvas(lab_page, "#labResult"), canvas(lab_page, "#labResult", "timeline")
    # change a factor: a new mesh, a new plan, still the planner's
    lab_page.select_option("[data-control=tp]", "4")
    assert lab_page.inner_text("[data-control=dp]") == "2"
    message = lab_page.inner_text("#labMessage")
    if lab_page.query_selector("[data-role=nearest]"):
        lab_page.click("[data-role=nearest]")
    second = assert_result_matches_plan(lab_page, "#labResult")
    assert second["layout"] != first["layout"] and canvas(lab_page, "#labResult") != grid, message
    # micro-batch and schedule: the timeline is redrawn from another replay
    lab_page.select_option("[data-control=tp]", "2")
    lab_page.select_option("[data-control=schedule]", "interleaved-1f1b")
    lab_page.select_option("[data-control=v]", "2")
    assert_result_matches_plan(lab_page, "#labResult")
    assert canvas(lab_page, "#labResult", "timeline") != timeline
    # an impossible combination: said plainly, with the reason, and nothing drawn
    lab_page.select_option("[data-control=pp]", "4")
    lab_page.select_option("[data-control=tp]", "8")
    text = lab_page.inner_text("#labMessage")
    assert "invalid" in text and "does not divide 16 GPUs" in text, text
    assert lab_page.query_selector("#labResult canvas") is None


def test_lab_offers_full_recompute_of_some_blocks(lab_page) -> None:
    lab_page.click('#tabs button[data-view="lab"]')
    for control, value in (("tp", "1"), ("pp", "1"), ("cp", "1"), ("fsdp", "1"), ("zero", "1"), ("mb", "2")):
        lab_page.select_option(f"[data-control={control}]", value)
    # at pp 1 the schedule and its chunks mean nothing: their controls are off
    assert lab_page.is_disabled("[data-control=schedule]") and lab_page.is_disabled("[data-control=v]")
    labels = lab_page.eval_on_selector_all(
        "[data-control=recompute] option", "os => os.map(o => o.textContent)"
    )
    assert labels == ["none", "selective", "full, on some blocks", "full"]
    lab_page.select_option("[data-control=recompute]", "full-fewest")
    command = lab_page.inner_text("#labResult [data-role=command]")
    assert "--recompute full --recompute-layers " in command, command
    want = assert_result_matches_plan(lab_page, "#labResult")
    assert want["fits"] and 0 < want["layout"]["recompute_layers"] < 32
    assert f"first {want['layout']['recompute_layers']} blocks" in lab_page.inner_text("#labMessage")
    # selective, one choice lighter, does not fit on the same layout
    lab_page.select_option("[data-control=recompute]", "selective")
    assert not assert_result_matches_plan(lab_page, "#labResult")["fits"]


def test_lab_switches_cluster(lab_page) -> None:
    lab_page.click('#tabs button[data-view="lab"]')
    lab_page.select_option("[data-control=hardware]", "a100-80gb")
    assert lab_page.input_value("[data-control=gpus]") == "8"
    if lab_page.query_selector("[data-role=nearest]"):
        lab_page.click("[data-role=nearest]")
    want = assert_result_matches_plan(lab_page, "#labResult")
    assert (want["hardware"], want["gpus"]) == ("a100-80gb", 8)
    assert lab_page.get_attribute("#labResult canvas[data-role=grid]", "data-ranks") == "8"
    lab_page.select_option("[data-control=hardware]", "h100-80gb")
    assert lab_page.input_value("[data-control=gpus]") == "16"
    if lab_page.query_selector("[data-role=nearest]"):
        lab_page.click("[data-role=nearest]")
    assert assert_result_matches_plan(lab_page, "#labResult")["gpus"] == 16


def test_pipeline_figure_is_the_drawings(lab_page) -> None:
    lab_page.click('#tabs button[data-view="search"]')
    lab_page.select_option("#layoutSelect", "0")
    caption = lab_page.inner_text("#searchResult [data-role=pipeline-caption]")
    idle_text = lab_page.inner_text("#searchResult [data-role=pipeline-idle]")
    assert f"Drawn idle share: {idle_text}" in caption and "zero-bubble" in caption
    drawn = float(lab_page.get_attribute("#searchResult canvas[data-role=timeline]", "data-idle"))
    assert abs(drawn - float(idle_text.split()[0]) / 100) < 0.02  # the raster's idle cells agree
    # F, B/I and W are drawn in different colours
    colours = lab_page.evaluate(
        """() => { const c = document.querySelector('#searchResult canvas[data-role=timeline]');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, seen = new Set();
        for (let i = 0; i < d.length; i += 4)
          if (d[i + 3] === 255) seen.add(d[i] + ',' + d[i + 1] + ',' + d[i + 2]);
        return [...seen]; }"""
    )
    assert {"78,121,167", "89,161,79", "227,182,43"} <= set(colours)  # F, I, W


def test_search_layouts_switch_and_match_the_planner(lab_page) -> None:
    lab_page.click('#tabs button[data-view="search"]')
    seen = []
    for i in range(3):
        lab_page.select_option("#layoutSelect", str(i))
        want = assert_result_matches_plan(lab_page, "#searchResult")
        seen.append((want["layout"], want["micro_batch"]))
        grid = canvas(lab_page, "#searchResult")
        pills = lab_page.query_selector_all("#searchResult [data-role=mesh] .pills button:not(.on)")
        if pills:  # switching the axis redraws the groups
            pills[0].click()
            assert canvas(lab_page, "#searchResult") != grid
    assert len({json.dumps(s, sort_keys=True) for s in seen}) == 3
    assert lab_page.inner_text("#explanation").startswith("Best:")


def test_run_view_draws_both_losses_with_axes_and_escapes_strings(lab_page) -> None:
    lab_page.click('#tabs button[data-view="run"]')
    held = lab_page.get_attribute("#loss polyline[data-series=held_out_loss]", "points")
    assert held and len(held.split()) == 4  # steps 5, 10, 15, 20
    assert lab_page.get_attribute("#loss polyline[data-series=loss]", "points").count(",") == 20
    assert len(lab_page.query_selector_all("#loss [data-tick=x]")) >= 3
    assert len(lab_page.query_selector_all("#loss [data-tick=y]")) >= 3
    # the ledger's hostile axis name is text, not markup
    assert HOSTILE in lab_page.inner_text("#ledger")
    assert lab_page.query_selector_all("img") == [] and lab_page.evaluate("window.__owned") is None
    assert len(lab_page.query_selector_all("#runTimeline rect")) == 2 + 4  # 2 rank lanes, 4 measured ops
    legend = lab_page.inner_text("[data-role=run-timeline-legend]")  # the colours say which op is which
    assert "F forward" in legend and "B backward" in legend


def test_inference_view_is_the_planners(lab_page) -> None:
    lab_page.click('#tabs button[data-view="inference"]')
    rows = lab_page.eval_on_selector_all(
        "#inferenceTable tr", "rs => rs.slice(1).map(r => [...r.cells].map(c => c.textContent))"
    )
    assert rows
    lab_page.click("#inferenceTable tr[data-row='0']")
    want = plan_json(lab_page.inner_text("#inferenceMemory code"))
    assert rows[0][2:5] == [fbytes(want["memory"][k]) for k in ("params", "kv_cache", "total")]
    assert rows[0][6:8] == [fsecs(want["prefill_time_s"]), fsecs(want["decode_time_per_token_s"])]
    # the row shown first, in bold, is the one the serving search ranks first for latency
    best = plan_json(
        "fivefold plan --model llama3-8b --hardware h100-80gb --gpus 16 --mode inference --search "
        "--batch 8 --context 2048 --json"
    )["plans"][0]["layout"]
    lab_page.evaluate("renderInference()")  # drawn afresh: the row it shows first
    assert lab_page.inner_text("#inferenceTable tr[data-best] td") == f"tp {best['tp']} · pp {best['pp']}"
    assert lab_page.inner_text("#inferenceMemory div").startswith(f"tp {best['tp']} · pp {best['pp']},")
    # the collectives one rank of each stage issues per decoded token: the plan's decode_traffic
    shown = plan_json(lab_page.inner_text("#inferenceMemory code"))["decode_traffic"]
    assert shown, "the best serving layout splits the model, so its ranks talk"
    cells = lab_page.eval_on_selector_all(
        "[data-role=decode-traffic] tr", "rs => rs.slice(1).map(r => [...r.cells].map(c => c.textContent))"
    )
    assert cells == [
        [str(r["stage"]), r["axis"], r["op"], str(r["count"]), fbytes(r["bytes"])] for r in shown
    ]
    # each row's notes are its serving plan's (a pipeline's one batch in flight, KV heads held whole)
    noted = 0
    for i in range(len(rows)):
        lab_page.click(f"#inferenceTable tr[data-row='{i}']")
        said = plan_json(lab_page.inner_text("#inferenceMemory code"))["notes"]
        shown_notes = lab_page.eval_on_selector_all(
            "#inferenceMemory [data-role=notes] li", "ls => ls.map(l => l.textContent)"
        )
        assert shown_notes == [f"note: {n}" for n in said]
        noted += bool(said)
    assert noted, "some serving layout of 16 GPUs has a caveat to show"
    lab_page.click("#inferenceTable tr[data-row='0']")  # the page is shared: leave the first row picked


@pytest.fixture(scope="module")
def pp_page(browser, tmp_path_factory):
    """64 GPUs as pp 2 × dp 32: 32 pp groups, e.g. {0, 32} and {16, 48}."""
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(pp=2, dp=-1, zero=1), 64)
    html = build_page(model, hw, 64, TrainShape(2048, 128), layout, top=0, lab=False)
    page = _open(browser, html, tmp_path_factory.mktemp("pp") / "page.html", "search")
    yield page
    assert page.errors == []
    page.close()


def _rank_colours(page, world: int, gpn: int) -> list[str]:
    return page.evaluate(
        """([world, gpn]) => { const c = document.querySelector('#searchResult canvas[data-role=grid]');
        const geo = meshGeometry(world, gpn), ctx = c.getContext('2d'), out = [];
        for (let r = 0; r < world; r++) { const [x, y] = cellXY(geo, gpn, r);
          const d = ctx.getImageData(x + 1, y + 1, 1, 1).data;
          out.push(d[0] + ',' + d[1] + ',' + d[2] + ',' + d[3]); }
        return out; }""",
        [world, gpn],
    )


def test_group_colours_stay_distinct_beyond_16_groups(pp_page) -> None:
    pp_page.click('#searchResult [data-axis="pp"]')
    colours = _rank_colours(pp_page, 64, 8)
    groups = [[g, g + 32] for g in range(32)]
    for a, b in groups:
        assert colours[a] == colours[b]
    assert len({colours[a] for a, _ in groups}) == 32  # {0,32} and {16,48} no longer look alike


def test_all_16384_ranks_are_drawn(browser, tmp_path_factory, artifacts: Path) -> None:
    model, hw = load_model("llama3-405b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(tp=8, pp=16, dp=-1, sp=True, zero=1), 16384)
    html = build_page(model, hw, 16384, TrainShape(8192, 2048), layout, top=0, lab=False)
    start = time.perf_counter()
    page = _open(browser, html, tmp_path_factory.mktemp("16k") / "page.html", "search")
    first_render = time.perf_counter() - start
    assert page.get_attribute("#searchResult canvas[data-role=grid]", "data-ranks") == "16384"
    for axis, groups in (("tp", 2048), ("dp", 128), ("pp", 1024)):
        page.click(f'#searchResult [data-axis="{axis}"]')
        assert page.get_attribute("#searchResult canvas[data-role=grid]", "data-groups") == str(groups)
    colours = _rank_colours(page, 16384, 8)
    assert all(c.endswith(",255") and not c.startswith("255,255,255") for c in colours)  # every rank painted
    page.screenshot(path=str(artifacts / "explore-16384.png"), full_page=True)
    assert page.errors == [] and first_render < 30


def test_run_view_sets_the_ledger_beside_the_runs_own_planned_step(browser, tmp_path) -> None:
    """A run directory with its config: the plan column is the step `fivefold verify` plans for that
    config on rank 0 (tied embeddings across pp 2: the shared weight's gradient sum included), and a
    collective planned but not measured still gets its row."""
    from fivefold.config import RunConfig, TrainSpec
    from fivefold.explore.run import planned_step

    run = write_run(tmp_path / "run", axis="pp")
    layout = resolve_layout(Layout(pp=2, tp=2, sp=True, microbatches=2), 4)
    cfg = RunConfig(
        model=load_model("small"), train=TrainSpec(seq_len=64, micro_batch=2, global_batch=4), layout=layout
    )
    (run / "config.toml").write_text(cfg.to_toml())
    planned = planned_step(run / "config.toml")
    measured = [dict(r, wire_bytes=r["bytes"]) for r in planned if r["op"] != "broadcast"]
    (run / "ledger.json").write_text(json.dumps({"summary": measured}))
    shape = TrainShape(seq_len=64, global_batch=4, micro_batch=2)
    html = build_page(cfg.model, load_hardware("cpu"), 4, shape, layout, run_dir=run, top=0, lab=False)
    page = _open(browser, html, tmp_path / "page.html", "run")
    rows = page.eval_on_selector_all(
        "#ledger tr", "rs => rs.slice(1).map(r => [...r.children].map(c => c.textContent))"
    )
    assert "step planned for the run's config" in page.inner_text("#ledgerNote")
    by_key = {(r[0], r[1]): r for r in rows}
    assert set(by_key) == {(r["axis"], r["op"]) for r in planned}
    for r in planned:
        row = by_key[r["axis"], r["op"]]
        assert row[5] == str(r["count"]) and row[6] == fbytes(r["bytes"])
        assert row[2] == ("—" if r["op"] == "broadcast" else str(r["count"]))
    assert by_key["pp", "all_reduce"][5] == "2"  # the tied weight's gradient sum and the norm's
    assert page.errors == [], page.errors
    page.close()


def test_the_mesh_note_counts_one_group_and_one_node_in_the_singular(browser, tmp_path_factory) -> None:
    """Two ranks in one node: "1 group of 2", "on 1 node of 8" (it read "1 groups", "1 nodes")."""
    layout = resolve_layout(Layout(fsdp=2, ep=2, zero=3), 2)
    html = build_page(
        load_model("tiny-moe"), load_hardware("cpu"), 2, TrainShape(64, 4), layout, top=1, lab=False
    )
    page = _open(browser, html, tmp_path_factory.mktemp("one") / "page.html", "search")
    notes = []
    for axis in ("ep", "fsdp"):
        page.click(f'#searchResult [data-axis="{axis}"]')
        notes.append(page.inner_text("#searchResult [data-role=axis-note]"))
    assert all("1 group of 2" in n and "2 GPUs on 1 node of 8" in n for n in notes), notes
    assert page.errors == []
    page.close()


def test_a_layout_given_without_sp_opens_in_the_lab_as_given(browser, tmp_path_factory) -> None:
    """tp 2 without --sp: the lab shows that plan (not the search's, which turns sp on), prints the
    command without --sp, offers sp as a control, and says which choice a missing combination lacks."""
    tmp = tmp_path_factory.mktemp("nosp")
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(tp=2, dp=-1, zero=1), 8)
    html = build_page(model, hw, 8, TrainShape(seq_len=2048, global_batch=32), layout, top=1)
    page = _open(browser, html, tmp / "page.html", "search")
    page.select_option("#layoutSelect", "0")
    given = assert_result_matches_plan(page, "#searchResult")
    assert given["layout"]["sp"] is False
    page.click("#toLab")
    assert page.input_value("[data-control=sp]") == "0"
    assert "--sp" not in page.inner_text("#labResult [data-role=command]")
    assert assert_result_matches_plan(page, "#labResult")["step_time_s"] == given["step_time_s"]
    # with sp the search dropped ZeRO-1 here (ZeRO-0 dominates it): the message names that choice
    page.select_option("[data-control=sp]", "1")
    text = page.inner_text("#labMessage")
    assert "not considered with these factors: zero 1 is not; zero ∈ {0} is" in text, text
    page.select_option("[data-control=zero]", "0")
    assert "--sp" in page.inner_text("#labResult [data-role=command]")
    with_sp = assert_result_matches_plan(page, "#labResult")
    assert with_sp["layout"]["sp"] is True
    assert with_sp["memory"]["activations"] < given["memory"]["activations"]
    page.select_option("[data-control=tp]", "1")  # sp means nothing at tp 1: its control is off
    assert page.is_disabled("[data-control=sp]")
    assert page.errors == [], page.errors
    page.close()


def test_mesh_groups_and_inference_rows_are_reachable_by_keyboard(lab_page) -> None:
    """The mesh grid takes focus and steps through its groups with the arrow keys; an inference row
    takes focus and Enter picks it; the tabs say which one is selected."""
    lab_page.click('#tabs button[data-view="search"]')
    assert lab_page.get_attribute('#tabs button[data-view="search"]', "aria-selected") == "true"
    assert lab_page.evaluate("location.hash") == "#search"
    lab_page.select_option("#layoutSelect", "0")  # the given layout: tp 2, pp 2 and the rest dp
    grid = "#searchResult canvas[data-role=grid]"
    pills = "#searchResult [data-role=mesh] .pills button"
    for i in range(len(lab_page.query_selector_all(pills))):
        if int(lab_page.get_attribute(grid, "data-groups")) > 1:
            break
        lab_page.query_selector_all(pills)[i].click()  # until an axis with more than one group
    assert int(lab_page.get_attribute(grid, "data-groups")) > 1
    lab_page.focus(grid)
    before = lab_page.inner_text("#searchResult [data-role=group-note]")
    lab_page.keyboard.press("ArrowRight")
    after = lab_page.inner_text("#searchResult [data-role=group-note]")
    assert before.startswith("group 0 ") and after.startswith("group 1 "), (before, after)
    lab_page.keyboard.press("ArrowLeft")
    assert lab_page.inner_text("#searchResult [data-role=group-note]") == before
    # the pictures say in words what they draw
    memory = lab_page.get_attribute("#searchResult [data-role=memory] svg", "aria-label")
    assert memory.startswith("memory per GPU: params ") and " usable" in memory, memory
    timeline = lab_page.get_attribute("#searchResult canvas[data-role=timeline]", "aria-label")
    assert "Drawn idle share" in timeline, timeline
    lab_page.click('#tabs button[data-view="inference"]')
    rows = lab_page.query_selector_all("#view-inference tr[data-row]")
    assert len(rows) > 1
    shown = lab_page.inner_text("#inferenceMemory code")
    rows[-1].focus()
    lab_page.keyboard.press("Enter")
    assert lab_page.inner_text("#inferenceMemory code") != shown


def test_a_step_of_one_micro_batch_leaves_its_gradients_out_of_the_bar(browser, tmp_path_factory) -> None:
    """One micro-batch a step on FSDP: the plan's peak holds the larger of grads and activations
    (`memory.grads_apart`); the page draws the parts the peak holds, names the other, and its total
    is the plan's. The plan's notes are shown beside it."""
    tmp = tmp_path_factory.mktemp("apart")
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(fsdp=8, zero=3, recompute="selective"), 8)
    html = build_page(model, hw, 8, TrainShape(seq_len=4096, global_batch=8), layout, top=1)
    page = _open(browser, html, tmp / "page.html", "search")
    page.select_option("#layoutSelect", "0")
    want = assert_result_matches_plan(page, "#searchResult")
    memory = want["memory"]
    assert memory["grads_apart"] and memory["activations"] > memory["grads"]
    drawn = page.eval_on_selector_all(
        "#searchResult [data-role=memory] rect[data-part]", "rs => rs.map(r => r.dataset.part)"
    )
    assert "grads" not in drawn and "activations" in drawn, drawn
    assert "grads (not at the peak)" in page.inner_text("#searchResult [data-role=memory] .legend")
    # and the plan's caveats are on the page: here, what selective recompute frees of eager blocks
    notes = page.inner_text("#searchResult [data-role=notes]")
    assert "note: " in notes and "--recompute full" in notes, notes
    # the lab's compact entry of the same layout draws the same bar
    page.click("#toLab")
    assert assert_result_matches_plan(page, "#labResult")["memory"]["grads_apart"]
    drawn = page.eval_on_selector_all(
        "#labResult [data-role=memory] rect[data-part]", "rs => rs.map(r => r.dataset.part)"
    )
    assert "grads" not in drawn and "activations" in drawn, drawn
    assert page.errors == [], page.errors
    page.close()
