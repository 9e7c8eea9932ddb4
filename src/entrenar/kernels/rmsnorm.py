"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32.

``rms_norm`` is the Triton kernel pair (forward + backward) behind an autograd.Function. Rows are the last dimension; rows may
be strided (a view into a wider buffer), which is how the tests show loads never read past a row's end.
The eager path, ``rms_norm_reference``, lives in ``reference.py`` (importable without Triton) and is
re-exported here next to its kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from .reference import rms_norm_reference  # noqa: F401 -- re-exported: each kernel next to its reference

# Loads are masked at the row end. Tests flip this to False to show that a reduction reading past
# the end of short rows (BLOCK > n_cols) is caught; production code never touches it.
_MASK_ROW_END = True


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, x_row_stride, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, MASK_ROW_END: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    row_ok = rows < n_rows
    if MASK_ROW_END:
        in_row = cols < n_cols
    else:
        in_row = cols < BLOCK
    x = tl.load(x_ptr + rows * x_row_stride + cols, mask=row_ok & in_row, other=0.0)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    tl.store(rstd_ptr + tl.reshape(rows, [ROWS]), rstd, mask=tl.reshape(row_ok, [ROWS]))
    # as the reference: normalise in fp32, round to the input dtype, then scale by the weight
    x_hat = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = x_hat * w
    tl.store(y_ptr + rows * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=row_ok & (cols < n_cols))


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, x_row_stride, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
                         n_rows, n_cols, tiles_per_program,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, MASK_ROW_END: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    col_ok = cols < n_cols
    if MASK_ROW_END:
        in_row = cols < n_cols
    else:
        in_row = cols < BLOCK
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    # 64-bit row offsets: rows * cols may pass 2**31
    rows = pid.to(tl.int64) * tiles_per_program * ROWS + tl.arange(0, ROWS)[:, None]
    for _ in range(tiles_per_program):
        row_ok = rows < n_rows
        x = tl.load(x_ptr + rows * x_row_stride + cols, mask=row_ok & in_row, other=0.0)
        xf = x.to(tl.float32)
        dy = tl.load(dy_ptr + rows * n_cols + cols, mask=row_ok & col_ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        x_hat = xf * rstd
        g = dy * w
        # d/dx of x*rstd(x): rstd * (g - x_hat * mean(g * x_hat))
        dot = tl.sum(g * x_hat, axis=1)[:, None] / n_cols
        dx = rstd * (g - x_hat * dot)
        tl.store(dx_ptr + rows * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_ok & col_ok)
        dw_acc += dy * x_hat.to(x.dtype).to(tl.float32)
        rows += ROWS
    tl.store(dw_partial_ptr + pid * n_cols + tl.reshape(cols, [BLOCK]), tl.sum(dw_acc, axis=0),
             mask=tl.reshape(col_ok, [BLOCK]))


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _rows_per_program(block: int, device: torch.device) -> int:
    # a [ROWS, BLOCK] tile of about 4K elements on the GPU; the interpreter pays per program, so more
    return max(1, min(64 if device.type == "cpu" else 16, (16384 if device.type == "cpu" else 4096) // block))


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n_cols = x.shape[-1]
        x2 = x.reshape(-1, n_cols)  # keeps a strided view when possible
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n_rows = x2.shape[0]
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        if out_dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
            # Under autocast every consumer (the Q/K/V and gate/up matmuls, the LM head) rounds this
            # output to the autocast dtype anyway; rounding once here gives the same values and saves
            # an fp32 write plus one cast per consumer, forward and backward.
            out_dtype = torch.get_autocast_dtype(x.device.type)
        y = _common.empty((n_rows, n_cols), out_dtype, x.device)
        rstd = _common.empty((n_rows,), torch.float32, x.device)
        block = _common.next_pow2(n_cols)
        rows = _rows_per_program(block, x.device)
        if n_rows:
            _rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
                x2, x2.stride(0), weight, y, rstd, n_rows, n_cols, float(eps),
                ROWS=rows, BLOCK=block, MASK_ROW_END=_MASK_ROW_END, num_warps=_num_warps(block * rows))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], n_cols)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.reshape(-1, n_cols).contiguous()
        dx = _common.empty((n_rows, n_cols), x2.dtype, x2.device)
        block = _common.next_pow2(n_cols)
        rows = _rows_per_program(block, x2.device)
        n_tiles = triton.cdiv(n_rows, rows)
        sms = torch.cuda.get_device_properties(x2.device).multi_processor_count if x2.is_cuda else 1
        n_programs = max(1, min(n_tiles, 4 * sms))  # 16 * sms measured slower in the model (2.6 -> 5.5 ms/step)
        tiles_per_program = triton.cdiv(n_tiles, n_programs) if n_tiles else 1
        n_programs = max(1, triton.cdiv(n_tiles, tiles_per_program))
        dw_partial = _common.empty((n_programs, n_cols), torch.float32, x2.device)
        if n_rows:
            _rms_norm_bwd_kernel[(n_programs,)](dy2, x2, x2.stride(0), weight, rstd, dx, dw_partial,
                                                n_rows, n_cols, tiles_per_program,
                                                ROWS=rows, BLOCK=block, MASK_ROW_END=_MASK_ROW_END,
                                                num_warps=_num_warps(block * rows))
            dw = dw_partial.sum(0).to(weight.dtype)
        else:
            dw = torch.zeros_like(weight)
        return dx.view(ctx.x_shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm over the last dim; output dtype = promote(x, weight) as the reference."""
    _common.check_device(x, weight)
    assert weight.shape == (x.shape[-1],), f"weight {tuple(weight.shape)} vs row {x.shape[-1]}"
    return _RMSNormFunction.apply(x, weight, eps)
