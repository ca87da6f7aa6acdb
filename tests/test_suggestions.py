"""A refused layout comes with suggestions, and every suggested layout is accepted by the same command."""

from __future__ import annotations

import random
import re

import pytest

from fivefold.cli import main

SUGGESTED = re.compile(r"nearest valid layouts: (.*)$")


def _draw(rng: random.Random) -> list[str]:
    gpus = rng.choice([6, 12, 16, 24, 32, 48, 63, 64, 96, 128])
    flags = ["--gpus", str(gpus)]
    for axis in ("tp", "pp", "cp", "fsdp"):
        if rng.random() < 0.5:
            flags += [f"--{axis}", str(rng.choice([2, 3, 4, 5, 8, 16, 64]))]
    return flags


@pytest.mark.parametrize("command", ["plan", "mesh"])
def test_every_suggested_layout_is_accepted(command, capsys):
    rng = random.Random(7)
    model = ["--model", "llama3-70b", "--hardware", "h100-80gb", "--seq-len", "4096", "--global-batch", "0"]
    refused = suggested = 0
    while refused < 100:
        flags = _draw(rng)
        gpus = int(flags[1])
        extra = model[:-1] + [str(gpus * 2)] if command == "plan" else []
        code = main([command, *flags, *extra, "--json"])
        err = capsys.readouterr().err
        if code == 0:
            continue
        assert code == 2, err
        assert "Traceback" not in err
        refused += 1
        match = SUGGESTED.search(err.strip())
        if not match:
            continue
        for option in match.group(1).split(" | "):
            words = [] if option == "(all 1)" else option.split()
            suggested += 1
            again = main([command, "--gpus", str(gpus), *words, *extra, "--json"])
            out = capsys.readouterr()
            assert again == 0, f"{command} {' '.join(flags)} suggested {option!r}, refused: {out.err}"
    assert suggested > 50  # the suggestions are not a rare event this test could miss


def test_a_plan_that_does_not_fit_says_so_first_and_its_suggestion_fits(capsys):
    """Defaults left out are named; the first line says by how much it does not fit; the suggested
    command, run as printed, plans a layout that fits and keeps the flags that were typed."""
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--tp", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("assuming --hardware h100-80gb, --seq-len 4096, --global-batch")
    assert "(give them to plan your own)" in captured.err
    first, second = captured.out.splitlines()[:2]
    assert re.match(r"this layout does not fit by \d+ GB per GPU", first)
    command = second.split(": fivefold ", 1)[1].split()
    assert command[0] == "plan" and "--tp" in command and command[command.index("--tp") + 1] == "8"
    assert main([*command, "--json"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["layout"]["tp"] == 8


def test_ep_on_plain_replicas_suggests_sharding_them():
    """ep re-uses sharded data ranks: on plain replicas the error names the layout that works."""
    from fivefold.config import Layout
    from fivefold.errors import FivefoldError

    with pytest.raises(FivefoldError, match=r"--fsdp 4 --dp 1") as refused:
        Layout(dp=4, ep=2).resolve(4)
    suggested = str(refused.value).rsplit(": ", 1)[1].split()
    assert Layout(fsdp=int(suggested[1]), dp=int(suggested[3]), ep=2).resolve(4).ep == 2
    # ZeRO-1 keeps the replicas whole: the sharded layout named takes ZeRO-2, which it then accepts
    with pytest.raises(FivefoldError, match=r"--fsdp 4 --dp 1 --zero 2"):
        Layout(dp=4, ep=2, zero=1).resolve(4)
    assert Layout(fsdp=4, dp=1, zero=2, ep=2).resolve(4).ep == 2


def test_zero1_on_sharded_ranks_is_answered_by_relabelling_them(capsys):
    """ZeRO-1 on fsdp ranks: the nearest layout moves the data ranks to dp, not into an unrelated axis
    such as cp (which a plain distance over the factors ranked equal)."""
    base = ["plan", "--model", "llama3-8b", "--gpus", "64", "--tp", "8", "--seq-len", "4096"]
    assert main([*base, "--fsdp", "8", "--zero", "1"]) == 2
    first = SUGGESTED.search(capsys.readouterr().err.strip()).group(1).split(" | ")[0]
    assert first == "--dp 8 --tp 8"


@pytest.mark.parametrize(
    ("flag", "typed", "meant"),
    [
        ("--model", "llama3-8B", ["llama3-8b"]),
        ("--model", "meta-llama/Llama-3-8B", ["llama3-8b"]),
        ("--model", "mixtral", ["mixtral-8x7b"]),
        ("--hardware", "H100", ["h100-80gb", "h100-nvl", "h100-pcie"]),
        ("--hardware", "A100-80GB", ["a100-80gb"]),
        ("--hardware", "tpuv4", ["tpu-v4"]),
        ("--hardware", "rtx4090", []),
    ],
)
def test_a_mistyped_preset_name_is_answered_with_the_ones_it_meant(flag, typed, meant, capsys):
    """A preset named as people write it (another case, separators, an owner prefix, a family) gets
    one line naming the presets it most likely meant, and a name like none of them gets none."""
    argv = ["plan", "--model", "tiny", "--hardware", "cpu", "--gpus", "1"]
    argv[argv.index(flag) + 1] = typed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    if meant:
        assert f"(did you mean {', '.join(meant)}?)" in err
        for name in meant:  # each suggestion is a name the same flag takes
            argv[argv.index(flag) + 1] = name
            assert main([*argv, "--json"]) == 0
            capsys.readouterr()
    else:
        assert "did you mean" not in err
    if "/" in typed:  # a hub id: nothing is fetched at run time
        assert "nothing is downloaded" in err
