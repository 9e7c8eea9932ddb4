"""The packaged real models: our GGUF loading vs transformers' GGUF loading of the same file
(fp32; final logits relL2 <= 1e-4 on three sequences incl. one of 300 tokens, plus every
layer's hidden state), and GGUF -> HF dir -> our load / transformers round trips.

Slow on the CPU (the transformers GGUF load of Qwen takes ~1-2 min): run under
``flock /tmp/entrenar-real.lock``.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import rel_l2

from entrenar import cli
from entrenar.formats import load_model

pytestmark = pytest.mark.real_model

LOGITS_BOUND = 1e-4
HIDDEN_BOUND = 1e-4
SEQ_LENS = (7, 64, 300)


def _hf_from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_smollm(smollm_path):
    return _hf_from_gguf(smollm_path)


@pytest.fixture(scope="module")
def hf_qwen(qwen_path):
    return _hf_from_gguf(qwen_path)


def _sequences(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, min(vocab, 32000), (1, n), generator=gen) for n in SEQ_LENS]


@pytest.mark.parametrize("which", ["smollm", "qwen"])
def test_packaged_parity_vs_transformers_gguf(which, request):
    ours = request.getfixturevalue(f"{which}_model")
    theirs = request.getfixturevalue(f"hf_{which}")
    cfg, hc = ours.cfg, theirs.config
    assert cfg.vocab_size == hc.vocab_size and cfg.num_layers == hc.num_hidden_layers
    assert cfg.tie_word_embeddings == hc.tie_word_embeddings
    assert cfg.rope_theta == hc.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == pytest.approx(hc.rms_norm_eps, rel=1e-7)  # GGUF stores float32
    if which == "qwen":
        assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.rms_norm_eps == 1e-6
    L = cfg.num_layers
    report = []
    for ids in _sequences(cfg.vocab_size):
        trace: dict = {}
        with torch.no_grad():
            logits = ours(ids, trace=trace)
            out = theirs(ids, output_hidden_states=True)
        hs = out.hidden_states  # embeddings, after each layer; the last one after the final norm
        layer_errs = [rel_l2(trace[f"layers.{i}"], hs[i + 1]) for i in range(L - 1)]
        layer_errs.append(rel_l2(trace["norm"], hs[L]))
        logit_err = rel_l2(logits, out.logits)
        report.append({"seq": ids.shape[1], "logits": logit_err, "max_layer": max(layer_errs)})
        assert rel_l2(trace["embed"], hs[0]) <= HIDDEN_BOUND
        worst = max(range(L), key=lambda i: layer_errs[i])
        assert layer_errs[worst] <= HIDDEN_BOUND, f"seq {ids.shape[1]}: layer {worst} relL2 {layer_errs[worst]:.2e}"
        assert logit_err <= LOGITS_BOUND, f"seq {ids.shape[1]}: logits relL2 {logit_err:.2e}"
    print(f"\n{which} parity vs transformers GGUF loader: {json.dumps(report)}")


def test_gguf_to_hf_dir_roundtrip(smollm_model, smollm_path, tmp_path, capsys):
    """GGUF -> `entrenar convert` -> our load (bit-identical logits) and transformers (same logits)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "smollm-hf"
    assert cli.main(["convert", str(smollm_path), str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["ok"] and doc["dtype"] == ["float32"]
    ids = _sequences(smollm_model.cfg.vocab_size)[1]
    with torch.no_grad():
        ref = smollm_model(ids)
        again = load_model(out)
        assert torch.equal(again(ids), ref)
        del again
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert rel_l2(theirs(ids).logits, ref) <= 1e-5


def test_packaged_stored_types(smollm_model, qwen_model):
    """What `inspect` shows for the packaged files: the quantization types the loader must handle."""
    assert set(smollm_model.source["stored_dtypes"].values()) == {"F32", "Q4_1", "Q8_0"}
    assert set(qwen_model.source["stored_dtypes"].values()) == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert smollm_model.source["stored_dtypes"]["model.embed_tokens.weight"] == "Q8_0"
    assert qwen_model.source["stored_dtypes"]["lm_head.weight"] == "Q8_0"
