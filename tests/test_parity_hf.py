"""Our fp32 model vs transformers fp32 on the same weights, copied with the production loader
(transformers save_pretrained -> entrenar.formats.load_model). Bound: logits relL2 <= 1e-5."""

from __future__ import annotations

import pytest
import torch

from entrenar.formats import load_model
from entrenar.tensors import rel_l2

PARITY_BOUND = 1e-5

# (arch, overrides): bias on = qwen2, off = llama; tied/untied; eps 1e-5/1e-6; theta 1e4/1e6; GQA/MHA
CASES = {
    "llama-untied-eps1e-5-theta1e4-gqa": ("llama", {"tie_word_embeddings": False, "rms_norm_eps": 1e-5,
                                                        "rope_theta": 1e4, "num_key_value_heads": 2}),
    "llama-tied-eps1e-6-theta1e6-mha": ("llama", {"tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                                                      "rope_theta": 1e6, "num_key_value_heads": 4}),
    "qwen2-bias-tied-eps1e-6-theta1e6-gqa": ("qwen2", {"tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                                                           "rope_theta": 1e6, "num_key_value_heads": 2}),
    "qwen2-bias-untied-eps1e-5-theta1e4-gqa4": ("qwen2", {"tie_word_embeddings": False, "rms_norm_eps": 1e-5,
                                                              "rope_theta": 1e4, "num_attention_heads": 8,
                                                              "num_key_value_heads": 2}),
    "llama-linear-rope-scaling": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                                "rope_theta": 1e4}),
}


def sample_ids(vocab: int, batch: int = 2, seq: int = 33, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def parity(hf_model, ours, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return rel_l2(ours(ids), hf_model(ids).logits)


def assert_parity(hf_model, ours, ids: torch.Tensor, bound: float = PARITY_BOUND) -> float:
    err = parity(hf_model, ours, ids)
    assert err <= bound, f"logits relL2 {err:.3e} > {bound:.0e} vs transformers"
    return err


@pytest.mark.parametrize("case", list(CASES))
def test_parity_tiny_vs_transformers(case, tiny_hf_dir):
    arch, overrides = CASES[case]
    hf_model, path = tiny_hf_dir(arch, **overrides)
    ours = load_model(path)
    cfg = ours.cfg
    # the loaded config is the one transformers used: nothing defaulted on the way
    assert cfg.architecture == arch
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert (ours.lm_head is None) == cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == hf_model.config.rms_norm_eps
    assert cfg.rope_theta == hf_model.config.rope_parameters["rope_theta"]
    assert cfg.num_kv_heads == hf_model.config.num_key_value_heads
    assert next(ours.parameters()).dtype == torch.float32
    for seq in (1, 7, 33):
        assert_parity(hf_model, ours, sample_ids(cfg.vocab_size, seq=seq, seed=seq))


def check_causality(model, vocab: int, seq: int = 24, seed: int = 0) -> None:
    """Changing tokens after position t changes no logit at positions <= t (exact equality)."""
    ids = sample_ids(vocab, batch=1, seq=seq, seed=seed)
    with torch.no_grad():
        base = model(ids)
        for t in (0, 5, seq - 2):
            changed = ids.clone()
            changed[:, t + 1:] = (changed[:, t + 1:] + 1 + torch.arange(seq - t - 1)) % vocab
            out = model(changed)
            assert torch.equal(out[:, : t + 1], base[:, : t + 1]), f"logits at <= {t} depend on later tokens"
            assert not torch.equal(out[:, t + 1:], base[:, t + 1:])  # the change did reach the model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_causality_exact(arch, tiny_hf_dir):
    _, path = tiny_hf_dir(arch)
    ours = load_model(path)
    check_causality(ours, ours.cfg.vocab_size)


def test_model_fields_are_declared(tiny_hf_dir):
    """source / peft_config / activation_checkpointing are CausalLM fields, not attributes set ad hoc from outside."""
    from entrenar.model import CausalLM

    _, path = tiny_hf_dir("llama")
    ours = load_model(path)
    assert isinstance(ours.source, dict) and ours.peft_config is None and ours.activation_checkpointing is False
    fresh = CausalLM(ours.cfg)
    assert (fresh.source, fresh.peft_config, fresh.activation_checkpointing, fresh.kernels) == (None, None, False,
                                                                                                "torch")
    assert {"source", "peft_config", "activation_checkpointing", "kernels"} <= set(CausalLM.__annotations__)
