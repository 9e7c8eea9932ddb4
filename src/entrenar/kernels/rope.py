"""Rotary position embedding, both pairings.

neox: pairs (i, i + d/2) -- transformers' LLaMA and Qwen2 ("rotate_half").
gptj: pairs (2i, 2i + 1) -- adjacent, GPT-J / original Meta layout.
q, k: [batch, seq, heads, head_dim]; cos, sin: [batch, seq, head_dim // 2], fp32.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    cos = cos.unsqueeze(2)  # broadcast over heads
    sin = sin.unsqueeze(2)
    xf = x.to(cos.dtype) if cos.dtype.itemsize > x.dtype.itemsize else x.float()
    if style == "neox":
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    elif style == "gptj":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        raise ValueError(f"rope style {style!r} not in ('neox', 'gptj')")
    return out.to(x.dtype)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   style: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin, style), _rotate(k, cos, sin, style)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         style: str) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_reference(q, k, cos, sin, style)
