"""What a training step minimises: the objective part of the Trainer (train/loop.py).

An objective turns one batch into (loss sum, loss-token count, metrics) through the model's forward:
the sum over the batch's loss units (tokens for cross-entropy), a device scalar that is never read
back here (no host sync); the count from the loader's CPU tensors (no device sync); metrics, a dict
of device scalars summed over a step's micro-batches and ranks, handed back through
`step_metrics` (nothing for cross-entropy). Train and eval both call `loss`: one loss for both.

`uniform_loss(vocab_size)` is what a model that knows nothing scores under this objective (ln V for
cross-entropy): the reference of GUARD-INIT-LOSS, GUARD-EVAL-COLLAPSE and GUARD-EVAL-DIVERGED, which
ask the objective instead of assuming cross-entropy. A preference (DPO) objective plugs in here with
its own batch keys, loss, count and reference (ln 2 for a pairwise choice).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from ..tensors import IGNORE_INDEX


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device`. Pinned host memory first on CUDA: the copy is then truly
    asynchronous (from pageable memory it may wait for the stream, i.e. for the previous step's
    optimizer, before the host can queue the forward)."""
    pin = device.type == "cuda"
    return {k: ((v.pin_memory() if pin and v.device.type == "cpu" else v).to(device, non_blocking=True)
                if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()}


class Objective(Protocol):
    """The interface the Trainer and `evaluate` use (see the module docstring)."""

    name: str

    def loss(self, model: torch.nn.Module, batch: dict, device: torch.device
             ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]: ...

    def count(self, batch: dict) -> int: ...

    def uniform_loss(self, vocab_size: int) -> float: ...

    def step_metrics(self, sums: dict[str, float], loss_tokens: int) -> dict[str, Any]: ...


class CausalLMLoss:
    """Next-token cross-entropy: `model(input_ids, labels=...)` returns the summed CE over the labels
    that are not IGNORE_INDEX (already shifted by the loader) and their count."""

    name = "causal-lm"

    def loss(self, model: torch.nn.Module, batch: dict, device: torch.device
             ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        b = to_device(batch, device)
        loss_sum, _ = model(b["input_ids"], labels=b["labels"], position_ids=b.get("position_ids"),
                            doc_ids=b.get("doc_ids"))
        return loss_sum, self.count(batch), {}

    def count(self, batch: dict) -> int:
        """Loss tokens of one batch, counted on the loader's (CPU) labels: no device sync."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def uniform_loss(self, vocab_size: int) -> float:
        """ln V: the cross-entropy of a uniform guess over the vocabulary."""
        return math.log(vocab_size)

    def step_metrics(self, sums: dict[str, float], loss_tokens: int) -> dict[str, Any]:
        return {}  # the step's loss is the Trainer's own field


__all__ = ["CausalLMLoss", "Objective", "to_device"]
