"""Triton kernels vs float64 torch references, forward and backward, plus the mutations they catch.

CI runs this in the Triton CPU interpreter (TRITON_INTERPRET=1, set below before triton is imported).
``bench/gpu_checks.py`` runs the same file on CUDA at full sizes: ENTRENAR_TEST_DEVICE=cuda,
ENTRENAR_TEST_FULL=1. Every kernel output buffer is poisoned with NaN before the kernel runs
(``_common.empty`` is replaced), so an element the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import math
import os

DEVICE = os.environ.get("ENTRENAR_TEST_DEVICE", "cpu")
FULL = os.environ.get("ENTRENAR_TEST_FULL", "0") == "1"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from entrenar.config import ModelConfig
from entrenar.kernels import _common, cross_entropy, rmsnorm, rope, swiglu
from entrenar.model import CausalLM
from entrenar.tensors import rel_l2, rounding_bound

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
SEQS = [1, 7, 31, 33, 257, 2049] if FULL else [1, 7, 31, 33, 257]
BATCH = 4 if FULL else 1




# every kernel output starts poisoned (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().requires_grad_(True)


# ---- RMSNorm -------------------------------------------------------------------------------
def rms_norm_errors(x: torch.Tensor, weight: torch.Tensor, eps: float) -> list[float]:
    """relL2 of y, dx, dw vs float64 (x may be a strided view; its padding must never be read)."""
    xl, wl = _leaf(x), _leaf(weight)
    xv = xl if x.is_contiguous() else x.detach().requires_grad_(True)
    y = rmsnorm.rms_norm(xv, wl, eps)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = _f64(x), _f64(weight)
    y64 = rmsnorm.rms_norm_reference(x64, w64, eps)
    y64.backward(dy.double())
    dx = xv.grad
    return [rel_l2(y, y64), rel_l2(dx, x64.grad), rel_l2(wl.grad, w64.grad)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 896])
@pytest.mark.parametrize("seq", SEQS)
def test_rms_norm_matches_float64(dtype, hidden, seq):
    x = torch.randn(BATCH, seq, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    errs = rms_norm_errors(x, w, 1e-6)
    assert max(errs) <= BOUND[dtype], errs


def test_rms_norm_head_dim_qk_norm_shape():
    x = torch.randn(BATCH, 33, 14, 64, device=DEVICE)  # qk-norm: rows are heads of 64
    w = 1 + 0.1 * torch.randn(64, device=DEVICE)
    assert max(rms_norm_errors(x, w, 1e-6)) <= 1e-5


def test_rms_norm_fp32_weight_bf16_input_promotes_like_reference():
    x = torch.randn(BATCH, 7, 896, device=DEVICE).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(896, device=DEVICE)
    y = rmsnorm.rms_norm(x, w, 1e-6)
    assert y.dtype == rmsnorm.rms_norm_reference(x, w, 1e-6).dtype == torch.float32
    assert max(rms_norm_errors(x, w, 1e-6)) <= 1e-2


def _small_magnitude_input(hidden=896, seq=31):
    # mean(x^2) ~ 1e-6, the size of eps: a wrong eps moves the output by tens of percent
    x = 1e-3 * torch.randn(BATCH, seq, hidden, device=DEVICE)
    w = 1 + 0.1 * torch.randn(hidden, device=DEVICE)
    return x, w


def test_rms_norm_uses_the_given_eps():
    x, w = _small_magnitude_input()
    assert max(rms_norm_errors(x, w, 1e-6)) <= 1e-5


def test_rms_norm_eps_mutation_is_caught(monkeypatch):
    """Mutation: a kernel with eps hard-coded to 1e-5 (the old CUDA bug) on an eps=1e-6 call."""
    real_apply = rmsnorm._RMSNormFunction.apply
    monkeypatch.setattr(rmsnorm._RMSNormFunction, "apply", lambda x, w, eps: real_apply(x, w, 1e-5))
    x, w = _small_magnitude_input()
    assert max(rms_norm_errors(x, w, 1e-6)) > 1e-2


def _padded_rows(hidden=576, seq=33):
    # rows of 576 inside rows of 1024 (the kernel's block): the padding holds large garbage
    buf = 1e3 * torch.randn(BATCH * seq, 1024, device=DEVICE)
    buf[:, :hidden] = torch.randn(BATCH * seq, hidden, device=DEVICE)
    return buf[:, :hidden], 1 + 0.1 * torch.randn(hidden, device=DEVICE)


def test_rms_norm_short_rows_never_read_past_row_end():
    x, w = _padded_rows()
    assert x.stride(0) == 1024
    assert max(rms_norm_errors(x, w, 1e-6)) <= 1e-5


def test_rms_norm_unmasked_row_mutation_is_caught(monkeypatch):
    """Mutation: the row-end mask dropped, so the sum of squares reads the next 448 elements."""
    monkeypatch.setattr(rmsnorm, "_MASK_ROW_END", False)
    x, w = _padded_rows()
    assert max(rms_norm_errors(x, w, 1e-6)) > 1e-2


# ---- RoPE ----------------------------------------------------------------------------------
def _trig(batch, seq, head_dim, theta=1e6):
    positions = torch.randint(0, 32768, (batch, seq), device=DEVICE, dtype=torch.float64)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=DEVICE, dtype=torch.float64) / head_dim)
    angles = positions[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def rope_errors(q, k, cos, sin, style, ref_style=None) -> list[float]:
    ql, kl = _leaf(q), _leaf(k)
    qo, ko = rope.rope(ql, kl, cos, sin, style)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo.float() * dq.float()).sum() + (ko.float() * dk.float()).sum()).backward()
    q64, k64 = _f64(q), _f64(k)
    qr, kr = rope.rope_reference(q64, k64, cos.double(), sin.double(), ref_style or style)
    ((qr * dq.double()).sum() + (kr * dk.double()).sum()).backward()
    return [rel_l2(qo, qr), rel_l2(ko, kr), rel_l2(ql.grad, q64.grad), rel_l2(kl.grad, k64.grad)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("seq", SEQS)
def test_rope_matches_float64(dtype, style, seq):
    q = torch.randn(BATCH, seq, 14, 64, device=DEVICE).to(dtype)  # Qwen2.5-0.5B heads
    k = torch.randn(BATCH, seq, 2, 64, device=DEVICE).to(dtype)
    cos, sin = _trig(BATCH, seq, 64)
    errs = rope_errors(q, k, cos, sin, style)
    assert max(errs) <= BOUND[dtype], errs


def test_rope_odd_head_counts_and_strided_input():
    # SmolLM2 heads (9 q, 3 kv), q and k as views of one fused projection output
    qkv = torch.randn(BATCH, 31, 15, 64, device=DEVICE)
    q, k = qkv[:, :, :9], qkv[:, :, 9:12]
    cos, sin = _trig(BATCH, 31, 64, theta=1e5)
    assert max(rope_errors(q, k, cos, sin, "neox")) <= 1e-5


def test_rope_style_swap_mutation_is_caught(monkeypatch):
    """Mutation: the kernel's pairing swapped (neox runs gptj pairs and back)."""
    monkeypatch.setattr(rope, "_STYLE_CODE", {"neox": 1, "gptj": 0})
    q = torch.randn(BATCH, 33, 14, 64, device=DEVICE)
    k = torch.randn(BATCH, 33, 2, 64, device=DEVICE)
    cos, sin = _trig(BATCH, 33, 64)
    for style in ("neox", "gptj"):
        assert max(rope_errors(q, k, cos, sin, style)) > 1e-2


def test_rope_rejects_unknown_style():
    q = torch.randn(1, 2, 2, 8, device=DEVICE)
    cos, sin = _trig(1, 2, 8)
    with pytest.raises(ValueError, match="rope style"):
        rope.rope(q, q, cos, sin, "half")


# ---- SwiGLU --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq,inter", [(1, 4864), (7, 4864), (31, 1536), (33, 3072), (257, 176)])
def test_swiglu_matches_float64(dtype, seq, inter):
    gate = (2 * torch.randn(BATCH, seq, inter, device=DEVICE)).to(dtype)
    up = torch.randn(BATCH, seq, inter, device=DEVICE).to(dtype)
    gl, ul = _leaf(gate), _leaf(up)
    y = swiglu.swiglu(gl, ul)
    dy = torch.randn_like(y)
    y.backward(dy)
    g64, u64 = _f64(gate), _f64(up)
    y64 = swiglu.swiglu_reference(g64, u64)
    y64.backward(dy.double())
    errs = [rel_l2(y, y64), rel_l2(gl.grad, g64.grad), rel_l2(ul.grad, u64.grad)]
    assert max(errs) <= BOUND[dtype], errs


# ---- fused linear cross-entropy ------------------------------------------------------------
def lce_errors(hidden, weight, labels, reduction="sum", grad_scale=1.7) -> list[float]:
    hl, wl = _leaf(hidden), _leaf(weight)
    loss = cross_entropy.linear_cross_entropy(hl, wl, labels, ignore_index=-100, reduction=reduction)
    (loss * grad_scale).backward()
    h64, w64 = _f64(hidden), _f64(weight)
    ref = cross_entropy.linear_cross_entropy_reference(h64, w64, labels, ignore_index=-100, reduction=reduction)
    (ref * grad_scale).backward()
    assert loss.dtype == torch.float32
    return [rel_l2(loss, ref), rel_l2(hl.grad, h64.grad), rel_l2(wl.grad, w64.grad)]


def _lce_inputs(n_tokens, hidden, vocab, dtype, n_ignored=0):
    h = torch.randn(n_tokens, hidden, device=DEVICE).to(dtype)
    w = (torch.randn(vocab, hidden, device=DEVICE) / math.sqrt(hidden) * 3).to(dtype)
    labels = torch.randint(0, vocab, (n_tokens,), device=DEVICE)
    labels[torch.randperm(n_tokens, device=DEVICE)[:n_ignored]] = -100
    return h, w, labels


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_cross_entropy_qwen_vocab(dtype, monkeypatch):
    """vocab 151936 (not a multiple of the 16K/32K vocab block), several chunks + a remainder."""
    n_tokens, hidden = (4096, 896) if FULL else (5, 64)
    h, w, labels = _lce_inputs(n_tokens, hidden, 151936, dtype, n_ignored=max(1, n_tokens // 5))
    monkeypatch.setattr(cross_entropy, "_CHUNK_BYTES", 151936 * 4 * (1000 if FULL else 2))
    errs = lce_errors(h, w, labels)
    # fp32: the log-sum-exp adds 151,936 terms per token, so fp32 rounding alone reaches ~1e-5 relL2
    # (1.0005e-5 on an AVX2 CPU): the bound is fp32's for that reduction length (tensors.rounding_bound)
    bound = rounding_bound(151936 + hidden) if dtype == torch.float32 else BOUND[dtype]
    assert max(errs) <= bound, (errs, bound)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("vocab", [1000, 4099])
def test_linear_cross_entropy_chunks_and_reductions(reduction, vocab, monkeypatch):
    monkeypatch.setattr(cross_entropy, "_CHUNK_BYTES", vocab * 4 * 7)  # 7-token chunks over 37 tokens
    h, w, labels = _lce_inputs(37, 96, vocab, torch.float32, n_ignored=9)
    errs = lce_errors(h, w, labels, reduction)
    assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_cross_entropy_all_ignored_is_zero_not_nan(reduction):
    h, w, labels = _lce_inputs(9, 64, 1000, torch.float32)
    labels[:] = -100
    hl, wl = _leaf(h), _leaf(w)
    loss = cross_entropy.linear_cross_entropy(hl, wl, labels, reduction=reduction)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hl.grad, torch.zeros_like(h)) and torch.equal(wl.grad, torch.zeros_like(w))


def test_linear_cross_entropy_ignored_rows_get_zero_grad():
    h, w, labels = _lce_inputs(16, 64, 1000, torch.float32)
    labels[3] = labels[11] = -100
    hl = _leaf(h)
    cross_entropy.linear_cross_entropy(hl, w, labels).backward()
    assert torch.equal(hl.grad[[3, 11]], torch.zeros(2, 64, device=DEVICE))
    assert hl.grad[[0, 5]].abs().min() > 0


def test_linear_cross_entropy_ignore_index_mutation_is_caught(monkeypatch):
    """Mutation: the kernel never sees ignore_index, so -100 rows count as real tokens."""
    real = cross_entropy._ce_rows
    monkeypatch.setattr(cross_entropy, "_ce_rows",
                        lambda logits, labels, loss_rows, ignore_index, write_grad:
                        real(logits, labels, loss_rows, -12345, write_grad))
    h, w, labels = _lce_inputs(37, 96, 1000, torch.float32, n_ignored=9)
    assert max(lce_errors(h, w, labels)) > 1e-2


def test_linear_cross_entropy_no_grad_matches_and_rejects_bad_labels():
    h, w, labels = _lce_inputs(11, 64, 1000, torch.float32, n_ignored=2)
    with torch.no_grad():
        loss = cross_entropy.linear_cross_entropy(h, w, labels)
    ref = cross_entropy.linear_cross_entropy_reference(h.double(), w.double(), labels)
    assert rel_l2(loss, ref) <= 1e-5
    if DEVICE == "cpu":
        labels[0] = 1000
        with pytest.raises(ValueError, match="outside vocab"):
            cross_entropy.linear_cross_entropy(h, w, labels)


# ---- model level ---------------------------------------------------------------------------
TINY = {
    "qwen2-tied": ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_layers=2,
                              num_heads=4, num_kv_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
                              attention_bias=True, tie_word_embeddings=True, architecture="qwen2"),
    "llama-gptj-qknorm": ModelConfig(vocab_size=777, hidden_size=96, intermediate_size=160, num_layers=2,
                                     num_heads=6, num_kv_heads=3, head_dim=16, rms_norm_eps=1e-5,
                                     rope_style="gptj", qk_norm=True, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", list(TINY))
def test_model_triton_matches_torch_kernels(name):
    cfg = TINY[name]
    ref = CausalLM(cfg, kernels="torch").to(DEVICE)
    ref.init_weights(seed=3)
    with torch.no_grad():  # non-trivial norm weights and biases
        for n, p in ref.named_parameters():
            if n.endswith(("norm.weight", ".bias")):
                p.add_(0.1 * torch.randn_like(p))
    fast = CausalLM(cfg, kernels="triton").to(DEVICE)
    fast.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 33), device=DEVICE)
    labels = torch.randint(0, cfg.vocab_size, (2, 33), device=DEVICE)
    labels[0, :9] = -100
    out = {}
    for key, model in (("ref", ref), ("fast", fast)):
        logits = model(ids)
        loss, n = model(ids, labels=labels)
        loss.backward()
        out[key] = (logits, loss, n, {k: p.grad for k, p in model.named_parameters()})
    assert rel_l2(out["fast"][0], out["ref"][0]) <= 1e-5
    assert abs(out["fast"][1].item() - out["ref"][1].item()) <= 1e-5 * abs(out["ref"][1].item())
    assert out["fast"][2].item() == out["ref"][2].item() == 2 * 33 - 9
    grads_fast, grads_ref = out["fast"][3], out["ref"][3]
    assert grads_fast.keys() == grads_ref.keys()
    worst = max((rel_l2(grads_fast[k], grads_ref[k]), k) for k in grads_ref)
    assert worst[0] <= 1e-5, worst


def test_model_triton_under_bf16_autocast_matches_torch_kernels():
    """fp32 weights + bf16 autocast (the default GPU precision): same bf16 rounding points as the reference."""
    cfg = TINY["qwen2-tied"]
    ref = CausalLM(cfg, kernels="torch").to(DEVICE)
    ref.init_weights(seed=4)
    fast = CausalLM(cfg, kernels="triton").to(DEVICE)
    fast.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 31), device=DEVICE)
    labels = torch.randint(0, cfg.vocab_size, (2, 31), device=DEVICE)
    out = []
    for model in (ref, fast):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss, _ = model(ids, labels=labels)
        loss.backward()
        out.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert abs(out[0][0] - out[1][0]) <= 1e-2 * abs(out[0][0])
    assert rel_l2(out[1][1], out[0][1]) <= 2e-2


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU refusal only")
def test_cpu_tensors_without_interpreter_are_refused_by_name(monkeypatch):
    monkeypatch.setattr(_common, "_INTERPRETER_AT_IMPORT", False)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rmsnorm.rms_norm(x, torch.ones(64), 1e-6)
