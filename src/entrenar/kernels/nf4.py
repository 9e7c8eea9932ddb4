"""NF4 (4-bit NormalFloat) storage of frozen weights for QLoRA, with double-quantized scales.

Format (the QLoRA paper; bitsandbytes / torchao layout):
- the weight is flattened row-major and cut into blocks of 64; each block keeps its absmax and every
  value becomes the index of the nearest of the 16 NF4 levels to ``value / absmax`` (ties go to the
  lower level). Two indices share a byte: the first element of a pair in the high nibble.
- double quantization: the per-block absmax scales (fp32) have their mean subtracted, are cut into
  groups of 256 and stored as int8 ``round(s * 128 / group_absmax)`` clamped to [-128, 127], with one
  fp32 factor ``128 / group_absmax`` per group and the fp32 mean. This is torchao's ``NF4Tensor``
  scheme (which torchtune QLoRA uses); bitsandbytes stores the same offset-and-8-bit scales with its
  8-bit dynamic code instead of linear int8 — same size, a slightly different scale rounding.
- dequantized value = NF4[code] * (q_scale / factor + mean).

Storage: 0.5 byte per weight + 1 byte per 64 weights + 4 bytes per 16384 weights + 4 bytes ~= 0.516 B.
Codes are computed from the exact fp32 absmax (as both peers do); only the stored scale is rounded.

``dequantize_reference`` is the torch path (any device); ``dequantize`` uses the Triton kernel on CUDA
(or on CPU under TRITON_INTERPRET=1) and the torch path elsewhere. The kernel works a block of 64 at a time:
each byte is read once for its two values and each block's scale is computed once: 1.23x the element-wise
kernel it replaced on the 7B MLP linears, 1.48x on q_proj (H200, in a CUDA graph). Its scales are divided
with IEEE rounding, as the torch path does, so both give the same values (a QLoRA adapter merged or evaluated
on the CPU sees exactly the weights it was trained on); Triton's default division would be 1.18x faster and
off by an ulp on ~1e-5 of the weights. Dequantizing inside the matmul instead was tried and measured slower at
every row count. bench/nf4_matmul_ab.py, bench/RESULTS.md ("QLoRA and NF4").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 64
SCALE_BLOCK_SIZE = 256

# The 16 NF4 levels of the QLoRA paper (Dettmers et al. 2023, appendix), as bitsandbytes ships them.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)


_TABLES: dict[torch.device, torch.Tensor] = {}


def nf4_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 levels (fp32) on ``device``; cached, so a CUDA forward does no host-to-device copy."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    return table


@dataclass
class NF4Weight:
    """A packed NF4 tensor. ``packed`` uint8 [ceil(n/64)*32]; ``qscale`` int8 [n_scale_groups*256]."""

    packed: torch.Tensor
    qscale: torch.Tensor
    factor: torch.Tensor  # fp32 [n_scale_groups]
    mean: torch.Tensor  # fp32 scalar
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.qscale, self.factor, self.mean))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "qscale": self.qscale, "factor": self.factor, "mean": self.mean}

    def to(self, device: torch.device | str) -> NF4Weight:
        return NF4Weight(self.packed.to(device), self.qscale.to(device), self.factor.to(device),
                         self.mean.to(device), self.shape)


def _codes(blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Index of the nearest NF4 level (lower one on a tie, like an argmin) of each value / absmax."""
    table = nf4_table(blocks.device)
    midpoints = (table[1:] + table[:-1]) / 2
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    scaled = blocks / safe[:, None]
    # bucketize(right=False): index i with mid[i-1] < v <= mid[i]; a value on a midpoint gets the lower level
    return torch.bucketize(scaled.contiguous(), midpoints, right=False).to(torch.uint8)


def double_quantize_scales(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 block scales -> (int8 [groups*256], fp32 factor [groups], fp32 mean)."""
    mean = absmax.mean()
    centred = absmax - mean
    pad = (-centred.numel()) % SCALE_BLOCK_SIZE
    if pad:
        centred = torch.cat([centred, centred.new_zeros(pad)])
    groups = centred.view(-1, SCALE_BLOCK_SIZE)
    group_absmax = groups.abs().amax(dim=1)
    # a group of equal scales (all == mean) has absmax 0: any factor reproduces it exactly
    factor = 128.0 / torch.where(group_absmax == 0, torch.ones_like(group_absmax), group_absmax)
    q = (groups * factor[:, None]).round().clamp(-128, 127).to(torch.int8)
    return q.reshape(-1), factor.float(), mean.float()


@torch.no_grad()
def quantize(weight: torch.Tensor) -> NF4Weight:
    """Quantize any float tensor to NF4 (blocks of 64, double-quantized scales)."""
    if not weight.is_floating_point():
        raise TypeError(f"NF4 quantizes float tensors, got {weight.dtype}")
    flat = weight.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % BLOCK_SIZE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1)
    codes = _codes(blocks, absmax).reshape(-1)
    packed = (codes[0::2] << 4) | codes[1::2]
    qscale, factor, mean = double_quantize_scales(absmax)
    return NF4Weight(packed.contiguous(), qscale, factor, mean, tuple(weight.shape))


def unpack_codes(w: NF4Weight) -> torch.Tensor:
    """uint8 codes [numel] (padding dropped)."""
    codes = torch.stack([w.packed >> 4, w.packed & 0xF], dim=1).reshape(-1)
    return codes[: w.numel]


def block_scales(w: NF4Weight) -> torch.Tensor:
    """Dequantized fp32 absmax per block of 64."""
    groups = w.qscale.view(-1, SCALE_BLOCK_SIZE).float() / w.factor[:, None]
    n_blocks = (w.numel + BLOCK_SIZE - 1) // BLOCK_SIZE
    return groups.reshape(-1)[:n_blocks] + w.mean


def dequantize_reference(w: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch dequantization (any device); fp32 arithmetic, cast to ``dtype`` at the end.

    Each packed byte is looked up whole in a 256-row table of its two levels (high nibble first) and each
    block of 64 values is multiplied by its scale: the same fp32 products as unpacking the codes one by one
    and gathering a scale per element, ~9x faster on the CPU (QLoRA training there dequantizes every NF4
    weight in every forward and backward). ``quantize`` pads to whole blocks, so the bytes fill the blocks."""
    table = nf4_table(w.packed.device)
    pairs = torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=1)  # byte -> (level hi, level lo)
    values = pairs.index_select(0, w.packed.int()).view(-1, BLOCK_SIZE)
    values.mul_(block_scales(w)[:, None])
    return values.view(-1)[: w.numel].to(dtype).view(w.shape)


# ---- Triton ---------------------------------------------------------------------------------
_triton_kernels: dict[bool, object] = {}


def _get_kernel(exact_division: bool = True):
    if exact_division in _triton_kernels:
        return _triton_kernels[exact_division]
    import triton
    import triton.language as tl

    @triton.jit
    def nf4_dequant_kernel(packed_ptr, qscale_ptr, factor_ptr, mean_ptr, table_ptr, out_ptr, n, n_blocks,
                           BLOCKS: tl.constexpr, QBLOCK: tl.constexpr, SBLOCK: tl.constexpr, EXACT: tl.constexpr):
        # BLOCKS whole blocks of 64 values a program: each byte is read once and gives its two values (high
        # nibble first), each block's scale is computed once, and the values are stored contiguously.
        blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        blk_ok = blk < n_blocks
        byte = tl.load(packed_ptr + blk[:, None] * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)[None, :],
                       mask=blk_ok[:, None], other=0).to(tl.int32)
        hi = tl.load(table_ptr + (byte >> 4))
        lo = tl.load(table_ptr + (byte & 0xF))
        q = tl.load(qscale_ptr + blk, mask=blk_ok, other=0).to(tl.float32)
        f = tl.load(factor_ptr + blk // SBLOCK, mask=blk_ok, other=1.0)
        if EXACT:  # IEEE division, as block_scales: equal values
            scale = tl.math.div_rn(q, f) + tl.load(mean_ptr)
        else:
            scale = q / f + tl.load(mean_ptr)
        values = tl.reshape(tl.join(hi, lo), (BLOCKS, QBLOCK)) * scale[:, None]
        offs = blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
        tl.store(out_ptr + offs, values.to(out_ptr.dtype.element_ty), mask=offs < n)

    _triton_kernels[exact_division] = nf4_dequant_kernel
    return nf4_dequant_kernel


def dequantize_triton(w: NF4Weight, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                      blocks: int = 32, exact_division: bool = True) -> torch.Tensor:
    """The Triton dequantization; ``blocks`` blocks of 64 values per program (2,048 values).
    ``exact_division=False`` (the A/B of bench/nf4_matmul_ab.py only) divides the scales with Triton's
    approximate fp32 division: 1.18x faster on an H200, an ulp off the torch path on ~1e-5 of the weights."""
    from ._common import check_device, empty

    check_device(w.packed, w.qscale, w.factor, w.mean)
    device = w.packed.device
    if out is None:
        out = empty((w.numel,), dtype, device)
    assert out.numel() == w.numel and out.is_contiguous() and out.dtype == dtype
    n_blocks = (w.numel + BLOCK_SIZE - 1) // BLOCK_SIZE
    kernel = _get_kernel(exact_division)
    grid = ((n_blocks + blocks - 1) // blocks,)
    kernel[grid](w.packed, w.qscale, w.factor, w.mean.reshape(1), nf4_table(device), out, w.numel, n_blocks,
                 BLOCKS=blocks, QBLOCK=BLOCK_SIZE, SBLOCK=SCALE_BLOCK_SIZE, EXACT=exact_division)
    return out.view(w.shape)


def dequantize(w: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere (the interpreter is for tests, too slow for training)."""
    if w.packed.is_cuda:
        return dequantize_triton(w, dtype)
    return dequantize_reference(w, dtype)


def max_abs_error_bound(weight: torch.Tensor, w: NF4Weight) -> torch.Tensor:
    """Per-element bound on |weight - dequant|: half the widest NF4 gap around the level times the
    exact absmax, plus the int8 rounding of that block's scale (half a step, or a full step where the
    clamp at +127 bites)."""
    table = nf4_table(weight.device)
    gaps = table[1:] - table[:-1]
    half_gap = torch.maximum(torch.cat([gaps[:1], gaps]), torch.cat([gaps, gaps[-1:]])) / 2
    flat = weight.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % BLOCK_SIZE
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1)
    codes = unpack_codes(w).long()
    idx = torch.arange(n, device=weight.device) // BLOCK_SIZE
    scale_step = (1.0 / w.factor).repeat_interleave(SCALE_BLOCK_SIZE)[: absmax.numel()]
    return half_gap[codes] * absmax[idx] + scale_step[idx] * table[codes].abs() * 1.0001 + 1e-7
