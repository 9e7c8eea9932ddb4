"""The residual add fused into RMSNorm: ``add_rms_norm(x, delta, w, eps) -> (rms_norm(x + delta) * w, x + delta)``.

Conventions of tests/test_kernels.py: the Triton CPU interpreter in CI (TRITON_INTERPRET=1, set below before
triton is imported), CUDA at full sizes from ``bench/gpu_checks.py`` (ENTRENAR_TEST_DEVICE=cuda,
ENTRENAR_TEST_FULL=1), a float64 oracle, relL2 bounds, and every kernel output poisoned with NaN.
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("ENTRENAR_TEST_DEVICE", "cpu")
FULL = os.environ.get("ENTRENAR_TEST_FULL", "0") == "1"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from entrenar.config import ModelConfig
from entrenar.kernels import get_ops, rmsnorm
from entrenar.model import CausalLM, KVCache
from entrenar.tensors import rel_l2

F32, BF16 = torch.float32, torch.bfloat16
ROWS = [1, 7, 33, 257, 4097] if FULL else [1, 7, 33, 257]
# (residual stream dtype, delta dtype): fp32 stream + bf16 matmul output is the CLI's --dtype bf16
# (autocast); bf16/bf16 is --dtype bf16-weights; fp32/fp32 the fp32 and float64-checked runs.
DTYPE_PAIRS = [(F32, F32), (F32, BF16), (BF16, BF16), (BF16, F32)]


# every kernel output starts poisoned (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def _inputs(rows: int, hidden: int, x_dtype: torch.dtype, d_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE, x_dtype)
    delta = (0.5 * torch.randn(rows, hidden, generator=gen)).to(DEVICE, d_dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, x_dtype)  # the norm weight: stream dtype
    return x, delta, w


def add_rms_norm_errors(x, delta, w, eps=1e-6, autocast=False, op=None) -> dict[str, float]:
    """relL2 vs float64 of normed, residual, d_x, d_delta, d_weight; both outputs feed the loss, as in a
    block (normed into the MLP, residual into the next residual add)."""
    op = op or rmsnorm.add_rms_norm
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, delta, w)]
    with torch.autocast(DEVICE, dtype=BF16, enabled=autocast):
        y, r = op(*leaves, eps)
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(y.shape, generator=gen).to(DEVICE, y.dtype)
    dr = torch.randn(r.shape, generator=gen).to(DEVICE, r.dtype)
    ((y.double() * dy.double()).sum() + (r.double() * dr.double()).sum()).backward()
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, delta, w)]
    y64, r64 = rmsnorm.add_rms_norm_reference(*ref_leaves, eps)
    ((y64 * dy.double()).sum() + (r64 * dr.double()).sum()).backward()
    got = {"normed": y, "residual": r, "d_x": leaves[0].grad, "d_delta": leaves[1].grad, "d_weight": leaves[2].grad}
    want = {"normed": y64, "residual": r64, "d_x": ref_leaves[0].grad, "d_delta": ref_leaves[1].grad,
            "d_weight": ref_leaves[2].grad}
    return {k: rel_l2(got[k], want[k]) if got[k] is not None else float("inf") for k in want}


def _bounds(x_dtype: torch.dtype, d_dtype: torch.dtype, autocast: bool) -> dict[str, float]:
    """1e-5 where every rounding is fp32 (an fp32 stream: x + bf16 delta is exact in fp32), 1e-2 for a
    tensor stored in bf16 or computed from a bf16 residual stream."""
    def b(bf16: bool) -> float:
        return 1e-2 if bf16 or x_dtype == BF16 else 1e-5

    return {"normed": b(autocast), "residual": b(False), "d_x": b(False), "d_delta": b(d_dtype == BF16),
            "d_weight": b(False)}


# ---- the op against float64 ------------------------------------------------------------------------------
@pytest.mark.parametrize("x_dtype,d_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("hidden", [896, 1000])
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_matches_float64(x_dtype, d_dtype, hidden, rows):
    x, delta, w = _inputs(rows, hidden, x_dtype, d_dtype)
    errs = add_rms_norm_errors(x, delta, w)
    bounds = _bounds(x_dtype, d_dtype, autocast=False)
    assert all(errs[k] <= bounds[k] for k in errs), (errs, bounds)


@pytest.mark.parametrize("x_dtype,d_dtype", [(F32, BF16), (F32, F32), (BF16, BF16)],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [7, 257])
def test_add_rms_norm_under_autocast_matches_float64(x_dtype, d_dtype, rows):
    """The CLI's default: fp32 stream, bf16 delta, autocast on; the normed output comes out in bf16."""
    x, delta, w = _inputs(rows, 896, x_dtype, d_dtype)
    errs = add_rms_norm_errors(x, delta, w, autocast=True)
    bounds = _bounds(x_dtype, d_dtype, autocast=True)
    assert all(errs[k] <= bounds[k] for k in errs), (errs, bounds)


def test_add_rms_norm_output_dtypes():
    x, delta, w = _inputs(7, 1000, F32, BF16)
    y, r = rmsnorm.add_rms_norm(x, delta, w, 1e-6)
    assert (y.dtype, r.dtype) == (F32, F32)  # the residual keeps the stream's dtype, not delta's
    with torch.autocast(DEVICE, dtype=BF16):
        y, r = rmsnorm.add_rms_norm(x, delta, w, 1e-6)
        y32, _ = rmsnorm.add_rms_norm(x, delta, w, 1e-6, out_dtype=F32)
    assert (y.dtype, r.dtype, y32.dtype) == (BF16, F32, F32)
    xb, db, wb = _inputs(7, 1000, BF16, F32)
    assert [t.dtype for t in rmsnorm.add_rms_norm(xb, db, wb, 1e-6)] == [BF16, BF16]


def test_add_rms_norm_3d_and_strided_rows_never_read_past_row_end():
    """[B, T, C] inputs; x a view whose rows sit in wider rows of large garbage (1000 inside 1024)."""
    buf = 1e3 * torch.randn(2 * 33, 1024, device=DEVICE)
    buf[:, :1000] = torch.randn(2 * 33, 1000, device=DEVICE)
    x = buf[:, :1000].view(2, 33, 1000)
    assert x.stride(1) == 1024
    delta = torch.randn(2, 33, 1000, device=DEVICE)
    w = 1 + 0.1 * torch.randn(1000, device=DEVICE)
    errs = add_rms_norm_errors(x, delta, w)
    assert max(errs.values()) <= 1e-5, errs


def test_add_rms_norm_uses_the_given_eps():
    # mean((x + delta)^2) ~ 1e-6, the size of eps: eps 1e-5 instead of 1e-6 moves the output by tens of percent
    x, delta, w = _inputs(31, 896, F32, F32)
    assert max(add_rms_norm_errors(1e-3 * x, 1e-3 * delta, w, eps=1e-6).values()) <= 1e-5
    assert add_rms_norm_errors(1e-3 * x, 1e-3 * delta, w, eps=1e-6,
                               op=lambda a, b, c, eps: rmsnorm.add_rms_norm(a, b, c, 1e-5))["normed"] > 1e-2


def test_add_rms_norm_no_rows():
    x, delta, w = (t.requires_grad_(True) for t in _inputs(0, 896, F32, F32))
    y, r = rmsnorm.add_rms_norm(x, delta, w, 1e-6)
    (y.sum() + r.sum()).backward()
    assert y.shape == r.shape == (0, 896) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("used", ["normed", "residual"])
def test_add_rms_norm_one_output_unused(used):
    """Autograd passes None for an output that gets no gradient (no zero tensor is built for it)."""
    x, delta, w = _inputs(33, 1000, F32, BF16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, delta, w)]
    ref = [t.detach().double().requires_grad_(True) for t in (x, delta, w)]
    pick = 0 if used == "normed" else 1
    rmsnorm.add_rms_norm(*leaves, 1e-6)[pick].double().pow(2).sum().backward()
    rmsnorm.add_rms_norm_reference(*ref, 1e-6)[pick].pow(2).sum().backward()
    assert rel_l2(leaves[0].grad, ref[0].grad) <= 1e-5 and rel_l2(leaves[1].grad, ref[1].grad) <= 1e-2
    assert rel_l2(leaves[2].grad, ref[2].grad) <= 1e-5 if used == "normed" else not leaves[2].grad.any()


def test_add_rms_norm_same_dtype_grads_never_share_storage():
    """d_x and d_delta are one tensor when the dtypes agree (as torch's add backward): two leaves' .grad
    must still accumulate independently over two backwards (gradient accumulation)."""
    x, delta, w = _inputs(33, 896, F32, F32)
    leaves = [t.requires_grad_(True) for t in (x, delta)]
    for _ in range(2):
        y, r = rmsnorm.add_rms_norm(*leaves, w, 1e-6)
        (y.sum() + r.sum()).backward()
    x1, d1, w1 = (t.detach().clone().requires_grad_(True) for t in (x, delta, w))
    y, r = rmsnorm.add_rms_norm(x1, d1, w1, 1e-6)
    (y.sum() + r.sum()).backward()
    assert torch.allclose(leaves[0].grad, 2 * x1.grad, rtol=1e-6, atol=0)
    assert torch.allclose(leaves[1].grad, 2 * d1.grad, rtol=1e-6, atol=0)


# ---- the mutations the float64 comparison catches ---------------------------------------------------------
def test_add_rms_norm_dropped_residual_gradient_is_caught(monkeypatch):
    """Mutation: the backward forgets the residual stream's incoming gradient (d_x = norm backward only)."""
    real = rmsnorm._AddRMSNormFunction.backward
    monkeypatch.setattr(rmsnorm._AddRMSNormFunction, "backward",
                        staticmethod(lambda ctx, dy, d_residual: real(ctx, dy, None)))
    x, delta, w = _inputs(33, 896, F32, BF16)
    errs = add_rms_norm_errors(x, delta, w)
    assert errs["d_x"] > 0.1 and errs["d_delta"] > 0.1, errs


def test_add_rms_norm_dropped_delta_is_caught(monkeypatch):
    """Mutation: the kernel normalises x instead of x + delta (the sublayer's output lost)."""
    real = rmsnorm._AddRMSNormFunction.apply
    monkeypatch.setattr(rmsnorm._AddRMSNormFunction, "apply",
                        lambda x, delta, w, eps, out_dtype: real(x, torch.zeros_like(delta), w, eps, out_dtype))
    x, delta, w = _inputs(33, 896, F32, F32)
    errs = add_rms_norm_errors(x, delta, w)
    assert errs["normed"] > 0.1 and errs["residual"] > 0.1, errs


# ---- the bf16 normed output under autocast: the decision, measured --------------------------------------
def _through_gate_and_up(op, out_dtype, dtype: torch.dtype, autocast: bool):
    """A post-attention norm's use in the block: normed into two projections (gate_proj, up_proj; matmuls
    in bf16 under autocast), residual on to the MLP's residual add. Returns normed and the grads."""
    gen = torch.Generator().manual_seed(2)
    n, c = 512, 896
    x, delta = torch.randn(n, c, generator=gen), torch.randn(n, c, generator=gen).to(BF16)
    w = 1 + 0.1 * torch.randn(c, generator=gen)
    projections = [torch.randn(2 * c, c, generator=gen) / c ** 0.5 for _ in range(2)]
    d_outs = [torch.randn(n, 2 * c, generator=gen).to(DEVICE) for _ in range(2)]
    d_residual = torch.randn(n, c, generator=gen).to(DEVICE)
    leaves = [t.to(DEVICE, dtype if t.dtype == F32 or dtype == torch.float64 else t.dtype, copy=True)
              .requires_grad_(True) for t in (x, delta, w, *projections)]
    with torch.autocast(DEVICE, dtype=BF16, enabled=autocast):
        y, r = op(*leaves[:3], 1e-6, out_dtype)
        outs = [F.linear(y, p) for p in leaves[3:]]
    loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, d_outs)) + (r.double() * d_residual.double()).sum()
    loss.backward()
    return y, dict(zip(["d_x", "d_delta", "d_weight", "d_gate", "d_up"], (t.grad for t in leaves)))


def test_bf16_normed_output_under_autocast_same_forward_gradients_within_bf16_noise():
    """Under autocast the fused op emits the normed tensor in bf16 (as rms_norm does) instead of fp32 that
    autocast then casts once per consumer. Forward: the same values. Backward: the consumers' bf16 grads
    are summed in bf16 instead of fp32. Measured here (512 x 896, gate + up, relL2 vs float64): d_x
    2.36e-3 -> 2.78e-3, d_delta 2.88e-3 -> 3.24e-3, d_weight 2.85e-3 -> 3.34e-3 (~1.2x, all inside the
    bf16 bound 1e-2; the projections' own grads are identical). Decision: keep bf16."""
    ref = rmsnorm.add_rms_norm_reference  # torch's round-to-nearest casts: what the GPU kernel's store does
    _, g64 = _through_gate_and_up(ref, None, torch.float64, autocast=False)
    y32, g32 = _through_gate_and_up(ref, None, F32, autocast=True)
    y16, g16 = _through_gate_and_up(ref, BF16, F32, autocast=True)
    assert y32.dtype == F32 and y16.dtype == BF16 and torch.equal(y32.to(BF16), y16)
    assert torch.equal(g16["d_gate"], g32["d_gate"]) and torch.equal(g16["d_up"], g32["d_up"])
    for k in ("d_x", "d_delta", "d_weight"):
        e32, e16 = rel_l2(g32[k], g64[k]), rel_l2(g16[k], g64[k])
        assert e16 <= 1e-2 and e16 <= 1.5 * e32, (k, e32, e16)
    # and the kernel itself, default output dtype under autocast
    yt, gt = _through_gate_and_up(lambda *a: rmsnorm.add_rms_norm(*a[:4]), None, F32, autocast=True)
    assert yt.dtype == BF16 and rel_l2(yt, y16) <= 1e-2
    assert all(rel_l2(gt[k], g64[k]) <= 1e-2 for k in g64), {k: rel_l2(gt[k], g64[k]) for k in g64}


# ---- in the model ------------------------------------------------------------------------------------------
TINY = ModelConfig(vocab_size=1000, hidden_size=96, intermediate_size=160, num_layers=2, num_heads=6,
                   num_kv_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, attention_bias=True,
                   tie_word_embeddings=True, architecture="qwen2")


def _tiny(kernels: str, seed: int = 3) -> CausalLM:
    model = CausalLM(TINY, kernels=kernels)
    model.init_weights(seed=seed)
    with torch.no_grad():  # norm weights away from 1, so a norm applied to the wrong tensor shows
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", ".bias")):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return model.to(DEVICE)


def _loss_and_grads(model: CausalLM, ids, labels):
    model.zero_grad()
    loss, _ = model(ids, labels=labels)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_fused_block_equals_the_two_op_block(monkeypatch):
    """Block.forward with the add fused into post_attention_layernorm gives exactly what `x = x + attn;
    x + mlp(norm(x))` gives (torch ops), once per layer; logits, loss and every gradient."""
    from entrenar import model as model_mod

    model = _tiny("torch")
    ids = torch.randint(0, TINY.vocab_size, (2, 17), device=DEVICE)
    labels = torch.randint(0, TINY.vocab_size, (2, 17), device=DEVICE)
    calls = []
    ops = get_ops("torch")
    counting = type(ops)(**{**ops.__dict__, "add_rms_norm": lambda *a: calls.append(1) or ops.add_rms_norm(*a)})
    monkeypatch.setattr(model_mod, "get_ops", lambda kind: counting)
    fused = (model(ids), *_loss_and_grads(model, ids, labels))
    assert len(calls) == 2 * TINY.num_layers  # two forwards

    def two_op_block(self, x, cos, sin, mask, ops, cache=None):
        x = x + self.self_attn(self.input_layernorm(x, ops), cos, sin, mask, ops, cache)
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)

    monkeypatch.setattr(model_mod.Block, "forward", two_op_block)
    unfused = (model(ids), *_loss_and_grads(model, ids, labels))

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        # bitwise on the CPU; CUDA's attention backward accumulates with atomics (not bitwise reproducible)
        return torch.equal(a, b) if DEVICE == "cpu" else rel_l2(a, b) <= 1e-6

    assert same(fused[0], unfused[0]) and same(fused[1], unfused[1])
    assert all(same(fused[2][k], unfused[2][k]) for k in unfused[2])


def test_triton_model_with_checkpointing_and_kv_cache_matches():
    """The fused block under per-block activation checkpointing (recomputed in backward) gives the
    gradients without it, and KV-cache decoding gives the full forward's logits."""
    model = _tiny("triton").train()
    ids = torch.randint(0, TINY.vocab_size, (2, 21), device=DEVICE)
    labels = torch.randint(0, TINY.vocab_size, (2, 21), device=DEVICE)
    loss, grads = _loss_and_grads(model, ids, labels)
    model.activation_checkpointing = True
    loss_ckpt, grads_ckpt = _loss_and_grads(model, ids, labels)
    assert torch.equal(loss, loss_ckpt)
    assert max(rel_l2(grads_ckpt[k], grads[k]) for k in grads) <= 1e-6
    model.eval()
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :15], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(15, 21)]
    assert rel_l2(torch.cat(steps, dim=1), full) <= 1e-5
