"""SwiGLU activation: silu(gate) * up.

``swiglu_reference`` (``reference.py``, re-exported here) is the eager path; ``swiglu`` is an elementwise Triton forward/backward pair
(fp32 math, one rounding to the output dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from .reference import swiglu_reference  # noqa: F401 -- re-exported: each kernel next to its reference


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g)/dg = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)


def _block(device: torch.device) -> int:
    return 1024 if device.type == "cuda" else 1 << 16  # the interpreter pays per program


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = _common.empty(gate.shape, torch.promote_types(gate.dtype, up.dtype), gate.device)
        n = gate.numel()
        if n:
            block = _block(gate.device)
            _swiglu_fwd_kernel[(triton.cdiv(n, block),)](gate, up, y, n, BLOCK=block, num_warps=4)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg = _common.empty(gate.shape, gate.dtype, gate.device)
        du = _common.empty(up.shape, up.dtype, up.device)
        n = gate.numel()
        if n:
            block = _block(gate.device)
            _swiglu_bwd_kernel[(triton.cdiv(n, block),)](dy, gate, up, dg, du, n, BLOCK=block, num_warps=4)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton silu(gate) * up, same shapes."""
    _common.check_device(gate, up)
    assert gate.shape == up.shape, f"gate {tuple(gate.shape)} vs up {tuple(up.shape)}"
    return _SwiGLUFunction.apply(gate, up)
