"""Kernels: each module holds a torch reference, a Triton kernel and its autograd.Function.

``get_ops("torch")`` returns the references (any device, any dtype, float64 included);
``get_ops("triton")`` the fused kernels (CUDA, or the CPU interpreter with TRITON_INTERPRET=1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import cross_entropy, rmsnorm, rope, swiglu


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable
    rope: Callable
    swiglu: Callable
    linear_cross_entropy: Callable


TORCH_OPS = Ops(rmsnorm.rms_norm_reference, rope.rope_reference, swiglu.swiglu_reference,
                cross_entropy.linear_cross_entropy_reference)


def resolve_kernels(kind: str, device: str) -> str:
    """'auto' -> Triton on CUDA (the fast path), the torch references elsewhere."""
    if kind == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    if kind not in ("torch", "triton"):
        raise ValueError(f"kernels {kind!r} not in ('auto', 'torch', 'triton')")
    return kind


def get_ops(kind: str) -> Ops:
    if kind == "torch":
        return TORCH_OPS
    if kind == "triton":
        return Ops(rmsnorm.rms_norm, rope.rope, swiglu.swiglu, cross_entropy.linear_cross_entropy)
    raise ValueError(f"kernels {kind!r} not in ('torch', 'triton')")
