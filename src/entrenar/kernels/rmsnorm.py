"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers: normalise in (at least) fp32, cast back, then scale.
    dtype = x.dtype
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)
