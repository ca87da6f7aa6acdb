"""One module per `fivefold` sub-command: `HELP`, `add_arguments(parser)`, `run(args) -> int`.

Command modules import torch lazily (inside `run`) so `fivefold plan` and `fivefold mesh` stay fast.
"""
