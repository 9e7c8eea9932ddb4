"""NF4 weights dequantized inside the matmul: ``nf4_linear(x, w) = x @ dequantize(w)^T (+ bias) (+ LoRA)``.

The unfused path (``nf4.dequantize`` then cuBLAS) writes every weight to memory in bf16 and reads it back:
~4.5 bytes of traffic per weight against the 0.5 the packed codes take. Where the matmul is bound by reading
the weight (few rows: decoding, the in-loop task evaluation of a QLoRA run) this kernel reads only the codes
and their scales, and dequantizes each tile in registers before ``tl.dot``. Where it is bound by arithmetic
(training's 4,096-token micro-batches) cuBLAS's bf16 matmul is faster than this one, so ``NF4Linear`` uses
it up to ``FUSED_MAX_ROWS`` rows (measured: bench/nf4_matmul_ab.py, bench/RESULTS.md).

Same values as the unfused path: each weight is ``level * (q / factor + mean)`` in fp32, rounded once to the
input's dtype (as ``nf4.dequantize``), then multiplied with fp32 accumulation. The LoRA term, given the
down-projection ``x @ A^T``, is added in fp32 before the one rounding of the output: ``LoRALinear`` without a
separate [rows, out] pass (inference only; training keeps autograd's path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from .nf4 import BLOCK_SIZE, SCALE_BLOCK_SIZE, NF4Weight, nf4_table

# Rows up to which NF4Linear takes the fused kernel on CUDA (bench/nf4_matmul_ab.py on an H200: see
# bench/RESULTS.md, session 18). Above it: dequantize, then cuBLAS.
FUSED_MAX_ROWS = 64


@triton.jit
def _nf4_linear_kernel(x_ptr, packed_ptr, qscale_ptr, factor_ptr, mean_ptr, table_ptr, out_ptr, bias_ptr,
                       down_ptr, lora_b_ptr, lora_scale, M, N, K, rank, stride_xm, stride_om, stride_dm,
                       HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, R: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QBLOCK: tl.constexpr,
                       SBLOCK: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    rows = rn.to(tl.int64)
    mean = tl.load(mean_ptr)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_len = K // SPLIT_K  # K % (BK * SPLIT_K) == 0 (the wrapper's choice): no mask along K
    for k0 in range(split * k_len, (split + 1) * k_len, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
        # W[n, k] is flat element n*K + k: byte (n*K + k) // 2, high nibble first; block (n*K + k) // 64
        rb = k0 // 2 + tl.arange(0, BK // 2)
        byte = tl.load(packed_ptr + rows[:, None] * (K // 2) + rb[None, :], mask=n_ok[:, None], other=0)
        byte = byte.to(tl.int32)
        hi = tl.load(table_ptr + (byte >> 4))
        lo = tl.load(table_ptr + (byte & 0xF))
        blk = rows[:, None] * (K // QBLOCK) + k0 // QBLOCK + tl.arange(0, BK // QBLOCK)[None, :]
        q = tl.load(qscale_ptr + blk, mask=n_ok[:, None], other=0).to(tl.float32)
        f = tl.load(factor_ptr + blk // SBLOCK, mask=n_ok[:, None], other=1.0)
        scale = q / f + mean  # [BN, BK // 64]
        w = tl.reshape(tl.join(hi, lo), (BN, BK // QBLOCK, QBLOCK)) * scale[:, :, None]
        w = tl.reshape(w, (BN, BK)).to(x.dtype)
        if DOT_FP32:  # the exact products of the rounded values, accumulated in fp32 (no tf32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_LORA and split == 0:  # + scale * down @ B^T, in fp32 (the adapters' dtype)
        rr = tl.arange(0, R)
        r_ok = rr < rank
        down = tl.load(down_ptr + rm[:, None].to(tl.int64) * stride_dm + rr[None, :],
                       mask=m_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(lora_b_ptr + rows[:, None] * rank + rr[None, :], mask=n_ok[:, None] & r_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(down, tl.trans(b), input_precision="ieee") * lora_scale
    if HAS_BIAS and split == 0:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:  # partial sums into a zeroed fp32 buffer, rounded to the output dtype after the kernel
        tl.atomic_add(out, acc, mask=m_ok[:, None] & n_ok[None, :])


def supported(w: NF4Weight) -> bool:
    """The kernel's layout: a 2-D weight whose rows are whole blocks of 64 (every linear of the families)."""
    return len(w.shape) == 2 and w.shape[1] % BLOCK_SIZE == 0


def _tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, split-K). Few rows are bound by reading the weight: narrow column tiles, and K
    split over more programs where the columns alone give fewer programs than an H200 has SMs (132)."""
    bk = 128 if k % 128 == 0 else 64
    if m > 64:
        return 128, 128, bk, 8, 1
    bm, bn = (16, 32) if m <= 16 else (64, 64)
    split = 1
    while triton.cdiv(n, bn) * split < 264 and k % (bk * split * 2) == 0 and k // (split * 2) >= 512:
        split *= 2
    return bm, bn, bk, 4, split


def nf4_linear(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None,
               lora: tuple[torch.Tensor, torch.Tensor, float] | None = None, *,
               tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ dequantize(w, x.dtype)^T + bias``, plus ``scale * down @ B^T`` for ``lora = (down, B, scale)``
    (``down = dropout(x) @ A^T`` [..., r], ``B`` [out, r]). x [..., in] 16-bit or fp32; output x's dtype.
    ``tiles`` overrides ``_tiles`` (BM, BN, BK, warps, split-K): bench/nf4_matmul_ab.py's sweep."""
    _common.check_device(x, w.packed)
    if not supported(w):
        raise ValueError(f"nf4_linear needs a 2-D weight with rows of whole {BLOCK_SIZE}-blocks, got {w.shape}")
    n, k = w.shape
    assert x.shape[-1] == k, f"x {tuple(x.shape)} vs weight {w.shape}"
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    bm, bn, bk, warps, split = tiles or _tiles(m, n, k)
    assert k % (bk * split) == 0, f"in_features {k} is not a multiple of BK {bk} x split-K {split}"
    out = _common.empty((m, n), x.dtype, x.device) if split == 1 else torch.zeros((m, n), dtype=torch.float32,
                                                                                    device=x.device)
    if lora is not None:
        down, lora_b, lora_scale = lora
        down = down.reshape(m, -1)
        lora_b = lora_b.contiguous()
        if down.stride(-1) != 1:
            down = down.contiguous()
        rank = lora_b.shape[1]
        assert down.shape[1] == rank and lora_b.shape[0] == n, "LoRA down [rows, r] and B [out, r]"
    else:
        down, lora_b, lora_scale, rank = x2, x2, 0.0, 1
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    if m:
        _nf4_linear_kernel[grid](
            x2, w.packed, w.qscale, w.factor, w.mean.reshape(1), nf4_table(x.device), out,
            bias if bias is not None else out, down, lora_b, float(lora_scale), m, n, k, rank,
            x2.stride(0), out.stride(0), down.stride(0),
            HAS_BIAS=bias is not None, HAS_LORA=lora is not None, R=max(16, _common.next_pow2(rank)),
            BM=bm, BN=bn, BK=bk, QBLOCK=BLOCK_SIZE, SBLOCK=SCALE_BLOCK_SIZE,
            # fp32 inputs: full fp32 as F.linear; the CPU interpreter's 16-bit tl.dot is wrong (triton 3.9)
            DOT_FP32=x.dtype == torch.float32 or not x.is_cuda, SPLIT_K=split, num_warps=warps)
    return out.to(x.dtype).view(*x.shape[:-1], n)
