"""Each known model bug (RoPE pairs swapped, Q/K/V biases dropped, eps 1e-5 on a 1e-6 model, bidirectional
attention, BF16 saved or read as F16, unpermuted GGUF Q/K), re-introduced by monkeypatch, turns a real test red.

Every test here runs the same check the green test runs (parity vs transformers, exact
causality, BF16 round trip) and asserts that under the mutation that check FAILS; a sanity
assertion first shows the check passes without the mutation.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import entrenar.model as model_mod
from entrenar.formats import gguf as ggufmod
from entrenar.formats import load_model
from entrenar.kernels import get_ops
from tests.test_loading import bf16_gguf_roundtrip_ok, bf16_hf_roundtrip_ok
from tests.test_parity_hf import CASES, assert_parity, check_causality, sample_ids


def _load_case(case: str, tiny_hf_dir):
    arch, overrides = CASES[case]
    hf_model, path = tiny_hf_dir(arch, **overrides)
    return hf_model, load_model(path)


def _patch_ops(monkeypatch, **replacements) -> None:
    """Make every CausalLM use the reference ops with some replaced (model.py calls get_ops)."""
    real_get_ops = get_ops

    def patched(kind: str):
        return dataclasses.replace(real_get_ops(kind), **replacements)

    monkeypatch.setattr(model_mod, "get_ops", patched)


def test_rope_pairing_swap_is_caught(tiny_hf_dir, monkeypatch):
    """GPT-J (adjacent) pairs where HF LLaMA/Qwen2 use NeoX (split-half) pairs."""
    case = "qwen2-bias-tied-eps1e-6-theta1e6-gqa"
    hf_model, ours = _load_case(case, tiny_hf_dir)
    ids = sample_ids(ours.cfg.vocab_size)
    assert_parity(hf_model, ours, ids)
    real_rope = get_ops("torch").rope
    swap = {"neox": "gptj", "gptj": "neox"}
    _patch_ops(monkeypatch, rope=lambda q, k, cos, sin, style: real_rope(q, k, cos, sin, swap[style]))
    with pytest.raises(AssertionError, match="relL2"):
        assert_parity(hf_model, ours, ids)


def test_qkv_bias_dropped_is_caught(tiny_hf_dir, monkeypatch):
    """The forward ignores the Q/K/V biases (the GPU-only bug): parity vs transformers fails."""
    hf_model, ours = _load_case("qwen2-bias-untied-eps1e-5-theta1e4-gqa4", tiny_hf_dir)
    ids = sample_ids(ours.cfg.vocab_size)
    assert_parity(hf_model, ours, ids)
    for block in ours.model.layers:
        for proj in ("q_proj", "k_proj", "v_proj"):
            monkeypatch.setattr(getattr(block.self_attn, proj), "bias", None)
    with pytest.raises(AssertionError, match="relL2"):
        assert_parity(hf_model, ours, ids)


def test_eps_forced_to_1e5_is_caught(tiny_hf_dir, monkeypatch):
    """RMSNorm with a hard-coded eps 1e-5 on a 1e-6 model (Qwen)."""
    hf_model, ours = _load_case("qwen2-bias-tied-eps1e-6-theta1e6-gqa", tiny_hf_dir)
    assert ours.cfg.rms_norm_eps == 1e-6
    ids = sample_ids(ours.cfg.vocab_size)
    assert_parity(hf_model, ours, ids)
    real_norm = get_ops("torch").rms_norm
    _patch_ops(monkeypatch, rms_norm=lambda x, w, eps: real_norm(x, w, 1e-5))
    with pytest.raises(AssertionError, match="relL2"):
        assert_parity(hf_model, ours, ids)


def test_eps_from_config_defaulted_is_caught(tiny_hf_dir, monkeypatch):
    """The loader drops rms_norm_eps from config.json (falls back to 1e-5)."""
    from entrenar.config import ModelConfig

    arch, overrides = CASES["qwen2-bias-tied-eps1e-6-theta1e6-gqa"]
    hf_model, path = tiny_hf_dir(arch, **overrides)
    real = ModelConfig.from_hf_dict.__func__

    def dropping(cls, d):
        return real(cls, {k: v for k, v in d.items() if k != "rms_norm_eps"}).replace(rms_norm_eps=1e-5)

    monkeypatch.setattr(ModelConfig, "from_hf_dict", classmethod(dropping))
    ours = load_model(path)
    with pytest.raises(AssertionError, match="relL2"):
        assert_parity(hf_model, ours, sample_ids(ours.cfg.vocab_size))


def test_causal_mask_removed_is_caught(tiny_hf_dir, monkeypatch):
    """Bidirectional attention (the 'CPU oracle' bug): the exact causality check fails."""
    _, path = tiny_hf_dir("llama")
    ours = load_model(path)
    check_causality(ours, ours.cfg.vocab_size)

    def bidirectional(q, k, v, attn_mask=None, is_causal=False, **kw):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, **kw)

    shim = types.SimpleNamespace(**{n: getattr(F, n) for n in dir(F) if not n.startswith("__")})
    shim.scaled_dot_product_attention = bidirectional
    monkeypatch.setattr(model_mod, "F", shim)
    with pytest.raises(AssertionError, match="depend on later tokens"):
        check_causality(ours, ours.cfg.vocab_size)


def test_bf16_written_as_f16_is_caught(tmp_path, tiny_hf_dir, monkeypatch):
    """Saving casts BF16 tensors to F16: the bit-exact BF16 round trip fails."""
    from entrenar import fileio

    assert bf16_hf_roundtrip_ok(tmp_path / "ok", tiny_hf_dir)
    real_save = fileio.write_safetensors

    def save_as_f16(tensors, *a, **k):
        return real_save({n: t.half() if t.dtype == torch.bfloat16 else t for n, t in tensors.items()}, *a, **k)

    monkeypatch.setattr(fileio, "write_safetensors", save_as_f16)
    assert not bf16_hf_roundtrip_ok(tmp_path / "mutated", tiny_hf_dir)


def test_bf16_read_as_f16_is_caught(tmp_path, monkeypatch):
    """GGUF import tags BF16 bits as F16 (every BF16 weight becomes garbage): the bit-exact read check fails."""
    assert bf16_gguf_roundtrip_ok(tmp_path)
    real = ggufmod._tensor_to_torch

    def bf16_as_f16(t, path):
        if t.tensor_type.name == "BF16":
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            return torch.from_numpy(np.array(t.data).view(np.float16).reshape(shape).copy())
        return real(t, path)

    monkeypatch.setattr(ggufmod, "_tensor_to_torch", bf16_as_f16)
    assert not bf16_gguf_roundtrip_ok(tmp_path)


def test_unpermuted_llama_gguf_is_caught(tmp_path, monkeypatch):
    """Skipping llama.cpp's inverse Q/K permutation breaks parity of a llama GGUF."""
    from tests.helpers.models import make_hf_model
    from tests.test_loading import write_gguf

    hf_model = make_hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", hf_model)
    ids = sample_ids(hf_model.config.vocab_size)
    assert_parity(hf_model, load_model(path), ids)
    monkeypatch.setattr(ggufmod, "unpermute_qk", lambda w, n_head: w)
    with pytest.raises(AssertionError, match="relL2"):
        assert_parity(hf_model, load_model(path), ids)


# ---- RoPE frequencies built once per device (CausalLM._inv_freq_on) -----------------------------------
def test_rope_frequencies_are_built_once_and_follow_the_config(monkeypatch):
    """Each forward used to copy the CPU-built inverse frequencies to the device: on CUDA a blocking copy
    that made the host wait for every queued kernel. They are now built once per device and RoPE setting;
    the numbers are the same, and a changed rope_theta is not served stale."""
    from tests.test_train_loop import tiny_model

    calls = []
    real = model_mod.rope_inv_freq
    monkeypatch.setattr(model_mod, "rope_inv_freq", lambda cfg: calls.append(cfg.rope_theta) or real(cfg))
    model = tiny_model().eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(ids)
        again = model(ids)
    assert len(calls) == 1 and torch.equal(first, again)
    positions = torch.arange(9)[None]
    cos, sin = model_mod.rope_tables(model.cfg, positions, torch.float32)  # the uncached way
    cos_c, sin_c = model_mod.rope_tables(model.cfg, positions, torch.float32, model._inv_freq_on(ids.device))
    assert torch.equal(cos, cos_c) and torch.equal(sin, sin_c)
    model.cfg.rope_theta *= 2
    with torch.no_grad():
        other = model(ids)
    assert len(calls) == 3 and not torch.allclose(other, first)  # 2: the uncached rope_tables call above
