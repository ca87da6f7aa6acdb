"""The `fivefold` command: dispatches to one module per sub-command.

Only the chosen sub-command's module is imported, so `plan` and `mesh` never pay for torch.
Bad input surfaces as `FivefoldError`: one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fivefold import __version__
from fivefold.errors import FivefoldError

COMMANDS: dict[str, str] = {
    "plan": "predict memory, communication, bubble, step time and MFU; search layouts",
    "mesh": "show which ranks talk to which for a layout, inside or across nodes",
    "train": "train a transformer on a layout (CPU/gloo or GPU/NCCL)",
    "verify": "run a layout and the single-process reference; compare them and the plan",
    "generate": "sample text from a run directory or an HF checkpoint",
    "report": "draw a run's loss curve, ledger and pipeline timeline",
    "explore": "write an interactive HTML page of mesh, plan and run",
    "demo": "set-up check: train the default model on the embedded corpus",
    "presets": "list model and hardware presets",
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fivefold",
        description="What do you split, and what does it cost to stitch back together?",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<10} {v}" for k, v in COMMANDS.items()),
    )
    parser.add_argument("--version", action="version", version=f"fivefold {__version__}")
    parser.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        top = _top_parser()
        if not argv:
            top.print_help()
            return 0
        top.parse_args(argv[:1])  # prints usage / --help / --version, or exits 2 on an unknown command
        return 0
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(f"fivefold.commands.{name}")
    parser = argparse.ArgumentParser(prog=f"fivefold {name}", description=COMMANDS[name])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except FivefoldError as exc:
        print(f"fivefold {name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
