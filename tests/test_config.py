"""ModelConfig: presets, parameter counts (checked against transformers and our own module), and
config.json round trips through transformers' AutoConfig."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from entrenar.config import PRESETS, ModelConfig, preset
from entrenar.errors import InputError


def _hf_param_count(cfg: ModelConfig) -> int:
    """Parameters of the transformers model for this config (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = cfg.to_hf_dict()
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


def _our_param_count(cfg: ModelConfig) -> int:
    from entrenar.model import CausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(cfg).parameters())


def test_llama_370m_parameter_count():
    cfg = preset("llama-370m")
    n = cfg.num_parameters()
    assert 366_000_000 <= n <= 374_000_000, n
    assert n == _our_param_count(cfg) == _hf_param_count(cfg)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts_agree(name):
    cfg = preset(name)
    assert cfg.num_parameters() == _our_param_count(cfg)


def test_known_model_sizes():
    # published sizes: SmolLM2-135M = 134.5M, Qwen2.5-0.5B = 494.0M (tied head)
    assert preset("smollm2-135m").num_parameters() == 134_515_008
    assert preset("qwen2.5-0.5b").num_parameters() == 494_032_768


ROUNDTRIP = {
    **{name: preset(name) for name in PRESETS},
    "llama-linear-scaling": preset("tiny").replace(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3-scaling": preset("tiny").replace(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, rope_theta=500000.0),
    "qwen2-untied-eps1e-6": preset("qwen2.5-0.5b").replace(tie_word_embeddings=False),
}

_FIELDS = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("extra",)]


def roundtrip_through_transformers(cfg: ModelConfig, tmp_path) -> ModelConfig:
    """ours -> config.json -> AutoConfig (checked) -> save_pretrained -> ours."""
    from transformers import AutoConfig

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(parents=True)
    cfg.save(src / "config.json")
    hf = AutoConfig.from_pretrained(src)
    assert hf.model_type == cfg.architecture
    assert hf.vocab_size == cfg.vocab_size and hf.hidden_size == cfg.hidden_size
    assert hf.num_hidden_layers == cfg.num_layers and hf.intermediate_size == cfg.intermediate_size
    assert hf.num_attention_heads == cfg.num_heads and hf.num_key_value_heads == cfg.num_kv_heads
    assert getattr(hf, "head_dim", None) in (None, cfg.head_dim)
    assert hf.rms_norm_eps == cfg.rms_norm_eps
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.rope_parameters["rope_type"] == (cfg.rope_scaling or {}).get("rope_type", "default")
    assert hf.tie_word_embeddings == cfg.tie_word_embeddings
    hf.save_pretrained(dst)
    return ModelConfig.load(dst / "config.json")


@pytest.mark.parametrize("name", list(ROUNDTRIP))
def test_config_json_roundtrip_through_autoconfig(name, tmp_path):
    cfg = ROUNDTRIP[name]
    back = roundtrip_through_transformers(cfg, tmp_path)
    for f in _FIELDS:
        if f == "initializer_range":
            continue
        assert getattr(back, f) == getattr(cfg, f), f"{name}: {f} {getattr(back, f)!r} != {getattr(cfg, f)!r}"


def test_rope_parameters_ignored_is_caught(tmp_path, monkeypatch):
    """transformers >= 5 writes theta into rope_parameters; a reader that ignores it gets 1e4."""
    cfg = preset("qwen2.5-0.5b")
    assert roundtrip_through_transformers(cfg, tmp_path / "ok").rope_theta == 1e6
    real = ModelConfig.from_hf_dict.__func__
    monkeypatch.setattr(ModelConfig, "from_hf_dict", classmethod(
        lambda cls, d: real(cls, {k: v for k, v in d.items() if k != "rope_parameters"})))
    assert roundtrip_through_transformers(cfg, tmp_path / "mutated").rope_theta != 1e6


def test_gptj_and_qk_norm_survive_config_json(tmp_path):
    cfg = preset("tiny").replace(rope_style="gptj", qk_norm=True)
    cfg.save(tmp_path / "config.json")
    back = ModelConfig.load(tmp_path / "config.json")
    assert back.rope_style == "gptj" and back.qk_norm


def test_invalid_configs_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="multiple"):
        preset("tiny").replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_style"):
        preset("tiny").replace(rope_style="alibi")
    with pytest.raises(ValueError, match="preset"):
        preset("no-such-preset")
    # a bad config.json is an InputError naming the file
    from entrenar.formats.hf import read_config

    d = preset("tiny").to_hf_dict()
    d["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match=str(tmp_path / "config.json")):
        read_config(tmp_path)
