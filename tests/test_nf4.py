"""NF4 quantization: against torchao's independent NF4Tensor, error bounds, storage, Triton vs torch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from entrenar.kernels import nf4


def _torchao_nf4():
    pytest.importorskip("torchao")
    from torchao.quantization import NF4Tensor

    return NF4Tensor


@pytest.mark.parametrize("shape", [(64, 256), (896, 128)])
def test_nf4_matches_torchao(shape):
    """Same codes, same int8 scales, same dequantized values as torchao's NF4Tensor (block 64 / 256).

    torchao's NF4 table is the QLoRA table rounded to 4 decimals, ours is the full-precision table of
    the paper and bitsandbytes. So a value within 1e-4 of a midpoint between two levels may land on the
    other level; everywhere else codes are identical and dequantized values differ by at most the table
    rounding (5e-5) times the block scale.
    """
    NF4Tensor = _torchao_nf4()
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen) * 0.02
    ours = nf4.quantize(w)
    theirs = NF4Tensor.from_tensor(w, 64, 256)
    their_codes = torch.stack([theirs.quantized_data >> 4, theirs.quantized_data & 0xF], 1).reshape(-1)
    codes = nf4.unpack_codes(ours)
    assert torch.equal(theirs.quantized_scalers, ours.qscale)
    torch.testing.assert_close(theirs.quantization_factor.float(), ours.factor, rtol=0, atol=0)
    torch.testing.assert_close(theirs.scaler_mean.float(), ours.mean, rtol=0, atol=0)

    differ = codes != their_codes
    table = nf4.nf4_table()
    mids = (table[1:] + table[:-1]) / 2
    absmax = w.reshape(-1, 64).abs().amax(1).repeat_interleave(64)
    dist_to_mid = ((w.reshape(-1) / absmax)[:, None] - mids).abs().min(1).values
    assert differ.float().mean() < 1e-3
    assert bool((dist_to_mid[differ] < 1e-4).all()), "a code differs away from a level midpoint"
    assert bool(((codes.long() - their_codes.long()).abs()[differ] == 1).all())

    d_ours = nf4.dequantize_reference(ours).reshape(-1)
    d_theirs = theirs.get_original_weight().reshape(-1)
    scales = nf4.block_scales(ours).repeat_interleave(64)
    same = ~differ
    assert bool(((d_ours - d_theirs).abs()[same] <= 5.1e-5 * scales[same] + 1e-9).all())


def test_nf4_dequant_error_within_bound():
    """Random normal weights: every element within the NF4 rounding bound (half the local level gap x
    absmax, plus the scale's int8 step); mean |error| < 0.11 for N(0,1), the bound bitsandbytes' own
    4-bit tests use for NF4 with blocks of 64."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(576, 1536, generator=gen)
    q = nf4.quantize(w)
    d = nf4.dequantize_reference(q)
    err = (d - w).abs()
    assert bool((err.reshape(-1) <= nf4.max_abs_error_bound(w, q)).all())
    assert err.mean().item() < 0.11
    assert err.mean().item() > 0.01  # it is a 4-bit code: an error of ~0 means nothing was quantized
    rel = (d - w).norm() / w.norm()
    assert rel < 0.12


def test_nf4_storage_bytes_per_weight():
    w = torch.randn(896, 4864)
    q = nf4.quantize(w)
    assert q.nbytes() / w.numel() <= 0.53
    assert q.packed.dtype == torch.uint8 and q.packed.numel() == w.numel() // 2


def test_nf4_awkward_shapes_and_zero_blocks():
    """Sizes not a multiple of 64 or 64*256 (padding), a zero block, and a constant block."""
    w = torch.randn(7, 33)
    w[0, :] = 0.0
    q = nf4.quantize(w)
    d = nf4.dequantize_reference(q)
    assert d.shape == w.shape
    assert bool((d.reshape(-1) - w.reshape(-1)).abs().le(nf4.max_abs_error_bound(w, q)).all())
    c = torch.full((3, 64), 0.5)
    torch.testing.assert_close(nf4.dequantize_reference(nf4.quantize(c)), c, rtol=0, atol=1e-6)


def test_nf4_pair_order_high_nibble_first():
    """Element 0 of each pair sits in the high nibble (torchao / our Triton kernel agree on this)."""
    w = torch.zeros(64)
    w[0], w[1] = 1.0, -1.0
    q = nf4.quantize(w)
    assert int(q.packed[0]) == (15 << 4) | 0


@pytest.mark.triton
@pytest.mark.parametrize("shape,dtype", [((33, 70), torch.float32), ((128, 896), torch.float32),
                                         ((64, 576), torch.bfloat16)])
def test_nf4_triton_dequant_matches_torch(shape, dtype):
    w = torch.randn(shape) * 0.05
    q = nf4.quantize(w)
    ref = nf4.dequantize_reference(q, torch.float64 if dtype == torch.float32 else torch.float32)
    out = torch.full((w.numel(),), float("nan"), dtype=dtype)  # poisoned: every element must be written
    got = nf4.dequantize_triton(q, dtype, out=out)
    assert torch.isfinite(got).all()
    if dtype == torch.float32:  # the same fp32 operations as the torch path (IEEE division): equal values
        assert torch.equal(got, nf4.dequantize_reference(q, torch.float32))
    rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    # bf16: the interpreter truncates where the GPU rounds to nearest (exact on an H200: bench/nf4_matmul_ab.py)
    assert rel <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.triton
def test_nf4_triton_nibble_order_mutation_is_caught(monkeypatch):
    """Mutation: reading the low nibble first in the kernel scrambles pairs; the parity test sees it."""
    w = torch.randn(64, 64)
    q = nf4.quantize(w)
    swapped = nf4.NF4Weight(((q.packed << 4) | (q.packed >> 4)).to(torch.uint8), q.qscale, q.factor,
                            q.mean, q.shape)
    ref = nf4.dequantize_reference(q)
    got = nf4.dequantize_triton(swapped)
    assert ((got - ref).norm() / ref.norm()) > 0.1
