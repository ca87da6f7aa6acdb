"""The README's commands that do not train (plan, mesh, explore, presets) run as written and succeed,
and every single-layout plan it shows fits its GPUs: the quick start cannot rot unnoticed."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from fivefold.cli import FIRST_STEPS, main

README = Path(__file__).resolve().parents[1] / "README.md"
CHEAP = {"plan", "mesh", "explore", "presets"}


def readme_commands() -> list[list[str]]:
    """Every `fivefold ...` line of the README's bash blocks, continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if len(words) >= 2 and words[0] == "fivefold" and words[1] in CHEAP:
                commands.append(words[1:])
    return commands


def _needs_a_run(argv: list[str]) -> bool:
    # `explore --run DIR` and `plan --validate my_runs.toml runs/pp` read a run the README trained first
    # and the reader's own runs file
    return "--run" in argv or any(a.startswith("runs/") or a == "my_runs.toml" for a in argv)


COMMANDS = [argv for argv in readme_commands() if not _needs_a_run(argv)]


def test_the_readme_shows_each_cheap_command():
    assert {argv[0] for argv in COMMANDS} == CHEAP


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a[:4]) for a in COMMANDS])
def test_readme_command_succeeds(argv, tmp_path, capsys):
    argv = list(argv)
    for flag in ("--out", "--plot"):  # write pages and pictures into the test's folder, not the checkout
        if flag in argv:
            i = argv.index(flag)
            argv[i + 1] = str(tmp_path / Path(argv[i + 1]).name)
    assert main(argv) == 0, capsys.readouterr().err
    single = not {"--search", "--mode", "--validate", "--cross-validate"} & set(argv)
    if argv[0] == "plan" and single:
        capsys.readouterr()
        assert main([*argv, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["fits"], f"the README's example does not fit: {' '.join(argv)}"


@pytest.mark.parametrize("example", [e for _, e in FIRST_STEPS if e.split()[1] in CHEAP])
def test_first_steps_printed_by_bare_fivefold_succeed(example, tmp_path, capsys):
    argv = shlex.split(example.split("(")[0])[1:]
    if "--out" in argv:
        argv[argv.index("--out") + 1] = str(tmp_path / "page.html")
    assert main(argv) == 0, capsys.readouterr().err
    if argv[0] == "plan":
        capsys.readouterr()
        assert main([*argv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["fits"], example
