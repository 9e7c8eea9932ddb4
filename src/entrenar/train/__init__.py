"""Training: the one loop (loop.py), AdamW + schedule (optim.py), guards, checkpoints, metrics."""

from .loop import TrainConfig, evaluate, train

__all__ = ["TrainConfig", "evaluate", "train"]
