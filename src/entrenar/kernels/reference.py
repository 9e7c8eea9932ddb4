"""The torch reference ops: the eager path on any device and dtype, float64 included.

They are the ``kernels="torch"`` path, the float64 oracle of ``verify`` and what each Triton kernel
is tested against. This module needs only torch: ``import entrenar.model`` works without Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tensors import IGNORE_INDEX


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers: normalise in (at least) fp32, cast back, then scale.
    dtype = x.dtype
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + delta) * weight, x + delta): the residual add, then the norm of the sum.

    The sum keeps x's dtype (the residual stream's: fp32 under autocast while delta, a matmul output, is
    bf16); the norm's output dtype is rms_norm_reference's unless ``out_dtype`` is given."""
    residual = (x + delta).to(x.dtype)
    normed = rms_norm_reference(residual, weight, eps)
    return (normed if out_dtype is None else normed.to(out_dtype)), residual


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    cos = cos.unsqueeze(2)  # broadcast over heads
    sin = sin.unsqueeze(2)
    # at least fp32, and float64 stays float64 (an earlier `x.float()` silently rounded the fp64 oracle)
    xf = x.to(torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32))
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
    """neox pairs (i, i + d/2), gptj pairs (2i, 2i + 1); q [B,T,H,D], k [B,T,K,D], cos/sin [B,T,D/2]."""
    return _rotate(q, cos, sin, style), _rotate(k, cos, sin, style)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = IGNORE_INDEX, reduction: str = "sum") -> torch.Tensor:
    """hidden [N, H], weight [V, H], labels [N] (already shifted) -> summed (or mean) loss."""
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
