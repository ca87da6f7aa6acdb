"""Single-process and launched training: data, loop, checkpoints, metrics, launcher."""

from fivefold.train.loop import TrainResult, lr_at, train

__all__ = ["TrainResult", "lr_at", "train"]
