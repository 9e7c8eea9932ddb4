"""SwiGLU activation: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_reference(gate, up)
