"""Every command's flags have help text that shows the default, and the flags commands share mean the
same thing everywhere: one definition, one default, one help text."""

from __future__ import annotations

import argparse
import importlib

import pytest

from fivefold.cli import COMMANDS, DefaultsShown

LAYOUT_FLAGS = ("--dp", "--fsdp", "--tp", "--pp", "--cp", "--ep", "--order", "--zero", "--sp")
LAYOUT_FLAGS += ("--pp-schedule", "--microbatches", "--virtual-stages", "--pp-split", "--cp-impl")
LAYOUT_FLAGS += ("--recompute",)


def _parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"fivefold {name}", formatter_class=DefaultsShown)
    importlib.import_module(f"fivefold.commands.{name}").add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        a.option_strings[0]: a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    }


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_has_help(name):
    missing = [flag for flag, action in _options(_parser(name)).items() if not (action.help or "").strip()]
    assert not missing, f"fivefold {name}: flags without help: {missing}"


def test_help_shows_defaults():
    text = _parser("verify").format_help()
    assert "(default 16)" in text.replace("\n", " ").replace("  ", " ")  # --seq-len


def test_shared_layout_flags_are_one_definition():
    table: dict[str, dict[str, tuple]] = {}
    for name in COMMANDS:
        for flag, action in _options(_parser(name)).items():
            if flag in LAYOUT_FLAGS:
                table.setdefault(flag, {})[name] = (action.default, action.help, action.choices)
    assert set(table) == set(LAYOUT_FLAGS)
    placement = {"--dp", "--fsdp", "--tp", "--pp", "--cp", "--ep", "--order"}
    for flag, per_command in table.items():
        users = {"plan", "train", "verify", "explore"} | ({"mesh"} if flag in placement else set())
        assert users <= set(per_command), flag
        # mesh only places ranks: flags that would change nothing there are not offered
        assert ("mesh" in per_command) == (flag in placement), flag
        assert len(set(per_command.values())) == 1, f"{flag} differs between commands: {per_command}"
