"""LoRA / QLoRA wrappers: step-0 identity, trainable set, PEFT interop both ways, bad inputs, auto_lr."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from entrenar import peft as ep
from entrenar.config import ModelConfig
from entrenar.errors import InputError
from entrenar.kernels import nf4
from entrenar.model import CausalLM
from entrenar.peft import io as peft_io
from entrenar.peft import nf4_linear
from tests.helpers.models import tiny_causal_lm, tiny_config


def tiny_cfg(qwen: bool = True, **kw) -> ModelConfig:
    return tiny_config("qwen2" if qwen else "llama", **{"intermediate_size": 96, **kw})


def tiny_model(qwen: bool = True, seed: int = 0, **kw) -> CausalLM:
    """Nonzero Q/K/V biases (qwen), so dropping them shows."""
    return tiny_causal_lm(tiny_cfg(qwen, **kw), seed, bias_std=0.5).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randomize_adapters(model: nn.Module, seed: int = 3, std: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in ep.lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * std)


IDS = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(7))


# ---- step-0 identity -----------------------------------------------------------------------
def test_lora_step0_identity_exact():
    m = tiny_model()
    with torch.no_grad():
        base = m(IDS)
    ep.apply_lora(m, rank=8, alpha=16, dropout=0.1)
    m.eval()
    with torch.no_grad():
        assert torch.equal(m(IDS), base)
    assert len(ep.lora_modules(m)) == 2 * 7
    a = next(iter(ep.lora_modules(m).values())).lora_A.weight
    assert a.abs().sum() > 0 and a.abs().max() <= 1 / 64 ** 0.5 + 1e-6  # kaiming_uniform(a=sqrt(5)) bound


def _nf4_reference(model: CausalLM) -> CausalLM:
    """The base with every decoder-layer linear weight replaced by its NF4 round trip (biases kept)."""
    ref = tiny_model()
    ref.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for path, mod in ref.named_modules():
            if isinstance(mod, nn.Linear) and ".layers." in f".{path}":
                mod.weight.copy_(nf4.dequantize_reference(nf4.quantize(mod.weight)))
    return ref.eval()


def _qlora_identity_error() -> tuple[float, float]:
    m = tiny_model()
    ref = _nf4_reference(m)
    with torch.no_grad():
        base = m(IDS)
        expected = ref(IDS)
    ep.apply_lora(m, rank=4, alpha=8, quantize_nf4=True)
    m.eval()
    with torch.no_grad():
        got = m(IDS)
    return rel(got, expected), rel(got, base)


def test_qlora_step0_equals_nf4_dequantized_base():
    to_nf4_ref, to_fp_base = _qlora_identity_error()
    assert to_nf4_ref <= 1e-6
    assert to_fp_base > 1e-3  # the base really is quantized


def test_qlora_dropped_bias_is_caught(monkeypatch):
    """Mutation: NF4Linear forgets the Q/K/V bias (a QLoRA path that dropped Qwen's Q/K/V biases
    computed another model from step 0)."""
    def no_bias(self, x):
        return nf4_linear._NF4LinearFn.apply(x, self.nf4_weight, None)

    monkeypatch.setattr(ep.NF4Linear, "forward", no_bias)
    to_nf4_ref, _ = _qlora_identity_error()
    assert to_nf4_ref > 1e-3


def test_qlora_quantizes_all_decoder_linears_and_keeps_head():
    m = tiny_model(qwen=False, tie_word_embeddings=False)
    ep.apply_lora(m, rank=4, alpha=8, targets="q_proj,v_proj", quantize_nf4=True)
    nf4_mods = [p for p, x in m.named_modules() if isinstance(x, ep.NF4Linear)]
    assert len(nf4_mods) == 2 * 7
    assert isinstance(m.lm_head, nn.Linear) and not isinstance(m.lm_head, ep.LoRALinear)
    assert all(isinstance(x.base_layer, ep.NF4Linear) for x in ep.lora_modules(m).values())


def test_only_adapters_trainable_and_grads_reach_them():
    m = tiny_model()
    ep.apply_lora(m, rank=4, alpha=8, targets=["q_proj", "down_proj"], quantize_nf4=True)
    m.train()
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    counts = ep.count_parameters(m)
    assert counts["trainable"] == 2 * (4 * 64 + 64 * 4 + 4 * 96 + 64 * 4)
    assert counts["total"] == m.cfg.num_parameters() + counts["trainable"]
    labels = torch.roll(IDS, -1, 1)
    loss, n = m(IDS, labels=labels)
    (loss / n).backward()
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    b_grads = [x.lora_B.weight.grad.abs().sum() for x in ep.lora_modules(m).values()]
    assert all(g > 0 for g in b_grads)
    assert "trainable params" in ep.describe_parameters(m)


def test_nf4_linear_input_grad_matches_dense():
    """NF4Linear's custom backward (re-dequantize) gives the dense grad of x @ W_deq^T + b."""
    lin = nn.Linear(70, 33)
    q = ep.NF4Linear(lin)
    x = torch.randn(5, 70, requires_grad=True)
    y = q(x)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    w = nf4.dequantize_reference(nf4.quantize(lin.weight))
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.nn.functional.linear(x2, w, lin.bias.detach())
    (gx2,) = torch.autograd.grad(y2, x2, g)
    torch.testing.assert_close(y, y2, rtol=0, atol=1e-6)
    torch.testing.assert_close(gx, gx2, rtol=0, atol=1e-6)


def test_scaling_standard_and_rslora():
    m = tiny_model()
    ep.apply_lora(m, rank=16, alpha=32, rslora=True)
    x = next(iter(ep.lora_modules(m).values()))
    assert x.scaling == pytest.approx(32 / 4)
    m2 = tiny_model()
    ep.apply_lora(m2, rank=16, alpha=32)
    assert next(iter(ep.lora_modules(m2).values())).scaling == pytest.approx(2.0)


# ---- PEFT interop --------------------------------------------------------------------------
def _hf_model(m: CausalLM):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**m.cfg.to_hf_dict())
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    sd = {k: v for k, v in m.state_dict().items()}
    result = hf.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}
    if "lm_head.weight" in result.missing_keys:
        hf.tie_weights()
    return hf.float().eval()


def _peft_vs_ours(tmp_path, qwen: bool, rslora: bool) -> tuple[float, float]:
    """(relL2 of peft.PeftModel on our saved adapter vs our base+adapter logits, ours vs base)."""
    peft = pytest.importorskip("peft")
    m = tiny_model(qwen)
    hf = _hf_model(m)
    ep.apply_lora(m, rank=4, alpha=8, rslora=rslora,
                  targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    randomize_adapters(m)
    m.eval()
    with torch.no_grad():
        ours = m(IDS)
    ep.save_adapter(m, tmp_path, "tiny-base")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["use_rslora"] is rslora and cfg["bias"] == "none"
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    with torch.no_grad():
        theirs = pm(IDS).logits
    base = tiny_model(qwen)
    with torch.no_grad():
        return rel(theirs, ours), rel(base(IDS), ours)


@pytest.mark.parametrize("qwen,rslora", [(True, False), (False, True)])
def test_peft_loads_our_adapter(tmp_path, qwen, rslora):
    peft_vs_ours, ours_vs_base = _peft_vs_ours(tmp_path, qwen, rslora)
    assert peft_vs_ours <= 1e-5
    assert ours_vs_base > 1e-3  # the adapter is not a no-op


def test_peft_key_prefix_mutation_is_caught(tmp_path, monkeypatch):
    """Mutation: keys saved without PEFT's 'base_model.model.' prefix -> peft loads no adapter weights."""
    monkeypatch.setattr(peft_io, "PEFT_PREFIX", "")
    with pytest.warns(UserWarning):
        peft_vs_ours, _ = _peft_vs_ours(tmp_path, True, False)
    assert peft_vs_ours > 1e-3


def test_rslora_scale_mutation_is_caught(tmp_path, monkeypatch):
    """Mutation: --rslora ignored (alpha/r instead of alpha/sqrt(r)) -> peft's logits disagree with ours."""
    real_init = ep.LoRALinear.__init__

    def init(self, base_layer, rank, alpha, dropout=0.0, rslora=False, **kw):
        real_init(self, base_layer, rank, alpha, dropout, rslora, **kw)
        self.scaling = alpha / rank

    monkeypatch.setattr(ep.LoRALinear, "__init__", init)
    peft_vs_ours, _ = _peft_vs_ours(tmp_path, False, True)
    assert peft_vs_ours > 1e-3


def test_nonzero_b_init_mutation_is_caught(monkeypatch):
    """Mutation: B initialised like A (not zeros) -> the step-0 identity test sees the change."""
    real_init = ep.LoRALinear.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        nn.init.kaiming_uniform_(self.lora_B.weight, a=5 ** 0.5)

    monkeypatch.setattr(ep.LoRALinear, "__init__", init)
    m = tiny_model()
    with torch.no_grad():
        base = m(IDS)
    ep.apply_lora(m, rank=8, alpha=16)
    m.eval()
    with torch.no_grad():
        assert not torch.equal(m(IDS), base)


def test_we_load_adapter_peft_wrote(tmp_path):
    peft = pytest.importorskip("peft")
    m = tiny_model()
    hf = _hf_model(m)
    lcfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                           lora_dropout=0.0, task_type="CAUSAL_LM")
    pm = peft.get_peft_model(hf, lcfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    pm.save_pretrained(str(tmp_path))
    pm.eval()
    with torch.no_grad():
        theirs = pm(IDS).logits
    ep.load_adapter(m, tmp_path)
    m.eval()
    with torch.no_grad():
        ours = m(IDS)
    assert rel(ours, theirs) <= 1e-5
    assert len(ep.lora_modules(m)) == 2 * 3


def test_adapter_note_records_nf4_and_reload_follows_it(tmp_path):
    m = tiny_model()
    ep.apply_lora(m, rank=4, alpha=8, quantize_nf4=True)
    randomize_adapters(m)
    m.eval()
    with torch.no_grad():
        ours = m(IDS)
    ep.save_adapter(m, tmp_path, "base-x")
    note = json.loads((tmp_path / "entrenar_adapter.json").read_text())
    assert note["trained_against"] == "nf4" and note["base_model"] == "base-x"
    m2 = ep.load_adapter(tiny_model(), tmp_path)
    m2.eval()
    assert any(isinstance(x, ep.NF4Linear) for x in m2.modules())
    with torch.no_grad():
        assert torch.equal(m2(IDS), ours)


# ---- bad input ------------------------------------------------------------------------------
def test_unknown_target_lists_linear_layers():
    m = tiny_model()
    with pytest.raises(InputError) as e:
        ep.apply_lora(m, rank=4, alpha=8, targets="q_proj,qkv_proj")
    msg = str(e.value)
    assert "qkv_proj" in msg
    for name in ep.DEFAULT_TARGETS:
        assert name in msg


def test_adapter_for_other_base_names_tensor(tmp_path):
    other = tiny_model(hidden_size=32, intermediate_size=48)
    ep.apply_lora(other, rank=4, alpha=8)
    ep.save_adapter(other, tmp_path, "other")
    with pytest.raises(InputError) as e:
        ep.load_adapter(tiny_model(), tmp_path)
    assert re.search(r"tensor base_model\.model\.model\.layers\.\d+\.\w+\.\w+_proj\.lora_[AB]\.weight has "
                     r"shape \[\d+, \d+\], this model needs \[\d+, \d+\]", str(e.value)), str(e.value)


@pytest.mark.parametrize("kw", [{"rank": 0, "alpha": 8}, {"rank": 4, "alpha": -1}, {"rank": 4, "alpha": 8, "dropout": 1.0}])
def test_bad_lora_hyperparameters(kw):
    with pytest.raises(InputError):
        ep.apply_lora(tiny_model(), **kw)


def test_not_an_adapter_dir(tmp_path):
    with pytest.raises(InputError, match="adapter_config.json"):
        ep.load_adapter(tiny_model(), tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(InputError, match="only LORA"):
        ep.load_adapter(tiny_model(), tmp_path)


# ---- auto lr --------------------------------------------------------------------------------
def test_auto_lr_rule():
    assert ep.auto_lr("full", None, False)[0] == 2e-5
    table = {r: ep.auto_lr("lora", r, False)[0] for r in (8, 64, 256)}
    assert table[8] == pytest.approx(2e-4)
    assert table[64] == pytest.approx(1e-4)
    assert table[256] == pytest.approx(5e-5)
    assert ep.auto_lr("qlora", 256, False) [0] == table[256]
    # rslora with a fixed alpha: rank-independent (rsLoRA's claim)
    fixed = {r: ep.auto_lr("lora", r, True, alpha=16)[0] for r in (8, 64, 256)}
    assert len({round(v, 12) for v in fixed.values()}) == 1
    _lr, reason = ep.auto_lr("lora", 256, False)
    assert "r=256" in reason and "5e-05" in reason
    with pytest.raises(InputError):
        ep.auto_lr("lora", 0, False)


def test_lm_head_is_not_a_target():
    m = tiny_model(qwen=False, tie_word_embeddings=False)
    with pytest.raises(InputError, match="lm_head"):
        ep.apply_lora(m, rank=4, alpha=8, targets="lm_head")


@pytest.mark.parametrize("alpha", [0, 0.0, -16, float("nan"), float("inf")])
def test_auto_lr_rejects_bad_alpha_naming_it(alpha):
    """--alpha 0 with --lr auto was a ZeroDivisionError traceback (issue 18); now exit 2 naming --alpha."""
    with pytest.raises(InputError, match="--alpha"):
        ep.auto_lr("lora", 8, False, alpha=alpha)
    with pytest.raises(InputError, match="--alpha"):
        ep.auto_lr("qlora", 8, True, alpha=alpha)


# ---- the adapter's update in the base output's GEMM epilogue (LoRALinear.forward) ------------------------
def _lora_layer(base_dtype=torch.float32, seed: int = 0) -> ep.LoRALinear:
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(24, 40, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.randn(40, 24, generator=g) * 0.1)
        base.bias.copy_(torch.randn(40, generator=g))
    layer = ep.LoRALinear(base.to(base_dtype), rank=4, alpha=8.0, generator=g)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(40, 4, generator=g) * 0.3)
    return layer


def _unfused(layer: ep.LoRALinear, x: torch.Tensor) -> torch.Tensor:
    """The formula written out in float64: base(x) + scaling * B(A(x))."""
    w, b = layer.base_layer.weight.double(), layer.base_layer.bias.double()
    a, bw = layer.lora_A.weight.double(), layer.lora_B.weight.double()
    xd = x.double()
    return xd @ w.t() + b + layer.scaling * (xd @ a.t()) @ bw.t()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_lora_forward_and_grads_match_the_formula(autocast):
    layer = _lora_layer()
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    ref = _unfused(layer, x.detach())
    assert y.shape == (3, 5, 40) and y.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert rel(y.double(), ref) <= (1e-2 if autocast else 1e-6)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    y.backward(g.to(y.dtype))
    xd = x.detach().double().requires_grad_(True)
    a = layer.lora_A.weight.detach().double().requires_grad_(True)
    bw = layer.lora_B.weight.detach().double().requires_grad_(True)
    w, b = layer.base_layer.weight.double(), layer.base_layer.bias.double()
    (xd @ w.t() + b + layer.scaling * (xd @ a.t()) @ bw.t()).backward(g.double())
    tol = 2e-2 if autocast else 1e-6
    assert rel(layer.lora_A.weight.grad.double(), a.grad) <= tol
    assert rel(layer.lora_B.weight.grad.double(), bw.grad) <= tol
    assert rel(x.grad.double(), xd.grad) <= tol


def test_lora_update_makes_no_extra_pass_over_the_output():
    """The scale and the add ride in one addmm: no elementwise op in the forward or the backward touches a
    tensor of the output's size (for a 7B gate/up projection, 18,944 x tokens) besides the matmuls."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("mul", "add", "mul_", "add_", "_to_copy") and isinstance(out, torch.Tensor) \
                    and out.numel() >= 3 * 5 * 40:
                self.big.append(name)
            return out

    layer = _lora_layer()
    layer.base_layer.requires_grad_(False)
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1))
    for autocast in (False, True):
        with Ops() as ops, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
            y.float().sum().backward()
        # autocast casts x once for the base matmul (a copy of the input's size, not the output's)
        assert [n for n in ops.big if n != "_to_copy"] == [], (autocast, ops.big)


def test_dequantize_once_gives_the_same_logits_and_only_without_grad():
    """Inference of a QLoRA model on the CPU keeps the dequantized weights (20x faster decoding): the logits
    must be bit-identical to dequantizing per matmul, and a forward with gradients on must not keep them."""
    m = tiny_model(qwen=True)
    ep.apply_lora(m, rank=4, alpha=8, quantize_nf4=True)
    randomize_adapters(m)
    ids = torch.randint(0, tiny_cfg().vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids)
    assert nf4_linear.enable_dequantize_once(m, budget_bytes=1 << 40) > 0
    m(ids).float().sum().backward()  # training-style forward: nothing kept
    layers = [x for x in m.modules() if isinstance(x, ep.NF4Linear)]
    assert layers and all(x._dequantized is None for x in layers)
    with torch.no_grad():
        assert torch.equal(m(ids), ref)
        assert torch.equal(m(ids), ref)  # the kept weights, second use
    assert all(x._dequantized is not None for x in layers)


def test_dequantized_for_inference_keeps_weights_inside_the_block_only():
    """GUARD-QA's decoding inside a QLoRA run on the CPU: the NF4 weights are dequantized once within the block
    (the same logits), and dropped after it, so training goes on without the fp32 copies."""
    m = tiny_model(qwen=True)
    ep.apply_lora(m, rank=4, alpha=8, quantize_nf4=True)
    randomize_adapters(m)
    ids = torch.randint(0, tiny_cfg().vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    layers = [x for x in m.modules() if isinstance(x, ep.NF4Linear)]
    with torch.no_grad():
        ref = m(ids)
        with nf4_linear.dequantized_for_inference(m) as kept:
            assert kept > 0 and torch.equal(m(ids), ref)
            assert all(x._dequantized is not None for x in layers)
    assert all(not x.dequantize_once and x._dequantized is None for x in layers)


def test_dequantize_once_keeps_one_weight_per_dtype_and_respects_the_budget():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=True)
    q = ep.NF4Linear(lin)
    assert nf4_linear.enable_dequantize_once(q, budget_bytes=64 * 32 * 4 - 1) == 0
    assert not q.dequantize_once  # over the budget: unchanged (slower, no out-of-memory)
    assert nf4_linear.enable_dequantize_once(q, budget_bytes=64 * 32 * 4) == 64 * 32 * 4
    x = torch.randn(3, 64)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16, torch.float32):
            y = q(x.to(dtype))
            want = torch.nn.functional.linear(x.to(dtype), nf4.dequantize(q.nf4_weight, dtype), lin.bias.to(dtype))
            assert y.dtype == dtype and torch.equal(y, want)
