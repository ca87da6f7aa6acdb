"""Parallelism applied from outside the model: one module per axis, composed by `apply`."""
