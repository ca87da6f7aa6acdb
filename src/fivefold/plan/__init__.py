"""The planner: memory, communication, bubble, step time and MFU of a layout, and the layout search.

Pure Python (no torch import), fast enough to score thousands of layouts a second.
"""

from fivefold.plan.report import plan
from fivefold.plan.result import Plan
from fivefold.plan.spec import Arch, TrainShape, resolve_arch

__all__ = ["Arch", "Plan", "TrainShape", "plan", "resolve_arch"]
