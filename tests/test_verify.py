"""`verify` bisection on tiny random Qwen2-shaped models: clean paths pass, seeded defects are named.

Each defect is injected into the path under test only: the model under test runs with
kernels="triton", whose ops (and attention) the test replaces by a defective version; the
float64 oracle always runs the clean torch reference ops: a fast GPU path wrong while the CPU path
is right, as with the RoPE pairing, Q/K/V-bias and eps defects earlier fast paths shipped.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import entrenar.model as model_mod
from entrenar.errors import GuardError
from entrenar.kernels import TORCH_OPS, Ops
from entrenar.kernels.rmsnorm import rms_norm_reference
from entrenar.kernels.rope import rope_reference
from entrenar.model import Attention, CausalLM
from entrenar.verify import BOUNDS, OP_ORDER, format_report, preflight, rel_l2, verify_model
from entrenar.verify.probe import build_probe
from tests.helpers.models import tiny_causal_lm, tiny_config

SEQ_LEN = 128


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer (256 ids, one per byte): real text, tiny vocab. The alphabet is sorted:
    it comes from a Rust hash set whose order changes per process, and the probe ids must not."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def tiny_qwen2(seed: int = 0, num_layers: int = 2) -> CausalLM:
    """Qwen2-shaped: Q/K/V bias, eps 1e-6, theta 1e6, GQA, tied head; biases and norms non-trivial."""
    return tiny_causal_lm(tiny_config("qwen2", vocab_size=272, num_layers=num_layers, rope_theta=1e6), seed,
                          bias_std=0.5, norm_std=0.1)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def probe(tok):
    return build_probe(tok, SEQ_LEN)


FAST_OPS = dataclasses.replace(TORCH_OPS)  # same functions, its own identity: "the fast path"


def fast_path(monkeypatch, model: CausalLM, ops: Ops = FAST_OPS) -> CausalLM:
    """Route the model under test through ``ops`` (kernels='triton'); the oracle keeps TORCH_OPS."""
    monkeypatch.setattr(model_mod, "get_ops", lambda kind: TORCH_OPS if kind == "torch" else ops)
    model.kernels = "triton"
    return model


def first(rep: dict) -> str:
    return rep["first_divergent"]["name"] if rep["first_divergent"] else None


def ops_of(rep: dict, seq: str = "long") -> dict[str, dict]:
    s = next(s for s in rep["sequences"] if s["name"] == seq)
    return {e["name"].split(".", 2)[2]: e for e in s["ops"]}


# ---- probe ---------------------------------------------------------------------------------------
def test_probe_has_short_and_long_sequences(tok):
    probe = build_probe(tok, 512)
    assert [s.name for s in probe] == ["short", "long"]
    assert probe[0].length < 32 and probe[1].length == 512
    assert len(build_probe(tok, 4000)[1].input_ids[0]) == 4000  # cycled text
    with pytest.raises(ValueError):
        build_probe(tok, 16)


def test_probe_does_not_swallow_a_type_error_inside_encode():
    """The probe used to catch TypeError from encode(text, add_special=True) and retry without BOS, hiding a bug."""

    class BuggyTokenizer:
        def encode(self, text: str, add_special: bool = False) -> list[int]:
            if add_special:
                raise TypeError("bug inside encode")
            return [1] * len(text)

    with pytest.raises(TypeError, match="bug inside encode"):
        build_probe(BuggyTokenizer(), 64)


def test_rel_l2():
    ref = torch.tensor([3.0, 4.0])
    assert rel_l2(ref, ref) == 0.0
    assert rel_l2(torch.tensor([3.0, 5.0]), ref) == pytest.approx(0.2)
    assert rel_l2(torch.tensor([1.0]), torch.tensor([0.0])) == math.inf
    assert rel_l2(torch.tensor([float("nan")]), torch.tensor([1.0])) == math.inf


# ---- clean paths pass --------------------------------------------------------------------------------
def test_clean_fp32_passes_against_reference_and_hf(tok, probe, monkeypatch):
    model = fast_path(monkeypatch, tiny_qwen2())
    rep = verify_model(model, probe=probe, against="reference")
    assert rep["ok"] and rep["exit_code"] == 0, format_report(rep)
    for s in rep["sequences"]:
        assert s["logits_rel_l2"] < 1e-6 and s["ce_diff"] < 1e-6
    assert {g["name"] for g in rep["grads"]["groups"]} >= {"embed", "layers.0.attn", "layers.1.mlp", "norm"}
    assert rep["grads"]["worst"]["rel_l2"] < 1e-5
    rep = verify_model(model, probe=probe, against="hf")
    assert rep["ok"], format_report(rep)
    assert "PASS" in format_report(rep)


def test_clean_bf16_passes_bf16_bounds_and_fails_fp32_bounds(probe, monkeypatch):
    model = tiny_qwen2().to(torch.bfloat16)
    rep = verify_model(model, probe=probe, against="reference", grads=False)
    assert rep["dtype"] == "bf16" and rep["ok"], format_report(rep)
    worst = max(s["logits_rel_l2"] for s in rep["sequences"])
    assert BOUNDS["fp32"].logits < worst < BOUNDS["bf16"].logits  # bf16 noise is visible, and bounded


def test_every_op_is_compared_against_hf(probe, monkeypatch):
    """The hf oracle's hooks record every op our trace records (so per-op bisection works vs hf)."""
    model = fast_path(monkeypatch, tiny_qwen2(), dataclasses.replace(
        FAST_OPS, swiglu=lambda g, u: torch.nn.functional.silu(g) * u * 1.01))
    rep = verify_model(model, probe=probe, against="hf", grads=False)
    ops = ops_of(rep)
    assert all(e["rel_l2"] is not None for e in ops.values()), ops
    assert first(rep) == "layers.0.act"
    assert ops["up_proj"]["ok"] and not ops["act"]["ok"]


# ---- six planted defects (five here; BF16-as-F16 at load is in test_verify_load.py) ------------------
def test_rope_pairs_swapped_is_named_q_rope(probe, monkeypatch):
    swapped = dataclasses.replace(FAST_OPS, rope=lambda q, k, cos, sin, style: rope_reference(
        q, k, cos, sin, "gptj" if style == "neox" else "neox"))
    rep = verify_model(fast_path(monkeypatch, tiny_qwen2(), swapped), probe=probe)
    assert rep["exit_code"] == 1
    assert first(rep) == "layers.0.q_rope", format_report(rep)
    ops = ops_of(rep)
    assert ops["v_proj"]["ok"] and ops["q_proj"]["ok"] and ops["k_proj"]["ok"]
    assert not ops["k_rope"]["ok"] and ops["q_rope"]["rel_l2"] > 0.1
    assert "RoPE" in rep["first_divergent"]["hint"]


def _drop_qkv_bias(monkeypatch):
    original = Attention.forward

    def forward_without_bias(self, x, cos, sin, mask, ops, cache=None):
        if ops is TORCH_OPS:
            return original(self, x, cos, sin, mask, ops, cache)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        saved = [m.bias for m in projections]
        for m in projections:
            m.bias = None
        try:
            return original(self, x, cos, sin, mask, ops, cache)
        finally:
            for m, b in zip(projections, saved):
                m.bias = b

    monkeypatch.setattr(Attention, "forward", forward_without_bias)


def test_qkv_bias_dropped_is_named_q_proj(probe, monkeypatch):
    _drop_qkv_bias(monkeypatch)
    rep = verify_model(fast_path(monkeypatch, tiny_qwen2()), probe=probe)
    assert first(rep) == "layers.0.q_proj", format_report(rep)
    ops = ops_of(rep)
    assert ops["input_norm"]["ok"] and not ops["k_proj"]["ok"] and not ops["v_proj"]["ok"]
    assert "bias" in rep["first_divergent"]["hint"]
    assert rep["grads"]["missing_in_test"]  # the dropped biases get no gradient either


def test_rmsnorm_eps_1e5_on_1e6_model_is_named_input_norm(probe, monkeypatch):
    model = tiny_qwen2()
    assert model.cfg.rms_norm_eps == 1e-6
    hard_coded = dataclasses.replace(FAST_OPS, rms_norm=lambda x, w, eps: rms_norm_reference(x, w, 1e-5))
    rep = verify_model(fast_path(monkeypatch, model, hard_coded), probe=probe)
    assert first(rep) == "layers.0.input_norm", format_report(rep)
    assert "eps" in rep["first_divergent"]["hint"]


def test_noncausal_attention_is_named_attn_probs(probe, monkeypatch):
    original = Attention.forward

    def bidirectional(self, x, cos, sin, mask, ops, cache=None):
        if ops is not TORCH_OPS and mask is None:
            mask = torch.ones(x.shape[0], 1, x.shape[1], x.shape[1], dtype=torch.bool)
        return original(self, x, cos, sin, mask, ops, cache)

    monkeypatch.setattr(Attention, "forward", bidirectional)
    rep = verify_model(fast_path(monkeypatch, tiny_qwen2()), probe=probe)
    assert first(rep) == "layers.0.attn_probs", format_report(rep)
    ops = ops_of(rep)
    assert ops["q_rope"]["ok"] and ops["k_rope"]["ok"] and not ops["attn_out"]["ok"]


def _softmax_reading_garbage_below_32(monkeypatch):
    """An attention whose row softmax reduces over 32 lanes: rows shorter than 32 read stale lanes."""

    def partial_warp_softmax(scores: torch.Tensor) -> torch.Tensor:
        n = scores.shape[-1]
        if n >= 32:
            return scores.softmax(-1)
        gen = torch.Generator().manual_seed(7)
        stale = torch.rand(*scores.shape[:-1], 32 - n, generator=gen).to(scores) * 3.0
        lanes = torch.cat([scores, stale], dim=-1)
        m = lanes.max(-1, keepdim=True).values
        return (scores - m).exp() / (lanes - m).exp().sum(-1, keepdim=True)

    original = Attention.forward

    def attention(self, x, cos, sin, mask, ops, cache=None):
        if ops is TORCH_OPS:
            return original(self, x, cos, sin, mask, ops, cache)
        cfg, B, T = self.cfg, x.shape[0], x.shape[1]
        p = f"layers.{self.layer}."
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        q, k = ops.rope(q, k, cos, sin, cfg.rope_style)
        if self.internals is not None:  # what verify reads from inside the attention (record_internals)
            self.internals[p + "q_rope"], self.internals[p + "k_rope"] = q, k
        rep = cfg.num_heads // cfg.num_kv_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, 1), v.transpose(1, 2).repeat_interleave(
            rep, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        probs = partial_warp_softmax(scores.masked_fill(~causal, float("-inf")))
        if self.internals is not None:
            self.internals[p + "attn_probs"] = probs
        y = (probs @ v).transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim)
        return self.o_proj(y)

    monkeypatch.setattr(Attention, "forward", attention)


def test_softmax_garbage_below_32_shows_on_short_probe_only(probe, monkeypatch):
    _softmax_reading_garbage_below_32(monkeypatch)
    rep = verify_model(fast_path(monkeypatch, tiny_qwen2()), probe=probe)
    short, long = rep["sequences"]
    assert short["name"] == "short" and short["tokens"] < 32
    assert not short["ok"] and long["ok"], format_report(rep)
    assert short["first_divergent"]["name"] == "layers.0.attn_probs"
    assert rep["first_divergent"]["sequence"] == "short"
    assert long["logits_rel_l2"] < BOUNDS["fp32"].logits


# ---- preflight -------------------------------------------------------------------------------------
def test_preflight_passes_clean_model(tok, monkeypatch):
    model = fast_path(monkeypatch, tiny_qwen2())
    model.train()
    out = preflight(model, tok, "cpu", "fp32", "triton")
    assert out["ok"] and out["dtype"] == "fp32" and out["kernels"] == "triton"
    assert [s["name"] for s in out["sequences"]] == ["short", "long"]
    assert out["sequences"][1]["tokens"] == 64
    assert model.training  # preflight leaves the training mode as it was


def test_preflight_raises_guard_naming_the_op(tok, monkeypatch):
    _drop_qkv_bias(monkeypatch)
    model = fast_path(monkeypatch, tiny_qwen2())
    with pytest.raises(GuardError) as err:
        preflight(model, tok, "cpu", torch.float32, "triton")
    e = err.value
    assert e.exit_code == 3 and e.guard_id == "GUARD-PARITY"
    assert "layers.0.q_proj" in str(e) and "bias" in str(e)
    assert e.details["first_divergent"]["name"] == "layers.0.q_proj"


# ---- what must never pass silently ----------------------------------------------------------------------
def _drop_from_test_trace(monkeypatch, name: str) -> None:
    """The path under test (kernels='triton') never records ``name``, as with a module the hooks do not know."""
    from entrenar.verify import bisect

    real = bisect.OurPath.forward

    def forward(self, ids, keep):
        logits, trace = real(self, ids, keep)
        if self.model.kernels == "triton":
            trace.pop(name, None)
        return logits, trace

    monkeypatch.setattr(bisect.OurPath, "forward", forward)


def test_unrecorded_layer_fails_naming_it(probe, monkeypatch):
    """A hidden state one path never recorded used to count as ok: True (a clean PASS on an unchecked layer)."""
    _drop_from_test_trace(monkeypatch, "layers.1")
    rep = verify_model(fast_path(monkeypatch, tiny_qwen2()), probe=probe, grads=False)
    assert not rep["ok"] and rep["exit_code"] == 1
    assert first(rep) == "layers.1", format_report(rep)
    assert "never recorded by the path under test" in rep["first_divergent"]["note"]
    assert "never saw this op" in rep["first_divergent"]["hint"]
    assert "FAIL: first divergence at layers.1" in format_report(rep)


def test_unrecorded_op_fails_naming_the_op(probe, monkeypatch):
    """Bisecting a RoPE defect while q_rope is never recorded: the answer is the unchecked op, not k_rope."""
    _drop_from_test_trace(monkeypatch, "layers.0.q_rope")
    swapped = dataclasses.replace(FAST_OPS, rope=lambda q, k, cos, sin, style: rope_reference(
        q, k, cos, sin, "gptj" if style == "neox" else "neox"))
    rep = verify_model(fast_path(monkeypatch, tiny_qwen2(), swapped), probe=probe, grads=False)
    assert first(rep) == "layers.0.q_rope", format_report(rep)
    ops = ops_of(rep)
    assert not ops["q_rope"]["ok"] and ops["q_rope"]["rel_l2"] is None
    assert ops["q_proj"]["ok"] and not ops["k_rope"]["ok"]


def _plant_nan(model: CausalLM, name: str = "model.layers.1.mlp.down_proj.weight") -> CausalLM:
    with torch.no_grad():
        dict(model.named_parameters())[name][3, 5] = float("nan")
    return model


def test_nan_weight_is_named_as_bad_weights_not_a_bad_op(tok, probe, monkeypatch):
    """NaN in the weights made every op diverge and the report said 'fix the op'; it names the tensor now."""
    from entrenar.errors import InputError

    model = _plant_nan(fast_path(monkeypatch, tiny_qwen2()))
    with pytest.raises(InputError, match=r"weights contain NaN/Inf in model\.layers\.1\.mlp\.down_proj\.weight "
                                         r"\(1 of 8192 values\)") as err:
        verify_model(model, probe=probe)
    assert err.value.exit_code == 2 and "fix the op" not in str(err.value)
    with pytest.raises(InputError, match="weights contain NaN/Inf in model.layers.1.mlp.down_proj.weight"):
        preflight(model, tok, "cpu", "fp32", "triton")


def test_preflight_stops_on_an_unrecorded_layer(tok, monkeypatch):
    _drop_from_test_trace(monkeypatch, "layers.1")
    with pytest.raises(GuardError, match="cannot be checked at layers.1 .*never recorded by the path under test"):
        preflight(fast_path(monkeypatch, tiny_qwen2()), tok, "cpu", "fp32", "triton")


def test_record_internals_is_the_only_switch(monkeypatch):
    """Outside record_internals the forward builds no attention probabilities and records nothing; inside, only
    the asked layers record, and the switch is off again afterwards."""
    from entrenar.verify.trace import FilteredTrace, keep_block, record_ours

    built = []
    real = Attention.attention_probs
    monkeypatch.setattr(Attention, "attention_probs", lambda self, q, k, mask: built.append(self.layer) or real(
        self, q, k, mask))
    model = tiny_qwen2()
    ids = torch.randint(0, 272, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids)
        assert built == []
        trace = FilteredTrace(keep_block(1))
        with record_ours(model, trace, keep_block(1)):
            recorded = model(ids)
        assert built == [1] and torch.equal(plain, recorded)
        assert {n.split(".", 2)[2] for n in trace} == set(OP_ORDER) and all(n.startswith("layers.1.") for n in trace)
        assert trace["layers.1.attn_probs"].shape == (1, 4, 9, 9)
        assert all(layer.self_attn.internals is None for layer in model.model.layers)
        model(ids)
    assert built == [1]
