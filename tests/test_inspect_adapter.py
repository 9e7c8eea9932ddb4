"""`entrenar inspect ADAPTER|RUN` of a LoRA/QLoRA adapter (issue 38 item 11; it was exit 2, "a LoRA adapter
directory, not a full model"): base, rank, alpha and scaling, targets, dropout, trainable parameters and their share
of the base, the size of each target's update ||B @ A||_F * scaling (checked against the product itself), an
untrained adapter named, the chat template it carries, the sha256 manifest. Adapters made in-process on a tiny
model, saved as a run saves final/ (train/commands.py's _adapter_saver) or as PEFT does (no manifest, no tokenizer)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from entrenar import peft
from entrenar.formats import load_model
from tests.helpers.cli import run_cli
from tests.test_messages38 import tiny_chat_model  # noqa: F401

TOOL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% if m.tool_calls %}"
                 "{{ m.tool_calls | tojson }}{% endif %}<|im_end|>\n{% endfor %}{% if tools %}{{ tools | tojson }}"
                 "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def adapter_model(base: Path, *, trained: bool, rslora: bool = False, targets: str | None = None):
    model = peft.apply_lora(load_model(base, dtype=torch.float32), 4, 8.0, dropout=0.05, rslora=rslora,
                            targets=targets, seed=0)
    if trained:  # B drawn per module with growing scale: the targets' norms differ
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for i, m in enumerate(peft.lora_modules(model).values()):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.01 * (i + 1))
    return model


def save_final(model, out: Path, base: Path, template: str | None = None) -> Path:
    """final/ as a LoRA run writes it: adapter, tokenizer (with --chat-template's), generation config, manifest."""
    from entrenar.tokenizer import load_tokenizer
    from entrenar.train.commands import _adapter_saver

    tok = load_tokenizer(str(base))
    if template is not None:
        tok.set_chat_template(template, "tools.jinja")
    out.mkdir(parents=True)
    _adapter_saver(tok, str(base))(model, out / "final")
    return out / "final"


def inspect(target: Path, capsys=None) -> tuple[int, dict, str]:
    return run_cli(["inspect", str(target), "--json"], capsys, capture=capsys is None)


def test_a_runs_adapter_is_described(tmp_path, tiny_chat_model):  # noqa: F811
    model = adapter_model(tiny_chat_model, trained=True)
    final = save_final(model, tmp_path / "run", tiny_chat_model, TOOL_TEMPLATE)
    code, r, err = inspect(tmp_path / "run")  # the run directory: its final/ adapter
    assert code == 0, (r, err)
    assert r["adapter"] == str(final) and r["format"] == "peft-lora"
    assert r["base_model"]["recorded"] == str(tiny_chat_model) and r["base_model"]["found"] == str(tiny_chat_model)
    assert (r["rank"], r["alpha"], r["scaling"], r["dropout"]) == (4, 8.0, 2.0, 0.05) and not r["use_rslora"]
    assert r["target_modules"] == list(peft.DEFAULT_TARGETS) and r["qlora"] is False
    loras = peft.lora_modules(model)
    trainable = sum(m.lora_A.weight.numel() + m.lora_B.weight.numel() for m in loras.values())
    base_params = load_model(tiny_chat_model).cfg.num_parameters()
    assert r["trainable_parameters"] == trainable and r["base_parameters"] == base_params
    assert r["trainable_percent"] == pytest.approx(100 * trainable / base_params)
    # each target's update size: ||B @ A||_F * scaling of the product itself
    for target, got in r["update_norms"].items():
        norms = [(m.lora_B.weight @ m.lora_A.weight).double().norm().item() * 2.0
                 for path, m in loras.items() if path.endswith("." + target)]
        assert got["modules"] == len(norms) and got["zero_b"] == 0
        assert got["mean"] == pytest.approx(sum(norms) / len(norms), rel=1e-6)
        assert got["max"] == pytest.approx(max(norms), rel=1e-6)
    assert set(r["update_norms"]) == set(peft.DEFAULT_TARGETS) and r["untrained"] is False
    # the chat template it was trained under (not the base's), and the manifest the run wrote
    chat = r["chat_template"]
    assert chat["present"] and chat["text"] == TOOL_TEMPLATE and chat["supports_tools"] and not chat["same_as_base"]
    assert r["manifest"]["status"] == "verified" and r["manifest"]["file"] == "sha256.json"
    assert r["manifest"]["files"] == len(r["files"]) - 1 and r["manifest"]["unrecorded"] == []


def test_an_untrained_adapter_is_said_to_be_one(tmp_path, tiny_chat_model, capsys):  # noqa: F811
    final = save_final(adapter_model(tiny_chat_model, trained=False, rslora=True, targets="q_proj,v_proj"),
                       tmp_path / "run", tiny_chat_model)
    code, r, err = inspect(final)
    assert code == 0, (r, err)
    assert r["untrained"] is True and r["zero_b_modules"] == r["modules"] == 2
    assert r["update_norm"] == {"mean": 0.0, "max": 0.0}
    assert r["scaling"] == pytest.approx(8.0 / math.sqrt(4)) and r["scaling_rule"] == "alpha / sqrt(r)"
    assert r["chat_template"]["same_as_base"] is True
    run = run_cli(["inspect", str(final)], capsys)
    assert run[0] == 0
    text = run.out
    assert "untrained" in text and "every lora_B is zero" in text and "rank" in text and "q_proj" in text
    assert "sha256.json" in text and str(tiny_chat_model) in text


def test_a_peft_saved_adapter_without_base_manifest_or_tokenizer(tmp_path, tiny_chat_model):  # noqa: F811
    """As peft's save_pretrained leaves it: adapter_config.json naming a hub id, the weights, nothing else."""
    out = peft.save_adapter(adapter_model(tiny_chat_model, trained=True), tmp_path / "peft")
    (out / peft.ADAPTER_NOTE).unlink()
    cfg = json.loads((out / peft.ADAPTER_CONFIG).read_text())
    (out / peft.ADAPTER_CONFIG).write_text(json.dumps({**cfg, "base_model_name_or_path": "Org/Some-Base"}))
    code, r, err = inspect(out)
    assert code == 0, (r, err)
    assert r["base_model"]["recorded"] == "Org/Some-Base" and r["base_model"]["found"] is None
    assert "does not exist" in r["base_model"]["note"]
    assert r["base_parameters"] is None and r["trainable_percent"] is None and r["trainable_parameters"] > 0
    assert r["chat_template"] is None and r["manifest"]["status"] == "none"


def test_a_corrupt_adapter_is_exit_2_naming_the_file(tmp_path, tiny_chat_model):  # noqa: F811
    final = save_final(adapter_model(tiny_chat_model, trained=True), tmp_path / "run", tiny_chat_model)
    weights = final / peft.ADAPTER_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, r, err = inspect(final)
    assert code == 2 and str(weights) in r["error"] and "sha256" in r["error"], (r, err)


def test_update_norm_from_gram_matrices_equals_the_product():
    from entrenar.peft.describe import update_norm

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 300, generator=gen), torch.randn(200, 8, generator=gen)
    assert update_norm(a, b) == pytest.approx((b.double() @ a.double()).norm().item(), rel=1e-12)
    assert update_norm(a, torch.zeros(200, 8)) == 0.0
