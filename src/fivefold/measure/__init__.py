"""What a run measures about itself: the communication ledger and its collective hooks, the
per-rank timeline and pipeline bubble replay, and the memory meter. The runtime works without it."""
