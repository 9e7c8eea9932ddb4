"""The packaged real models: our GGUF loading vs transformers' GGUF loading of the same file
(fp32; final logits relL2 <= 1e-4 on three sequences incl. one of 300 tokens, plus every
layer's hidden state), and GGUF -> HF dir -> our load / transformers round trips.

Slow on the CPU (the transformers GGUF load of Qwen takes ~1-2 min): run under
``flock /tmp/entrenar-real.lock``.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from entrenar import cli
from entrenar.formats import gguf as ggufmod
from entrenar.formats import load_model
from entrenar.tensors import rel_l2
from entrenar.verify.trace import record_ours

pytestmark = pytest.mark.real_model

LOGITS_BOUND = 1e-4
HIDDEN_BOUND = 1e-4
SEQ_LENS = (7, 64, 300)


def _hf_from_gguf(path):
    """transformers' model of the GGUF, converted once per machine (tests/helpers/tokenizers.py)."""
    from tests.helpers.tokenizers import hf_gguf_model

    return hf_gguf_model(path)


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
        with torch.no_grad(), record_ours(ours, trace):  # verify's hooks: embed, layers.i, norm
            logits = ours(ids)
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
    if importlib.util.find_spec("entrenar.tokenizer") is not None:  # the GGUF vocabulary travels along
        assert doc["tokenizer"] and (out / "tokenizer.json").is_file()
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


# ---- an independent dequantizer: ggml's C reference (ggml-quants.c dequantize_row_*), in scalar
# Python, so the loader is not only checked against transformers (which calls the same gguf
# dequantizer we do).
def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, dtype=np.float16)[0])


def _deq_q8_0(blk: bytes) -> list[float]:
    d = _f16(blk[:2])
    return [d * q for q in np.frombuffer(blk[2:34], dtype=np.int8).tolist()]


def _deq_q4_1(blk: bytes) -> list[float]:
    d, m, qs = _f16(blk[:2]), _f16(blk[2:4]), blk[4:20]
    return [(q & 0x0F) * d + m for q in qs] + [(q >> 4) * d + m for q in qs]


def _deq_q5_0(blk: bytes) -> list[float]:
    d, qh, qs = _f16(blk[:2]), int.from_bytes(blk[2:6], "little"), blk[6:22]
    lo = [(((q & 0x0F) | (((qh >> j) << 4) & 0x10)) - 16) * d for j, q in enumerate(qs)]
    hi = [(((q >> 4) | ((qh >> (j + 12)) & 0x10)) - 16) * d for j, q in enumerate(qs)]
    return lo + hi


def _deq_q6_k(blk: bytes) -> list[float]:
    ql, qh = blk[:128], blk[128:192]
    sc = np.frombuffer(blk[192:208], dtype=np.int8).tolist()
    d = _f16(blk[208:210])
    y = [0.0] * 256
    for half in range(2):
        o, qlo, qho, so = 128 * half, 64 * half, 32 * half, 8 * half
        for l in range(32):
            s = l // 16
            q1 = ((ql[qlo + l] & 0xF) | (((qh[qho + l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[qlo + l + 32] & 0xF) | (((qh[qho + l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[qlo + l] >> 4) | (((qh[qho + l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[qlo + l + 32] >> 4) | (((qh[qho + l] >> 6) & 3) << 4)) - 32
            y[o + l] = d * sc[so + s] * q1
            y[o + l + 32] = d * sc[so + s + 2] * q2
            y[o + l + 64] = d * sc[so + s + 4] * q3
            y[o + l + 96] = d * sc[so + s + 6] * q4
    return y


def _deq_q4_k(blk: bytes) -> list[float]:
    d, dmin, scales, qs = _f16(blk[:2]), _f16(blk[2:4]), blk[4:16], blk[16:144]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))

    y = []
    for chunk in range(4):
        q = qs[32 * chunk: 32 * chunk + 32]
        s1, m1 = scale_min(2 * chunk)
        s2, m2 = scale_min(2 * chunk + 1)
        y += [d * s1 * (b & 0xF) - dmin * m1 for b in q]
        y += [d * s2 * (b >> 4) - dmin * m2 for b in q]
    return y


_REF = {"Q8_0": (_deq_q8_0, 32, 34), "Q4_1": (_deq_q4_1, 32, 20), "Q5_0": (_deq_q5_0, 32, 22),
        "Q6_K": (_deq_q6_k, 256, 210), "Q4_K": (_deq_q4_k, 256, 144)}


def _reference_rows(tensor, rows: int) -> np.ndarray:
    fn, _, nbytes = _REF[tensor.tensor_type.name]
    raw = np.asarray(tensor.data)  # [rows, bytes per row]
    out = []
    for r in range(rows):
        b = raw[r].tobytes()
        out.append([v for i in range(0, len(b), nbytes) for v in fn(b[i:i + nbytes])])
    return np.array(out, dtype=np.float64)


@pytest.mark.parametrize("which", ["smollm", "qwen"])
def test_dequantization_matches_ggml_reference(which, request):
    """Two rows of one tensor per quantization type: our loaded weights == ggml's C reference."""
    import gguf

    ours = request.getfixturevalue(f"{which}_model")
    reader = gguf.GGUFReader(request.getfixturevalue(f"{which}_path"))
    state = ours.state_dict()
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        # not llama's attn_q/k: their rows are permuted on load, so row r is not stored row r
        permuted = ours.cfg.architecture == "llama" and (".attn_q." in t.name or ".attn_k." in t.name)
        if kind in _REF and kind not in seen and not permuted:
            seen.add(kind)
            ref = _reference_rows(t, 2)
            got = state[ggufmod.hf_name(t.name)][:2].double().numpy()
            assert got.shape == ref.shape, t.name
            assert np.allclose(got, ref, rtol=1e-6, atol=1e-7), f"{t.name} ({kind}) differs from ggml reference"
    assert seen == set(ours.source["stored_dtypes"].values()) - {"F32"}
