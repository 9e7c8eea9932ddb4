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
from .reference import add_rms_norm_reference, rms_norm_reference  # noqa: F401 -- re-exported: each kernel next to its reference

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


def _norm_out_dtype(x_dtype: torch.dtype, weight: torch.Tensor, device: torch.device) -> torch.dtype:
    out_dtype = torch.promote_types(x_dtype, weight.dtype)
    if out_dtype == torch.float32 and torch.is_autocast_enabled(device.type):
        # Under autocast every consumer (the Q/K/V and gate/up matmuls, the LM head) rounds this
        # output to the autocast dtype anyway; rounding once here gives the same values and saves
        # an fp32 write plus one cast per consumer, forward and backward.
        out_dtype = torch.get_autocast_dtype(device.type)
    return out_dtype


def _bwd_grid(n_rows: int, rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, row tiles per program): a few programs per SM, each summing its weight-grad partial."""
    n_tiles = triton.cdiv(n_rows, rows)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    n_programs = max(1, min(n_tiles, 4 * sms))  # 16 * sms measured slower in the model (2.6 -> 5.5 ms/step)
    tiles_per_program = triton.cdiv(n_tiles, n_programs) if n_tiles else 1
    return max(1, triton.cdiv(n_tiles, tiles_per_program)), tiles_per_program


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [rows, C] with unit column stride (a strided row view is kept)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n_cols = x.shape[-1]
        x2 = _rows_2d(x)
        n_rows = x2.shape[0]
        y = _common.empty((n_rows, n_cols), _norm_out_dtype(x.dtype, weight, x.device), x.device)
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
        n_programs, tiles_per_program = _bwd_grid(n_rows, rows, x2.device)
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


# ---- residual add fused into RMSNorm ---------------------------------------------------------------
# residual = x + delta, normed = rms_norm(residual) * weight: one read of x and delta, one write of each
# output, instead of an add kernel (read 2, write 1) and a norm kernel that reads the sum again. The
# backward adds the residual stream's incoming gradient inside the norm-backward kernel and writes the
# gradient of delta in delta's dtype there too (the unfused path: an add kernel plus a cast kernel).
@triton.jit
def _add_rms_norm_fwd_kernel(x_ptr, x_row_stride, d_ptr, d_row_stride, w_ptr, y_ptr, r_ptr, rstd_ptr,
                             n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    row_ok = rows < n_rows
    ok = row_ok & (cols < n_cols)
    x = tl.load(x_ptr + rows * x_row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + rows * d_row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    # rounded to the residual stream's dtype before the norm reads it, as the unfused add + norm does
    r = (x + d).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + rows * n_cols + cols, r, mask=ok)
    rf = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + tl.reshape(rows, [ROWS]), rstd, mask=tl.reshape(row_ok, [ROWS]))
    r_hat = (rf * rstd[:, None]).to(r.dtype).to(tl.float32)  # as rms_norm: round to the input dtype, then scale
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows * n_cols + cols, (r_hat * w).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_bwd_kernel(dy_ptr, dr_ptr, r_ptr, w_ptr, rstd_ptr, dx_ptr, dd_ptr, dw_partial_ptr,
                             n_rows, n_cols, tiles_per_program, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_DR: tl.constexpr, HAS_DD: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    rows = pid.to(tl.int64) * tiles_per_program * ROWS + tl.arange(0, ROWS)[:, None]
    for _ in range(tiles_per_program):
        ok = (rows < n_rows) & col_ok
        r = tl.load(r_ptr + rows * n_cols + cols, mask=ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
        dy = tl.load(dy_ptr + rows * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        r_hat = r.to(tl.float32) * rstd
        g = dy * w
        dx = rstd * (g - r_hat * (tl.sum(g * r_hat, axis=1)[:, None] / n_cols))
        if HAS_DR:
            # the residual stream's own gradient: d(x + delta) reaches x and delta unchanged
            dx += tl.load(dr_ptr + rows * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        if HAS_DD:
            tl.store(dd_ptr + rows * n_cols + cols, dx.to(dd_ptr.dtype.element_ty), mask=ok)
        dw_acc += dy * r_hat.to(r.dtype).to(tl.float32)
        rows += ROWS
    tl.store(dw_partial_ptr + pid * n_cols + tl.reshape(cols, [BLOCK]), tl.sum(dw_acc, axis=0),
             mask=tl.reshape(col_ok, [BLOCK]))


class _AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        n_cols = x.shape[-1]
        x2, d2 = _rows_2d(x), _rows_2d(delta)
        n_rows = x2.shape[0]
        out_dtype = out_dtype or _norm_out_dtype(x.dtype, weight, x.device)
        y = _common.empty((n_rows, n_cols), out_dtype, x.device)
        residual = _common.empty((n_rows, n_cols), x.dtype, x.device)
        rstd = _common.empty((n_rows,), torch.float32, x.device)
        block = _common.next_pow2(n_cols)
        rows = _rows_per_program(block, x.device)
        if n_rows:
            _add_rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
                x2, x2.stride(0), d2, d2.stride(0), weight, y, residual, rstd, n_rows, n_cols, float(eps),
                ROWS=rows, BLOCK=block, num_warps=_num_warps(block * rows))
        ctx.save_for_backward(residual, weight, rstd)
        ctx.shape, ctx.delta_dtype = x.shape, delta.dtype
        ctx.set_materialize_grads(False)  # an unused residual output costs no zero tensor in backward
        return y.view(x.shape), residual.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor | None, d_residual: torch.Tensor | None):
        residual, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = residual.shape
        dy2 = torch.zeros_like(residual) if dy is None else dy.reshape(-1, n_cols).contiguous()
        dr2 = dy2 if d_residual is None else d_residual.reshape(-1, n_cols).contiguous()  # dy2: unread
        dx = _common.empty((n_rows, n_cols), residual.dtype, residual.device)
        # d_delta = d_x: the same tensor when the dtypes agree, else written by the kernel in delta's dtype
        has_dd = ctx.delta_dtype != residual.dtype
        dd = _common.empty((n_rows, n_cols), ctx.delta_dtype, residual.device) if has_dd else dx
        block = _common.next_pow2(n_cols)
        rows = _rows_per_program(block, residual.device)
        n_programs, tiles_per_program = _bwd_grid(n_rows, rows, residual.device)
        dw_partial = _common.empty((n_programs, n_cols), torch.float32, residual.device)
        if n_rows:
            _add_rms_norm_bwd_kernel[(n_programs,)](
                dy2, dr2, residual, weight, rstd, dx, dd, dw_partial, n_rows, n_cols, tiles_per_program,
                ROWS=rows, BLOCK=block, HAS_DR=d_residual is not None, HAS_DD=has_dd,
                num_warps=_num_warps(block * rows))
            dw = dw_partial.sum(0).to(weight.dtype)
        else:
            dw = torch.zeros_like(weight)
        dx = dx.view(ctx.shape)
        # The very tensor twice when the dtypes agree, as torch's add backward does: autograd then never
        # hands two leaves' .grad one shared storage (two views would each be "stolen", and the next
        # accumulation into one .grad would add into the other).
        return dx, (dd.view(ctx.shape) if has_dd else dx), dw, None, None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual): residual = x + delta in x's dtype (the residual stream's; the add in fp32),
    normed = rms_norm(residual) * weight in ``out_dtype`` (default: as ``rms_norm``, the autocast dtype
    under autocast). One kernel forward, one backward.

    The bf16 output under autocast gives the values autocast's casts would (forward identical); in backward
    the gate/up projections' bf16 grads are then summed in bf16, not fp32: measured on the CPU (512 x 896,
    relL2 vs float64) d_x 2.36e-3 -> 2.78e-3, d_weight 2.85e-3 -> 3.34e-3; in a 4-layer model all
    gradients 9.5e-3 / 1.07e-2 either way. Kept: inside the bf16 bounds, and it saves an fp32 write and a
    cast per consumer each way (tests/test_kernels_add_rmsnorm.py::test_bf16_normed_output_...)."""
    _common.check_device(x, delta, weight)
    assert delta.shape == x.shape, f"delta {tuple(delta.shape)} vs x {tuple(x.shape)}"
    assert weight.shape == (x.shape[-1],), f"weight {tuple(weight.shape)} vs row {x.shape[-1]}"
    return _AddRMSNormFunction.apply(x, delta, weight, eps, out_dtype)
