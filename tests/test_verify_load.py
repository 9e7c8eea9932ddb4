"""`entrenar verify` end to end on a tiny HF directory with BF16 weights.

The sixth planted defect, BF16 weights decoded as F16 at load, lives in the loader, so it is
invisible against our own float64 reference (same load) and caught against transformers, which
loads the file itself: first divergence at the embedding.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import entrenar.formats.hf as hf_format
from entrenar.cli import main
from tests.test_verify import byte_tokenizer


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen2-bf16")
    cfg = transformers.Qwen2Config(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, max_position_embeddings=1024)
    model = transformers.Qwen2ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)  # every tensor drawn here: the fixture is the same on every run
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.02 * noise)
    model.to(torch.bfloat16).save_pretrained(d)
    byte_tokenizer().save(str(d / "tokenizer.json"))
    return d


def _run(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main(argv + ["--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1], parse_constant=lambda c: pytest.fail(f"--json emitted {c}: not strict JSON"))


def _decode_bf16_as_f16(monkeypatch):
    """A loader bug seen before: BF16 tensors tagged F16, so their bits are read as IEEE half."""
    original = hf_format.read_safetensors

    def misread(path):
        return {k: (v.view(torch.float16) if v.dtype == torch.bfloat16 else v) for k, v in original(path).items()}

    monkeypatch.setattr(hf_format, "read_safetensors", misread)


def test_verify_bf16_dir_passes_against_hf_and_reference(bf16_dir, capsys):
    for against in ("hf", "reference"):
        code, rep = _run(capsys, ["verify", "--model", str(bf16_dir), "--against", against, "--seq-len", "64"])
        assert code == 0 and rep["ok"] and rep["first_divergent"] is None, rep
        assert [s["tokens"] < 32 for s in rep["sequences"]] == [True, False]
        assert rep["sequences"][1]["tokens"] == 64
        assert rep["grads"]["ok"]


def test_bf16_decoded_as_f16_is_caught_against_hf_at_embedding(bf16_dir, capsys, monkeypatch):
    _decode_bf16_as_f16(monkeypatch)
    code, rep = _run(capsys, ["verify", "--model", str(bf16_dir), "--against", "hf", "--seq-len", "64"])
    assert code == 1 and not rep["ok"]
    assert rep["first_divergent"]["name"] == "embed"
    assert "load" in rep["first_divergent"]["hint"]
    # Against our own reference the misread embedding agrees with itself exactly (the reference
    # shares the load): this is why `--against hf` exists.
    code, rep = _run(capsys, ["verify", "--model", str(bf16_dir), "--against", "reference", "--seq-len", "64",
                              "--no-grads"])
    assert all(s["layers"][0]["name"] == "embed" and s["layers"][0]["rel_l2"] == 0.0 for s in rep["sequences"])


def test_verify_table_and_bad_input(bf16_dir, capsys):
    code = main(["verify", "--model", str(bf16_dir), "--seq-len", "40", "--no-grads"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and "layers.1" in out and "logits relL2" in out
    assert main(["verify", "--model", str(bf16_dir), "--seq-len", "8"]) == 2


def test_verify_with_lora_adapter_against_reference_and_peft(bf16_dir, tmp_path, capsys):
    """--adapter: our LoRA on the path under test; transformers + peft (merged) as the oracle."""
    from entrenar.formats import load_model
    from entrenar.peft import apply_lora, lora_modules, save_adapter

    model = apply_lora(load_model(str(bf16_dir), dtype=torch.float32), rank=4, alpha=8.0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_modules(model).values():  # B = 0 would make the adapter a no-op
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.05)
    adapter = save_adapter(model, tmp_path / "adapter", str(bf16_dir))
    code, rep = _run(capsys, ["verify", "--model", str(bf16_dir), "--adapter", str(adapter), "--seq-len", "48"])
    assert code == 0 and rep["ok"], rep["first_divergent"]
    assert rep["grads"]["groups"] and not rep["grads"]["missing_in_test"]
    code, rep = _run(capsys, ["verify", "--model", str(bf16_dir), "--adapter", str(adapter), "--seq-len", "48",
                              "--against", "hf"])
    assert code == 0 and rep["ok"], rep["first_divergent"]
    # the adapter matters: without it the same model disagrees with transformers + adapter
    from peft import PeftModel

    from entrenar.verify import verify_model
    from entrenar.verify.bisect import hf_from_source
    from entrenar.verify.probe import build_probe

    hf = PeftModel.from_pretrained(hf_from_source(bf16_dir), str(adapter)).merge_and_unload()
    rep = verify_model(load_model(str(bf16_dir), dtype=torch.float32), probe=build_probe(byte_tokenizer(), 48),
                       against="hf", hf_model=hf, grads=False)
    assert not rep["ok"] and rep["first_divergent"]["name"].startswith("layers.0.")


def test_json_line_is_strict_with_nonfinite_numbers(capsys, monkeypatch):
    """A relL2 of inf/nan (weights decoded to garbage) still prints strict JSON (no Infinity/NaN)."""
    from entrenar.cli import verify as commands

    report = {"ok": False, "exit_code": 1, "sequences": [{"logits_rel_l2": float("nan")}],
              "first_divergent": {"name": "embed", "rel_l2": float("inf"), "bound": 1e-5}}
    monkeypatch.setattr(commands, "run_verify", lambda *a, **k: report)
    code, rep = _run(capsys, ["verify", "--model", "whatever"])
    assert code == 1 and rep["first_divergent"]["rel_l2"] is None and rep["sequences"][0]["logits_rel_l2"] is None
    assert rep["nonfinite"] == ["first_divergent.rel_l2", "sequences[0].logits_rel_l2"]  # docs/design.md


def test_verify_against_hf_prints_no_third_party_noise(bf16_dir):
    """Issue 18: torchao's 'Failed to load .../torchao/_C_*.so', torch's _pytree Enum deprecation and the
    'Loading weights' bar leaked into `verify --against hf` (a fresh process: they print on first import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    proc = subprocess.run([sys.executable, "-m", "entrenar", "verify", "--model", str(bf16_dir), "--against", "hf",
                           "--seq-len", "32", "--no-grads"], check=False, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(src)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "PASS" in proc.stdout
    for noise in ("torchao", "_pytree", "Failed to load", "register_constant", "Loading weights", "Warning"):
        assert noise not in proc.stderr, proc.stderr


def test_third_party_filter_is_narrow(caplog):
    """Only the known records are dropped: another torchao message, or another warning, still shows."""
    import logging
    import warnings

    from entrenar.verify.quiet import quiet_third_party

    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_third_party():
            _log_and_warn_noise()
    assert [r.getMessage() for r in caplog.records] == ["torchao: a real problem"]
    assert [str(w.message) for w in seen] == ["something else is deprecated"]
    logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so")  # outside: not filtered
    assert caplog.records[-1].getMessage().startswith("Failed to load")


def _log_and_warn_noise() -> None:
    import logging
    import warnings

    logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    logging.getLogger("torchao").warning("torchao: a real problem")
    logging.getLogger("torch.utils._pytree").warning("<enum 'E'> is an Enum subclass and is now natively "
                                                     "supported by torch.compile as an opaque value type.")
    warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
    warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
