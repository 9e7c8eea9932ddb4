"""Adapters written by `peft` itself, with the adapter_config.json options a PEFT user sets: a regex
`target_modules` is resolved to the modules PEFT would wrap, and the LoRA variants we do not implement are
refused by name (exit 2) instead of loading as plain LoRA and computing something else."""

from __future__ import annotations

import json

import pytest
import torch

from entrenar import peft as ep
from entrenar.errors import InputError
from entrenar.peft import io as peft_io
from tests.test_peft import IDS, _hf_model, rel, tiny_model


def _peft_adapter(tmp_path, target_modules, **lora_kw):
    """A LoRA adapter saved by peft over the transformers copy of our tiny model, with random B (PEFT's
    init leaves B zero, which would make any wrong target invisible): (adapter dir, PEFT's logits, the
    leaf names PEFT wrapped)."""
    peft = pytest.importorskip("peft")
    m = tiny_model(qwen=False)
    hf = _hf_model(m)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, **lora_kw)
    pm = peft.get_peft_model(hf, cfg)
    gen = torch.Generator().manual_seed(0)
    wrapped = set()
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_B") and "default" in getattr(mod, "lora_B", {}):
            wrapped.add(name.rsplit(".", 1)[-1])
            with torch.no_grad():
                mod.lora_B["default"].weight.copy_(torch.randn(mod.lora_B["default"].weight.shape, generator=gen))
    pm.eval()
    with torch.no_grad():
        logits = pm(IDS).logits
    out = tmp_path / "adapter"
    pm.save_pretrained(str(out))
    return out, logits, wrapped


@pytest.mark.parametrize("regex", [r".*\.(q_proj|v_proj)", r"model\.layers\.\d+\.mlp\.(gate|up)_proj"])
def test_regex_target_modules_wrap_what_peft_wraps(tmp_path, regex):
    adapter, theirs, wrapped = _peft_adapter(tmp_path, regex)
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == regex
    m = ep.load_adapter(tiny_model(qwen=False), adapter, force_base=True)
    ours_wrapped = {path.rsplit(".", 1)[-1] for path in ep.lora_modules(m)}
    assert ours_wrapped == wrapped and len(wrapped) == 2
    with torch.no_grad():
        assert rel(m.eval()(IDS), theirs) <= 1e-5


@pytest.mark.parametrize("regex,why", [(r".*layernorm", "matches no linear layer"),
                                       (r".*q_pro", "matches no linear layer"),  # PEFT full-matches
                                       ])
def test_regex_matching_no_linear_is_exit_2(tmp_path, regex, why):
    cfg_path = tmp_path / "adapter_config.json"
    with pytest.raises(InputError, match=why):
        peft_io._resolve_targets(tiny_model(qwen=False), regex, cfg_path)


@pytest.mark.parametrize("targets", [[], {"q_proj": 1}, None, 3])
def test_target_modules_must_be_a_nonempty_list_or_a_regex(tmp_path, targets):
    with pytest.raises(InputError, match="target_modules must be a list of names"):
        peft_io._resolve_targets(tiny_model(qwen=False), targets, tmp_path / "adapter_config.json")
    assert peft_io._resolve_targets(tiny_model(qwen=False), ["q_proj"], tmp_path) == ["q_proj"]


@pytest.mark.parametrize("option,value,named", [
    ("bias", "all", "bias=all"), ("bias", "lora_only", "bias=lora_only"),
    ("fan_in_fan_out", True, "fan_in_fan_out"), ("use_dora", True, "use_dora"),
    ("modules_to_save", ["lm_head"], "modules_to_save"), ("rank_pattern", {"q_proj": 8}, "rank_pattern"),
    ("alpha_pattern", {"q_proj": 8}, "alpha_pattern"), ("layers_to_transform", [0], "layers_to_transform")])
def test_lora_variants_we_do_not_compute_are_refused_by_name(tmp_path, option, value, named):
    m = tiny_model(qwen=False)
    ep.apply_lora(m, rank=4, alpha=8, targets="q_proj,v_proj")
    ep.save_adapter(m, tmp_path, "tiny-base")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    peft_io.read_adapter_config(tmp_path)  # as saved: accepted
    cfg[option] = value
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=f"unsupported LoRA options {named}"):
        ep.load_adapter(tiny_model(qwen=False), tmp_path)


def test_keys_left_out_of_the_config_take_peft_defaults(tmp_path):
    """A minimal hand-written adapter_config.json (r and target_modules only) means PEFT's LoraConfig
    defaults for lora_alpha, lora_dropout and use_rslora, read from peft itself."""
    peft = pytest.importorskip("peft")
    defaults = peft.LoraConfig()
    m = tiny_model(qwen=False)
    ep.apply_lora(m, rank=4, alpha=32, dropout=0.3, rslora=True, targets="q_proj,v_proj")
    ep.save_adapter(m, tmp_path, "tiny-base")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    minimal = {"peft_type": "LORA", "r": 4, "target_modules": cfg["target_modules"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(minimal))
    loaded = ep.load_adapter(tiny_model(qwen=False), tmp_path, force_base=True)
    mod = next(iter(ep.lora_modules(loaded).values()))
    scale = defaults.lora_alpha / (4 ** 0.5 if defaults.use_rslora else 4)
    assert mod.scaling == pytest.approx(scale)
    assert loaded.peft_config["lora_dropout"] == defaults.lora_dropout == 0.0
    assert isinstance(mod.lora_dropout, torch.nn.Identity)  # no dropout module at PEFT's default 0
    assert loaded.peft_config["use_rslora"] is defaults.use_rslora
