"""`verify` on the packaged pretrained models: fp32 passes against the float64 reference and transformers."""

from __future__ import annotations

import pytest

from entrenar.verify import format_report, verify_model
from entrenar.verify.bisect import hf_from_source
from entrenar.verify.probe import build_probe
from tests.helpers.tokenizers import hf_gguf_model

PACKAGED = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]


MODEL_FIXTURES = {"smollm2-135m-instruct": "smollm_model", "qwen2.5-coder-0.5b-instruct": "qwen_model"}


@pytest.mark.real_model
@pytest.mark.parametrize("name", PACKAGED)
def test_verify_packaged_fp32(name, request):
    from entrenar.formats import resolve_model
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(name)
    model = request.getfixturevalue(MODEL_FIXTURES[name])  # conftest's shared fp32 copy; verify leaves it as is
    probe = build_probe(tok, 64)
    assert probe[0].length < 32 and probe[1].length == 64
    grads = name.startswith("smollm")  # the backward of the small model only: CI time (qwen fp64 backward ~1 min)
    rep = verify_model(model, probe=probe, against="reference", grads=grads, meta={"model": name})
    assert rep["ok"] and rep["exit_code"] == 0, format_report(rep)
    if grads:
        assert rep["grads"]["ok"] and len(rep["grads"]["groups"]) == 3 * model.cfg.num_layers + 2 + (
            model.lm_head is not None)
    for s in rep["sequences"]:
        assert s["ce_ref"] < 8.0  # a real pretrained model on real text, far below ln(vocab) ~ 11
    # transformers loading the GGUF itself (hf_from_source: what `verify --against hf MODEL.gguf` runs) on SmolLM2;
    # Qwen's is the same load's converted copy, cached per machine (~80 s of numpy dequantizing less in CI)
    hf = hf_from_source(resolve_model(name)) if grads else hf_gguf_model(resolve_model(name), fresh=True)
    rep = verify_model(model, probe=probe, against="hf", hf_model=hf, grads=False, meta={"model": name})
    assert rep["ok"] and rep["exit_code"] == 0, format_report(rep)
    assert all(e["rel_l2"] is not None for s in rep["sequences"] for e in s["layers"])
