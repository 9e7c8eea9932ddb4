"""Rotary position embedding, both pairings.

neox: pairs (i, i + d/2) -- transformers' LLaMA and Qwen2 ("rotate_half").
gptj: pairs (2i, 2i + 1) -- adjacent, GPT-J / original Meta layout.
q, k: [batch, seq, heads, head_dim]; cos, sin: [batch, seq, head_dim // 2], fp32.

``rope_reference`` (``reference.py``, re-exported here) is the eager path; ``rope`` runs one Triton program per (batch, position) that
rotates every head of q and k (trig loaded once, in fp32); the backward is the same kernel rotating
by the negative angle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from .reference import rope_reference  # noqa: F401 -- re-exported: each kernel next to its reference

# Which element pairs the kernel rotates. Tests swap the two codes to show a pairing mix-up is caught.
_STYLE_CODE = {"neox": 0, "gptj": 1}


@triton.jit
def _rotate_heads(x_ptr, sx_row, sx_h, y_ptr, rows, row_ok, n_heads, cos, sin,
                  HALF: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
                  GPTJ: tl.constexpr):
    heads = tl.arange(0, HEADS_BLOCK)[None, :, None]
    pair = tl.arange(0, HALF_BLOCK)[None, None, :]
    mask = row_ok & (heads < n_heads) & (pair < HALF)
    if GPTJ:
        first = 2 * pair
        second = 2 * pair + 1
    else:
        first = pair
        second = pair + HALF
    x_base = x_ptr + rows * sx_row + heads * sx_h
    y_base = y_ptr + (rows * n_heads + heads) * (2 * HALF)  # outputs are contiguous [rows, heads, D]
    x1 = tl.load(x_base + first, mask=mask, other=0.0)
    x2 = tl.load(x_base + second, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    y1 = x1f * cos - x2f * sin
    y2 = x2f * cos + x1f * sin
    tl.store(y_base + first, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_base + second, y2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, sq_row, sq_h, k_ptr, sk_row, sk_h, qo_ptr, ko_ptr, cos_ptr, sin_ptr, sc_row,
                 n_rows, n_q_heads, n_k_heads, sin_sign,
                 HALF: tl.constexpr, ROWS: tl.constexpr, QH_BLOCK: tl.constexpr, KH_BLOCK: tl.constexpr,
                 HALF_BLOCK: tl.constexpr, GPTJ: tl.constexpr):
    # a row is one (batch, position); every head of q and k at that row shares its cos/sin
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None, None]
    row_ok = rows < n_rows
    pair = tl.arange(0, HALF_BLOCK)[None, None, :]
    trig_mask = row_ok & (pair < HALF)
    cos = tl.load(cos_ptr + rows * sc_row + pair, mask=trig_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + rows * sc_row + pair, mask=trig_mask, other=0.0).to(tl.float32) * sin_sign
    _rotate_heads(q_ptr, sq_row, sq_h, qo_ptr, rows, row_ok, n_q_heads, cos, sin,
                  HALF, QH_BLOCK, HALF_BLOCK, GPTJ)
    _rotate_heads(k_ptr, sk_row, sk_h, ko_ptr, rows, row_ok, n_k_heads, cos, sin,
                  HALF, KH_BLOCK, HALF_BLOCK, GPTJ)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [B*T, ...] as a view when strides allow, else a contiguous copy."""
    if x.stride(-1) != 1 or x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
            sin_sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    q2, k2, cos2, sin2 = _rows_view(q), _rows_view(k), _rows_view(cos), _rows_view(sin)
    if cos2.stride() != sin2.stride():
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    qo = _common.empty((B, T, Hq, D), q.dtype, q.device)
    ko = _common.empty((B, T, Hk, D), k.dtype, k.device)
    n_rows = B * T
    if n_rows == 0:
        return qo, ko
    half = D // 2
    qh_block, kh_block, half_block = _common.next_pow2(Hq), _common.next_pow2(Hk), _common.next_pow2(half)
    # the interpreter pays per program, the GPU wants many programs
    budget = 1 << 15 if q.device.type == "cpu" else 1 << 11
    rows = max(1, min(64, budget // (qh_block * half_block)))
    _rope_kernel[(triton.cdiv(n_rows, rows),)](
        q2, q2.stride(0), q2.stride(1), k2, k2.stride(0), k2.stride(1), qo, ko, cos2, sin2, cos2.stride(0),
        n_rows, Hq, Hk, sin_sign, HALF=half, ROWS=rows, QH_BLOCK=qh_block, KH_BLOCK=kh_block,
        HALF_BLOCK=half_block, GPTJ=_STYLE_CODE[style] == 1, num_warps=4)
    return qo, ko


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, style):
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return _launch(q, k, cos, sin, style, 1.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # the rotation is orthogonal: its transpose is the rotation by -angle
        dq_in, dk_in = _launch(dq, dk, cos, sin, ctx.style, -1.0)
        return dq_in, dk_in, None, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RoPE; q [B,T,H,D], k [B,T,K,D], cos/sin [B,T,D/2] fp32 (trig is never rounded lower)."""
    if style not in _STYLE_CODE:
        raise ValueError(f"rope style {style!r} not in ('neox', 'gptj')")
    _common.check_device(q, k, cos, sin)
    B, T, _, D = q.shape
    assert k.shape[:2] == (B, T) and k.shape[3] == D, f"q {tuple(q.shape)} vs k {tuple(k.shape)}"
    assert cos.shape == sin.shape == (B, T, D // 2), f"cos {tuple(cos.shape)} for q {tuple(q.shape)}"
    assert cos.dtype == sin.dtype == torch.float32, f"rope trig must be fp32, got {cos.dtype}"
    return _RopeFunction.apply(q, k, cos, sin, style)
