"""The `fivefold` command: dispatches to one module per sub-command.

Only the chosen sub-command's module is imported, so `plan` and `mesh` never pay for torch.
Bad input surfaces as `FivefoldError`: one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
from typing import Any, NoReturn

from fivefold import __version__
from fivefold.errors import FivefoldError, storage_fault
from fivefold.outputs import outlive_the_reader, tolerate_any_encoding

COMMANDS: dict[str, str] = {
    "plan": "predict memory, communication, bubble, step time and MFU; search layouts",
    "mesh": "show which ranks talk to which for a layout, inside or across nodes",
    "train": "train a transformer on a layout (CPU/gloo or GPU/NCCL)",
    "verify": "run a layout; judge numerics, traffic and memory against the single process and the plan",
    "generate": "sample text from a run directory or an HF checkpoint",
    "report": "draw a run's loss curve, ledger and pipeline timeline",
    "explore": "write an interactive HTML page of mesh, plan and run",
    "demo": "set-up check: train the default model on the embedded corpus",
    "presets": "list model and hardware presets",
}
# flags whose empty value means something: an empty prompt (generation from the start token)
MAY_BE_EMPTY = ("prompt",)
# commands that run a job: their output is progress, and a closed pipe must not end the job early
JOBS = ("train", "verify", "demo")


# what a newcomer does first, in order, with one example each
FIRST_STEPS = (
    (
        "plan a layout",
        "fivefold plan --model llama3-8b --hardware h100-80gb --gpus 8 --fsdp 8 --seq-len 8192 "
        "--global-batch 32",
    ),
    ("see who talks to whom", "fivefold mesh --gpus 16 --gpus-per-node 8 --tp 4 --fsdp 2 --pp 2"),
    ("train on this machine", "fivefold demo   (or: fivefold train --nproc 4 --fsdp 2 --tp 2 --model tiny)"),
    ("check it is right", "fivefold verify --model tiny --nproc 4 --fsdp 2 --tp 2 --steps 3"),
    ("look at it", "fivefold explore --model llama3-8b --gpus 8 --tp 2 --out explore.html"),
)


class DefaultsShown(argparse.HelpFormatter):
    """Help that shows each flag's default, unless the text already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or not action.option_strings
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            return text
        return f"{text} (default {default})" if text else f"(default {default})"


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line and a pointer to --help, not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """An empty value (`--model ''`, an unset shell variable) is refused, not read as the default:
        a command would otherwise run something the user did not name."""
        parsed = super().parse_args(args, namespace)
        for action in self._actions:
            named = action.option_strings and action.dest not in MAY_BE_EMPTY
            if named and getattr(parsed, action.dest, None) == "" and action.default != "":
                self.error(f"{action.option_strings[-1]} is empty; give it a value or leave the flag out")
        return parsed


def _top_parser() -> argparse.ArgumentParser:
    steps = "\n".join(f"  {what:<24} {example}" for what, example in FIRST_STEPS)
    commands = "\n".join(f"  {k:<10} {v}" for k, v in COMMANDS.items())
    parser = OneLineParser(
        prog="fivefold",
        description="What do you split, and what does it cost to stitch back together?",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"first steps:\n{steps}\n\ncommands:\n{commands}\n\n"
        "`fivefold COMMAND --help` lists a command's flags and their defaults.",
    )
    parser.add_argument("--version", action="version", version=f"fivefold {__version__}")
    parser.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tolerate_any_encoding()
    if not argv or argv[0] not in COMMANDS:
        top = _top_parser()
        if not argv:
            top.print_help()
            return 0
        top.parse_args(argv[:1])  # prints usage / --help / --version, or exits 2 on an unknown command
        return 0
    name, rest = argv[0], argv[1:]
    try:
        module = importlib.import_module(f"fivefold.commands.{name}")  # torch's import takes a while
    except KeyboardInterrupt:
        print(f"fivefold {name}: interrupted", file=sys.stderr)
        return 130
    parser = OneLineParser(prog=f"fivefold {name}", description=COMMANDS[name], formatter_class=DefaultsShown)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    # a job's exit code says how the job ended, also when its output's reader has gone away
    reader = outlive_the_reader() if name in JOBS else contextlib.nullcontext()
    try:
        with reader:
            return int(module.run(args) or 0)
    except FivefoldError as exc:
        print(f"fivefold {name}: {exc.label}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"fivefold {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as other tools do
        _silence_stdout()
        return 0
    except OSError as exc:
        if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP):  # a path given on the command line
            name_ = str(exc.filename or "")
            shown = name_ if len(name_) <= 80 else name_[:60] + f"... ({len(name_)} characters)"
            loop = "its links lead back to themselves"
            hint = "give a shorter path" if exc.errno == errno.ENAMETOOLONG else loop
            print(f"fivefold {name}: error: {exc.strerror}: {shown}; {hint}", file=sys.stderr)
            return 2
        full = storage_fault(exc)
        if full is None:
            raise
        # a fault of the machine, not of the input: one line naming the file, exit code 1
        print(f"fivefold {name}: error: {full}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
