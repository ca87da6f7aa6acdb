"""The pure-Python mesh against hand-worked layouts and an independent brute-force reference."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest

from fivefold.config import AXES, Layout
from fivefold.errors import FivefoldError
from fivefold.mesh import axis_link_kinds, build_mesh, link_kind


def _reference_groups(sizes: dict[str, int], order: list[str], varying: tuple[str, ...]) -> set[frozenset]:
    """Brute force: enumerate coordinates with itertools, rank = mixed radix innermost first."""

    def rank_of(coord: dict[str, int]) -> int:
        rank, scale = 0, 1
        for a in order:
            rank += coord[a] * scale
            scale *= sizes[a]
        return rank

    groups: dict[tuple, set[int]] = {}
    for values in itertools.product(*(range(sizes[a]) for a in AXES)):
        coord = dict(zip(AXES, values))
        key = tuple(coord[a] for a in AXES if a not in varying)
        groups.setdefault(key, set()).add(rank_of(coord))
    return {frozenset(g) for g in groups.values()}


def test_seed_example_hsdp_with_tp():
    # 8 GPUs, 2 nodes of 4, TP 2, FSDP 2, DP 2 (the mesh table of docs/mesh.md)
    m = build_mesh(Layout(tp=2, fsdp=2, dp=2), 8, 4)
    assert m.dims["tp"].groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.dims["fsdp"].groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.dims["dp"].groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (m.dims["tp"].link, m.dims["fsdp"].link, m.dims["dp"].link) == ("intra", "intra", "inter")
    assert m.dims["cp"].size == 1 and m.dims["cp"].link == "none"
    assert "HSDP" in __import__("fivefold.mesh").mesh.describe(m)
    r5 = m.ranks[5]
    assert (r5.node, r5.local_rank) == (1, 1)
    assert {a: r5.coords[a] for a in AXES} == {"dp": 1, "fsdp": 0, "cp": 0, "tp": 1, "pp": 0}
    assert m.group_of(5, "fsdp") == [5, 7]


@pytest.mark.parametrize("world", [8, 16, 24])
def test_groups_match_brute_force_for_every_order(world):
    rng = random.Random(world)
    factors = {8: [2, 2, 2, 1, 1], 16: [2, 2, 2, 2, 1], 24: [3, 2, 2, 2, 1]}[world]
    for perm in itertools.permutations(AXES):
        shuffled = factors[:]
        rng.shuffle(shuffled)
        sizes = dict(zip(AXES, shuffled))
        m = build_mesh(Layout(**sizes, order=",".join(perm)), world, 4)
        for axis in AXES:
            got = {frozenset(g) for g in m.dims[axis].groups}
            assert got == _reference_groups(sizes, list(perm), (axis,)), (perm, axis)
        assert {frozenset(g) for g in m.dims["fsdp_cp"].groups} == _reference_groups(
            sizes, list(perm), ("fsdp", "cp")
        )
        assert {frozenset(g) for g in m.dims["batch"].groups} == _reference_groups(
            sizes, list(perm), ("dp", "fsdp")
        )


def test_groups_partition_the_world_and_coords_agree():
    m = build_mesh(Layout(tp=2, cp=2, fsdp=2, dp=2, pp=2, ep=4), 32, 8)
    for dim in m.dims.values():
        flat = sorted(r for g in dim.groups for r in g)
        assert flat == list(range(32)), dim.name
        for g in dim.groups:  # a group lists its ranks by the dim's index
            assert [m.ranks[r].coords[dim.name] for r in g] == list(range(dim.size)), dim.name


def test_ep_folds_on_the_innermost_fsdp_cp_ranks():
    # tp 2, cp 2, fsdp 2 on one node of 8: fsdp×cp ranks of rank 0 are {0, 2, 4, 6} (cp inner)
    m = build_mesh(Layout(tp=2, cp=2, fsdp=2, ep=2), 8, 8)
    assert m.dims["fsdp_cp"].groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m.dims["ep"].groups == [[0, 2], [1, 3], [4, 6], [5, 7]]  # = the cp ranks
    assert m.dims["expert_fsdp"].groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    m4 = build_mesh(Layout(tp=2, cp=2, fsdp=2, ep=4), 8, 8)
    assert m4.dims["ep"].groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m4.dims["expert_fsdp"].size == 1


def test_link_kinds_by_hand():
    assert link_kind([0, 1, 2, 3], 4) == "intra"
    assert link_kind([0, 4], 4) == "inter"
    assert link_kind([2, 3, 4, 5], 4) == "mixed"
    # tp 4 on nodes of 2 spans two nodes with two ranks each
    assert axis_link_kinds(Layout(tp=4, dp=2).resolve(8), 2) == {"tp": "mixed", "dp": "inter"}


def test_fast_link_kinds_equal_the_enumerated_ones():
    rng = random.Random(0)
    for _ in range(400):
        sizes = {a: rng.choice([1, 1, 2, 3, 4]) for a in AXES}
        order = list(AXES)
        rng.shuffle(order)
        lay = Layout(**sizes, order=",".join(order)).resolve()
        if lay.world > 96:
            continue
        gpn = rng.choice([1, 2, 3, 4, 6, 8])
        m = build_mesh(lay, lay.world, gpn)
        assert axis_link_kinds(lay, gpn) == {a: m.dims[a].link for a in AXES if m.dims[a].size > 1}


def test_fill_and_impossible_layouts():
    m = build_mesh(Layout(tp=2, fsdp=-1), 16, 8)
    assert m.layout.fsdp == 8
    with pytest.raises(FivefoldError, match="nearest valid layouts: --fsdp 2 --tp 4"):
        build_mesh(Layout(tp=3, fsdp=2), 8, 4)
    with pytest.raises(FivefoldError, match="ep"):
        build_mesh(Layout(fsdp=4, ep=3), 4, 4)
    with pytest.raises(FivefoldError, match="gpus-per-node"):
        build_mesh(Layout(fsdp=4), 4, 0)


def test_json_contract():
    data = build_mesh(Layout(tp=2, fsdp=2, dp=2), 8, 4).to_json()
    assert data["world"] == 8 and data["gpus_per_node"] == 4
    assert data["order"] == ["tp", "cp", "fsdp", "dp", "pp"]
    names = [d["name"] for d in data["dims"]]
    assert set(AXES) <= set(names) and "ep" in names
    for d in data["dims"]:
        assert {"name", "size", "groups", "links", "comm"} <= set(d)
    assert data["ranks"][3] == {"rank": 3, "node": 0, "local_rank": 3, "coords": data["ranks"][3]["coords"]}
    assert data["ranks"][3]["coords"]["fsdp"] == 1
    json.dumps(data)
    # each dim's collectives also by the names the ledger, plan and verify give them
    ops = {d["name"]: d["ops"] for d in data["dims"]}
    assert ops["tp"] == ["all_reduce"] and ops["fsdp"] == ["all_gather", "reduce_scatter"]
    assert ops["dp"] == ["all_reduce"] and ops["pp"] == [] and ops["batch"] == []


def test_mesh_names_the_collectives_the_runtime_issues():
    """The words and op names of every dim are what fivefold's runtime issues over it, as its ledger
    records them: ZeRO-1 is torch's ZeroRedundancyOptimizer (gradients all-reduced, each updated shard
    broadcast by its owner), sp turns tp's all-reduce into a gather and a scatter, cp by its core."""
    from fivefold.measure.ledger import C10D_OPS, FUNCTIONAL_OPS
    from fivefold.mesh import comm_ops, comm_words

    ledger_ops = set(C10D_OPS.values()) | set(FUNCTIONAL_OPS.values())
    zero1 = Layout(dp=4, zero=1).resolve(4)
    assert comm_words("dp", zero1) == "all-reduce (grads) + broadcast (params)"
    assert comm_ops("dp", zero1) == ["all_reduce", "broadcast"]
    assert comm_ops("tp", Layout(tp=2, sp=True).resolve(2)) == ["all_gather", "reduce_scatter"]
    for impl, want in (
        ("ring", ["send", "recv"]),
        ("allgather", ["all_gather", "reduce_scatter"]),
        ("ulysses", ["all_to_all"]),
    ):
        assert comm_ops("cp", Layout(cp=2, cp_impl=impl).resolve(2)) == want
    for lay in (Layout(tp=2, fsdp=2, dp=2, pp=2, cp=2).resolve(32), zero1):
        for dim in build_mesh(lay, lay.world, 8).dims.values():
            assert set(dim.ops) <= ledger_ops, (dim.name, dim.ops)
            assert bool(dim.ops) == (dim.size > 1 and dim.name != "batch"), dim.name


def test_mesh_module_does_not_import_torch():
    code = "import sys, fivefold.mesh; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", "mesh", *argv], capture_output=True, text=True)


def test_cli_table_json_svg_and_errors(tmp_path):
    out = _cli("--gpus", "8", "--gpus-per-node", "4", "--tp", "2", "--fsdp", "2", "--dp", "2")
    assert out.returncode == 0, out.stderr
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.stdout.splitlines()
        if line.startswith("| ")
    }
    assert rows["TP"] == ["2", "4", "intra-node", "all-reduce (activations)"]
    assert rows["DP"][:3] == ["2", "4", "inter-node"]
    assert rows["CP"] == ["1", "—", "—", "—"]
    assert "This is HSDP" in out.stdout
    assert "node 1" in out.stdout and "\x1b[" not in out.stdout  # not a tty: no colour

    svg = tmp_path / "mesh.svg"
    out = _cli(
        "--gpus",
        "8",
        "--gpus-per-node",
        "4",
        "--tp",
        "2",
        "--fsdp",
        "-1",
        "--json",
        "--axis",
        "fsdp",
        "--svg",
        str(svg),
    )
    data = json.loads(out.stdout)  # nothing else on stdout
    assert next(d for d in data["dims"] if d["name"] == "fsdp")["size"] == 4
    assert svg.read_text().startswith("<svg") and svg.read_text().count("<rect") >= 8

    bad = _cli("--gpus", "8", "--gpus-per-node", "4", "--tp", "3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "nearest valid layouts" in bad.stderr


def test_mesh_text_scales_to_16384_gpus_with_aligned_columns(capsys):
    from fivefold.cli import main

    argv = ["mesh", "--gpus", "16384", "--tp", "8", "--pp", "16", "--cp", "2", "--fsdp", "-1", "--no-color"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) < 80  # the per-axis table and a bounded grid, not one line per node
    grid = [line for line in out if line.startswith("node ")]
    assert len(grid) == 256 // 8 and len({len(line) for line in grid}) == 1  # aligned
    assert main([*argv, "--ranks", "16376-16383"]) == 0
    tail = [line for line in capsys.readouterr().out.splitlines() if line.startswith("node ")]
    assert len(tail) == 1 and tail[0].split()[1] == "2047" and "16383:" in tail[0]
    assert main([*argv, "--ranks", "5-16384"]) == 2
    assert "--ranks must be A-B" in capsys.readouterr().err


def test_mesh_fills_the_world_with_dp_like_plan(capsys):
    from fivefold.cli import main

    assert main(["mesh", "--gpus", "16", "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["dp"] == 8 and data["layout"]["tp"] == 2


def test_a_node_larger_than_the_world_draws_only_the_world(capsys, tmp_path):
    """Columns for a million GPUs per node (the ceiling), 8 of them used, once took minutes and gigabytes."""
    from fivefold.cli import main

    svg = tmp_path / "m.svg"
    assert main(["mesh", "--gpus", "8", "--tp", "2", "--gpus-per-node", "1048576", "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "gpu0" in line)
    assert len(header) < 100 and "gpu7" in header and "gpu8" not in header
    assert svg.stat().st_size < 10_000


def test_describe_says_whether_experts_are_sharded_further_and_counts_nodes() -> None:
    """ep over every fsdp rank leaves each rank its experts whole (it had read "FSDP-sharded over the
    remaining 1"), and one node is one node (not "node(s)")."""
    from fivefold.mesh import describe

    whole = describe(build_mesh(Layout(tp=2, fsdp=4, ep=4), 8, 8))
    assert "each rank holds its experts whole" in whole and "8 GPUs on 1 node of 8;" in whole
    sharded = describe(build_mesh(Layout(fsdp=16, ep=4), 16, 8))
    assert (
        "each expert is FSDP-sharded over the remaining 4" in sharded
        and "16 GPUs on 2 nodes of 8;" in sharded
    )


def test_a_world_that_leaves_a_node_partly_used_is_noted(capsys) -> None:
    from fivefold.cli import main

    assert main(["mesh", "--gpus", "16", "--gpus-per-node", "3", "--json"]) == 0
    assert "note: 16 GPUs fill 5 nodes of 3 and 1 GPU(s) of one more;" in capsys.readouterr().err
    assert main(["mesh", "--gpus", "16", "--gpus-per-node", "8", "--json"]) == 0
    assert "note" not in capsys.readouterr().err


def test_the_svg_draws_the_grids_window_and_json_checks_the_ranks(tmp_path, capsys):
    """A million-GPU world is drawn as its grid is, in the window --ranks gives (the first 256 ranks by
    default), not as a 300 MB picture; --ranks is checked with --json too."""
    from fivefold.cli import main

    svg = tmp_path / "mesh.svg"
    assert main(["mesh", "--gpus", "65536", "--tp", "8", "--svg", str(svg)]) == 0
    assert svg.read_text().count("<title>rank") == 256 and "ranks 0-255 of 65536" in svg.read_text()
    assert main(["mesh", "--gpus", "64", "--tp", "8", "--ranks", "8-15", "--svg", str(svg)]) == 0
    drawn = svg.read_text()
    assert drawn.count("<title>rank") == 8 and "rank 8," in drawn and "rank 16," not in drawn
    capsys.readouterr()
    for ranks in ("abc", "0-99"):
        assert main(["mesh", "--gpus", "8", "--json", "--ranks", ranks]) == 2
        assert "--ranks must be A-B" in capsys.readouterr().err
