"""Decode attention over each slot's own columns, split along the columns (flash-decoding).

One query token per slot: q [B, K, G, D] (the G query heads sharing kv head k), the slot cache's keys and values
[B, K, T, D] (any strides, the last one 1), and per slot the columns it attends to, ``start[b] <= t < end[b]``
(the engine's slots: left padding before ``start``, columns past the slot's last token from ``end`` on). SDPA
reads every column of every slot under a mask and pads the G queries to its query tile (64 rows); here a
program reads only the columns in its slot's span, in chunks of ``chunk`` columns, so a step reads what the
slots reached and nothing more, and a few long slots still spread over many programs (the split).

The products run in fp32 on the tensor cores' tf32 for 16-bit inputs (a bf16 or fp16 value is exact in tf32, and
the probabilities keep 10 bits where SDPA rounds them to the inputs' 7 or 10), in IEEE fp32 for fp32 inputs.
Pass 1: program (slot b, kv head k, chunk c) keeps the running max m, sum l and the unnormalised output acc of
softmax(q k^T * scale) v over the chunk's columns inside the span, in fp32 (an empty chunk: m = -inf, l = 0); with
one chunk per slot (enough slots to fill the GPU) it writes acc / l and is done. Pass 2, with several chunks:
out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
Exact to rounding against softmax over the span in float64 (tests/test_decode_attention.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _common

BLOCK_N = 64  # columns per inner step of a program
MIN_PROGRAMS = 264  # programs a step aims for at least (2 per SM of an H200): small batches split, large ones don't


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, start_ptr, end_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
                             sq_b, sq_k, sq_g, sk_b, sk_k, sk_t, sv_b, sv_k, sv_t,
                             n_kv, n_chunks, chunk, T, G, scale,
                             GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                             ONE_CHUNK: tl.constexpr):
    bk = tl.program_id(0)
    c = tl.program_id(1)
    b = bk // n_kv
    kh = bk % n_kv
    lo = tl.maximum(tl.load(start_ptr + b), c * chunk)
    hi = tl.minimum(tl.minimum(tl.load(end_ptr + b), c * chunk + chunk), T)  # never past the columns given
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + kh * sq_k + g[:, None] * sq_g + d[None, :],
                mask=g[:, None] < G, other=0.0).to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    k_base = k_ptr + b.to(tl.int64) * sk_b + kh * sk_k
    v_base = v_ptr + b.to(tl.int64) * sv_b + kh * sv_k
    for n in range(lo, hi, BLOCK):
        cols = n + tl.arange(0, BLOCK)
        ok = cols < hi
        k = tl.load(k_base + cols[:, None].to(tl.int64) * sk_t + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * sv_t + d[None, :], mask=ok[:, None], other=0.0)
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if ONE_CHUNK:  # the whole span in this program: the output itself
        out = acc / l_i[:, None]
        tl.store(out_ptr + (bk.to(tl.int64) * G + g[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g[:, None] < G)
    else:
        row = (bk.to(tl.int64) * n_chunks + c) * G + g
        tl.store(m_ptr + row, m_i, mask=g < G)
        tl.store(l_ptr + row, l_i, mask=g < G)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=g[:, None] < G)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, n_chunks, G,
                    GP: tl.constexpr, D: tl.constexpr, CHUNKS: tl.constexpr):
    """Pass 2, program (slot, kv head): out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c."""
    bk = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    ok = (c[:, None] < n_chunks) & (g[None, :] < G)
    row = (bk * n_chunks + c[:, None]) * G + g[None, :]  # [CHUNKS, GP]
    m = tl.load(m_ptr + row, mask=ok, other=float("-inf"))
    lse = tl.load(l_ptr + row, mask=ok, other=0.0)
    top = tl.where(g < G, tl.max(m, 0), 0.0)  # [GP]; every slot has a column, so some chunk of it is finite
    w = tl.where(ok, tl.exp(m - top[None, :]), 0.0)  # an empty chunk (m = -inf) weighs 0
    acc = tl.load(acc_ptr + row[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0)
    out = tl.sum(acc * w[:, :, None], 0) / tl.where(g < G, tl.sum(lse * w, 0), 1.0)[:, None]
    tl.store(out_ptr + (bk * G + g[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)


def chunk_columns(batch: int, kv_heads: int, columns: int, min_programs: int = MIN_PROGRAMS) -> int:
    """Columns per program: all of them when batch x kv_heads programs already fill the GPU, else split so
    about `min_programs` run (a multiple of BLOCK_N)."""
    splits = max(1, min(math.ceil(columns / BLOCK_N), math.ceil(min_programs / max(1, batch * kv_heads))))
    return BLOCK_N * math.ceil(math.ceil(columns / splits) / BLOCK_N)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                     scale: float, chunk: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v of one query per head over each slot's columns [start, end): q [B, K, G, D],
    k and v [B, K, T, D], start and end [B] (int, on the device; 0 <= start < end <= T). Returns [B, K, G, D] in
    q's dtype. One torch op (entrenar::decode_attention): a CUDA graph, or the tests' CPU stand-in of one,
    records it as one kernel."""
    _common.check_device(q, k, v, start, end)
    B, K, _, D = q.shape
    T = k.shape[2]
    assert k.shape == v.shape == (B, K, T, D) and start.shape == end.shape == (B,), (q.shape, k.shape, start.shape)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and D == triton.next_power_of_2(D), "rows of D, stride 1"
    return _decode_attention_op(q, k, v, start, end, scale, chunk or chunk_columns(B, K, T))


@torch.library.custom_op("entrenar::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                         scale: float, chunk: int) -> torch.Tensor:
    B, K, G, D = q.shape
    n_chunks = math.ceil(k.shape[2] / chunk)
    out = _common.empty((B, K, G, D), q.dtype, q.device)
    acc = _common.empty((B, K, n_chunks, G, D), torch.float32, q.device) if n_chunks > 1 else out
    m = _common.empty((B, K, n_chunks, G), torch.float32, q.device) if n_chunks > 1 else out
    lse = _common.empty((B, K, n_chunks, G), torch.float32, q.device) if n_chunks > 1 else out
    GP = max(16, triton.next_power_of_2(G))
    _decode_attention_kernel[(B * K, n_chunks)](
        q, k, v, start, end, out, acc, m, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), K, n_chunks, chunk, k.shape[2], G, scale,
        GP=GP, D=D, BLOCK=BLOCK_N, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ONE_CHUNK=n_chunks == 1)
    if n_chunks > 1:
        _combine_kernel[(B * K,)](acc, m, lse, out, n_chunks, G, GP=triton.next_power_of_2(G), D=D,
                                  CHUNKS=triton.next_power_of_2(n_chunks))
    return out


@_decode_attention_op.register_fake
def _(q, k, v, start, end, scale, chunk):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
