"""The engine's decode attention (kernels/decode_attention.py) against softmax over each slot's span in float64.

CI runs it in the Triton CPU interpreter; ENTRENAR_TEST_DEVICE=cuda runs the same tests on a GPU
(bench/gpu_checks.py). Outputs start poisoned (NaN), so a slot or head left unwritten fails.
"""

from __future__ import annotations

import math
import os

DEVICE = os.environ.get("ENTRENAR_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from entrenar.kernels import decode_attention as da
from entrenar.tensors import rel_l2

pytestmark = pytest.mark.usefixtures("poisoned_outputs")
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(q, k, v, start, end, scale):
    """float64 softmax(q k^T * scale) v over columns start[b] <= t < end[b], slot by slot."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        s, e = int(start[b]), int(end[b])
        kk, vv = k[b, :, s:e].double().cpu(), v[b, :, s:e].double().cpu()
        probs = (q[b].double().cpu() @ kk.transpose(-1, -2) * scale).softmax(-1)
        out[b] = probs @ vv
    return out


def slot_cache(slots: int, kv: int, length: int, d: int, dtype, gen):
    """A cache wider than the step reads ([slots + 2, kv, length + 40, d]), sliced as the engine slices it."""
    full = torch.randn(slots + 2, kv, length + 40, d, generator=gen).to(dtype).to(DEVICE)
    return full[:slots, :, :length]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (4, 4, 16), (14, 2, 64), (8, 1, 32)])
@pytest.mark.parametrize("chunk", [None, 64, 128])
def test_equals_softmax_over_each_slots_span(dtype, heads, kv, d, chunk):
    gen = torch.Generator().manual_seed(heads * 100 + d + (chunk or 0))
    B, T = 5, 300
    q = torch.randn(B, 1, heads, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)  # [B, H, 1, D] as the model's
    q = q.reshape(B, kv, heads // kv, d)
    k, v = slot_cache(B, kv, T, d, dtype, gen), slot_cache(B, kv, T, d, dtype, gen)
    # left padding of different widths, spans ending early, late, at one column, across chunk edges
    start = torch.tensor([0, 7, 63, 150, 299])
    end = torch.tensor([300, 70, 64, 257, 300])
    scale = 1 / math.sqrt(d)
    got = da.decode_attention(q, k, v, start.to(DEVICE), end.to(DEVICE), scale, chunk=chunk)
    want = reference(q, k, v, start, end, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert rel_l2(got.double().cpu(), want) < BOUND[dtype]
    for b in range(B):  # each slot on its own: a slot that read a neighbour's or a padding column fails here
        assert rel_l2(got[b].double().cpu(), want[b]) < BOUND[dtype], b


def test_columns_outside_the_span_are_never_read():
    """NaN in every column outside each slot's span (left padding, columns past its last token) leaves the
    output finite and unchanged."""
    gen = torch.Generator().manual_seed(3)
    B, kv, G, d, T = 3, 2, 3, 32, 200
    q = torch.randn(B, kv, G, d, generator=gen).to(DEVICE)
    k, v = torch.randn(B, kv, T, d, generator=gen).to(DEVICE), torch.randn(B, kv, T, d, generator=gen).to(DEVICE)
    start, end = torch.tensor([5, 0, 130]).to(DEVICE), torch.tensor([77, 200, 131]).to(DEVICE)
    clean = da.decode_attention(q, k, v, start, end, 0.2, chunk=64)
    for b in range(B):
        k[b, :, :start[b]] = float("nan")
        v[b, :, end[b]:] = float("nan")
        k[b, :, end[b]:] = float("nan")
    dirty = da.decode_attention(q, k, v, start, end, 0.2, chunk=64)
    assert torch.isfinite(dirty).all()
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("batch,kv,columns,want", [(512, 3, 1024, 1024), (8, 3, 1024, 128), (1, 2, 100, 64),
                                                  (200, 2, 1024, 1024), (40, 3, 1024, 384)])
def test_chunk_columns_splits_small_batches(batch, kv, columns, want):
    """Few slots: the columns split so ~MIN_PROGRAMS programs run; many: one chunk per slot."""
    got = da.chunk_columns(batch, kv, columns)
    assert got == want and got % da.BLOCK_N == 0
    assert batch * kv * math.ceil(columns / got) >= min(da.MIN_PROGRAMS, batch * kv * math.ceil(columns / 64)) / 2
