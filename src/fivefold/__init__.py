"""fivefold: plan, run and verify 5D-parallel transformer training.

What do you split, and what does it cost to stitch back together?
"""

__version__ = "0.1.0"
