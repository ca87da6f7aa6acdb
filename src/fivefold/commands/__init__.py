"""One module per `fivefold` sub-command: `add_arguments(parser)` and `run(args) -> int`;
the one-line help of each lives in `fivefold.cli.COMMANDS`.

Command modules import torch lazily (inside `run`) so `fivefold plan` and `fivefold mesh` stay fast.
"""
