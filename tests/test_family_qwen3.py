"""Qwen3, the family added through families.py: transformers parity (logits and loss) through the production
loader, HF saving, GGUF export read back by us and run by llama.cpp (logits and greedy tokens vs `entrenar
generate`), verify's q_norm / k_norm ops, the family's config.json facts, and `pretrain --model tiny-qwen3` on
the CPU. Qwen3 = no Q/K/V bias, an RMSNorm over head_dim on q and k before RoPE, head_dim free of hidden/heads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from entrenar.config import ModelConfig, preset
from entrenar.errors import LoadError
from entrenar.formats import load_model, save_hf_dir
from entrenar.formats.gguf import load_gguf, open_reader
from entrenar.tensors import IGNORE_INDEX, rel_l2
from entrenar.tokenizer import load_tokenizer
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.test_export_gguf import (
    _run_json,
    llama_cpp,
    llama_cpp_greedy,
    llama_cpp_logits,
    llama_cpp_tokenize,
)
from tests.test_export_gguf import random_model as random_export_model
from tests.test_export_gguf import train_tokenizer as train_qwen2_split_tokenizer
from tests.test_parity_hf import PARITY_BOUND, sample_ids

# (overrides of conftest.TINY_BASE): head_dim 32 is not hidden / heads (64 / 4 = 16), as Qwen3-0.6B's 128 is not
# 1024 / 16; tied and untied heads; GQA and MHA; eps 1e-6 (Qwen3's) and 1e-5; theta 1e6 and 1e4.
CASES = {
    "tied-gqa-headdim32-eps1e-6-theta1e6": {"head_dim": 32, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                                            "rope_theta": 1e6, "num_key_value_heads": 2},
    "untied-mha-headdim16-eps1e-5-theta1e4": {"head_dim": 16, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
                                              "rope_theta": 1e4, "num_key_value_heads": 4},
    "untied-gqa4-headdim24": {"head_dim": 24, "num_attention_heads": 8, "num_key_value_heads": 2},
}


def _hf_loss(hf_model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(hf_model(ids, labels=ids).loss)  # transformers shifts the labels itself


def _our_loss(model, ids: torch.Tensor) -> float:
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    with torch.no_grad():
        loss_sum, n = model(ids, labels=labels)
    return float(loss_sum / n)


# ---- transformers parity -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_logits_and_loss_match_transformers(case, tiny_hf_dir):
    overrides = CASES[case]
    hf_model, path = tiny_hf_dir("qwen3", **overrides)
    ours = load_model(path)  # the production loader: config.json + safetensors
    cfg = ours.cfg
    assert cfg.architecture == "qwen3" and cfg.qk_norm and not cfg.attention_bias
    assert cfg.head_dim == overrides["head_dim"]
    assert cfg.rms_norm_eps == hf_model.config.rms_norm_eps
    assert cfg.rope_theta == hf_model.config.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert ours.model.layers[0].self_attn.q_norm.weight.shape == (cfg.head_dim,)
    for seq in (1, 7, 33):
        ids = sample_ids(cfg.vocab_size, seq=seq, seed=seq)
        with torch.no_grad():
            err = rel_l2(ours(ids), hf_model(ids).logits)
        print(f"qwen3 {case} seq {seq}: logits relL2 {err:.3e}")
        assert err <= PARITY_BOUND, f"logits relL2 {err:.3e} > {PARITY_BOUND:.0e} vs transformers"
    ids = sample_ids(cfg.vocab_size, seq=33, seed=5)
    theirs, mine = _hf_loss(hf_model, ids), _our_loss(ours, ids)
    print(f"qwen3 {case}: loss ours {mine:.7f} transformers {theirs:.7f}")
    assert abs(mine - theirs) <= PARITY_BOUND * theirs


def test_qwen3_saved_by_us_is_what_transformers_loads(tiny_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model, path = tiny_hf_dir("qwen3", head_dim=32, tie_word_embeddings=False)
    ours = load_model(path)
    out = save_hf_dir(ours, tmp_path / "saved")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3ForCausalLM"] and written["model_type"] == "qwen3"
    assert written["attention_bias"] is False and not [k for k in written if k.startswith("entrenar_")]
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = sample_ids(ours.cfg.vocab_size, seq=19)
    with torch.no_grad():
        assert rel_l2(back(ids).logits, hf_model(ids).logits) <= PARITY_BOUND


def test_qwen3_qk_norm_is_applied_before_rope(tiny_hf_dir, monkeypatch):
    """The order matters: the norm's per-dim weights do not commute with the rotation. Our forward with the norms
    moved after RoPE is far from transformers (what the MODEL-QK-NORM-BEFORE-ROPE mutation re-introduces)."""
    import entrenar.model as model_mod

    hf_model, path = tiny_hf_dir("qwen3", head_dim=32)
    ours = load_model(path)
    original = model_mod.Attention.forward

    def norms_after_rope(self, x, cos, sin, mask, ops, cache=None):
        rope = ops.rope

        def rope_then_norms(q, k, c, s, style):
            q, k = rope(q, k, c, s, style)
            return self.q_norm(q, ops), self.k_norm(k, ops)

        saved, self.cfg = self.cfg, self.cfg.replace(qk_norm=False)  # no norm before RoPE ...
        try:  # ... and both right after it
            return original(self, x, cos, sin, mask, dataclasses.replace(ops, rope=rope_then_norms), cache)
        finally:
            self.cfg = saved

    ids = sample_ids(ours.cfg.vocab_size, seq=33)
    monkeypatch.setattr(model_mod.Attention, "forward", norms_after_rope)
    with torch.no_grad():
        err = rel_l2(ours(ids), hf_model(ids).logits)
    assert err > 1e-2, err


# ---- the family's config.json facts ---------------------------------------------------------------------
def test_qwen3_config_json_facts():
    d = preset("tiny-qwen3").to_hf_dict()
    assert ModelConfig.from_hf_dict(d) == preset("tiny-qwen3")
    without_eps = {k: v for k, v in d.items() if k != "rms_norm_eps"}
    assert ModelConfig.from_hf_dict(without_eps).rms_norm_eps == 1e-6  # Qwen3Config's default, not LLaMA's 1e-5
    with pytest.raises(ValueError, match="o_proj"):
        ModelConfig.from_hf_dict({**d, "attention_bias": True})  # transformers' Qwen3 then biases o_proj too
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_dict({**d, "use_sliding_window": True})
    with pytest.raises(ValueError, match="qk_norm=false"):
        preset("tiny-qwen3").replace(qk_norm=False).to_hf_dict()
    # a LLaMA with qk-norm stays a llama (entrenar_qk_norm), as before Qwen3 existed
    assert preset("tiny").replace(qk_norm=True).to_hf_dict()["entrenar_qk_norm"] is True


def test_qwen3_checkpoint_and_config_disagreeing_is_guard_load(tiny_hf_dir):
    from entrenar.formats.hf import check_state

    _, path = tiny_hf_dir("qwen3", head_dim=32)
    model = load_model(path)
    state = dict(model.state_dict())
    without_norms = {k: v for k, v in state.items() if "q_norm" not in k}
    with pytest.raises(LoadError, match="q_norm"):
        check_state(model.cfg, without_norms, "qwen3")
    bias = {**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(model.cfg.num_heads * 32)}
    with pytest.raises(LoadError, match="attention_bias=false"):
        check_state(model.cfg, bias, "qwen3")


def test_qwen3_variants_llama_cpp_cannot_run_are_refused_with_the_family_that_can():
    """In GGUF the architecture alone says bias and qk-norm: a model between families is named its family, or refused."""
    from entrenar.errors import InputError
    from entrenar.formats.gguf_write import check_exportable

    qwen3 = tiny_config("qwen3")
    check_exportable(qwen3)
    with pytest.raises(InputError, match="qwen3 architecture requires.*architecture='llama'"):
        check_exportable(qwen3.replace(qk_norm=False))
    with pytest.raises(InputError, match="no llama.cpp architecture has them with qk-norm"):
        check_exportable(qwen3.replace(attention_bias=True))
    with pytest.raises(InputError, match="set architecture='qwen3'"):
        check_exportable(tiny_config("llama", qk_norm=True))


# ---- GGUF: our reader and llama.cpp ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 (head_dim 32, tied) saved with a Qwen2-split byte-level BPE (Qwen3's tokenizer splits as
    Qwen2's: llama.cpp's pre-tokenizer "qwen2"), every tensor random, logits peaked."""
    root = tmp_path_factory.mktemp("qwen3")
    tok_dir = train_qwen2_split_tokenizer(root / "tokenizer")
    tok = load_tokenizer(tok_dir)
    cfg = tiny_config("qwen3", vocab_size=len(tok) + 12, max_position_embeddings=512, bos_token_id=tok.bos_id,
                      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    return save_hf_dir(random_export_model(cfg, seed=7), root / "model", tokenizer=tok)


@pytest.fixture(scope="module")
def qwen3_ggufs(tmp_path_factory, qwen3_dir) -> dict[str, Path]:
    """`entrenar export gguf` of the tiny Qwen3, f32 and f16, through the CLI."""
    root = tmp_path_factory.mktemp("qwen3-gguf")
    out = {}
    for typ in ("f32", "f16"):
        out[typ] = root / f"qwen3-{typ}.gguf"
        r = _run_json(["export", "gguf", str(qwen3_dir), str(out[typ]), "--type", typ, "--json"])
        assert r["ok"], r
        assert r["architecture"] == "qwen3" and r["pre_tokenizer"] == "qwen2"
    return out


PROBE = torch.randint(0, 400, (1, 120), generator=torch.Generator().manual_seed(13))


def test_qwen3_gguf_round_trip_through_our_reader(qwen3_dir, qwen3_ggufs):
    src = load_model(qwen3_dir, dtype=torch.float32)
    reader = open_reader(qwen3_ggufs["f32"])
    assert reader.fields["general.architecture"] == "qwen3"
    assert reader.fields["qwen3.attention.key_length"] == 32 and reader.fields["qwen3.embedding_length"] == 64
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names
    assert not [n for n in names if n.endswith(".bias")] and "output.weight" not in names  # no bias, tied head
    cfg, state, _ = load_gguf(qwen3_ggufs["f32"])
    assert cfg == src.cfg.replace(extra={}, initializer_range=cfg.initializer_range)
    ref = src.state_dict()
    assert set(state) == set(ref) and all(torch.equal(state[k], v) for k, v in ref.items())  # q/k rows not permuted
    back = load_model(qwen3_ggufs["f32"], dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(back(PROBE), src(PROBE))


def test_qwen3_llama_cpp_logits_match_ours(qwen3_dir, qwen3_ggufs):
    """llama.cpp's qwen3 graph on our files vs our forward on the source weights (test_export_gguf's bounds)."""
    with torch.no_grad():
        ours = load_model(qwen3_dir, dtype=torch.float32)(PROBE)[0]
    ids = PROBE[0].tolist()
    for typ, bound in (("f32", 1e-4), ("f16", 1e-2)):
        theirs = llama_cpp_logits(llama_cpp(qwen3_ggufs[typ], f32_cache=typ == "f32"), ids)
        err = rel_l2(theirs, ours)
        print(f"qwen3 {typ}: llama.cpp vs ours logits relL2 {err:.3e}")
        assert err <= bound, (typ, err)


def test_qwen3_llama_cpp_greedy_equals_entrenar_generate(qwen3_dir, qwen3_ggufs):
    tok = load_tokenizer(qwen3_dir)
    llm = llama_cpp(qwen3_ggufs["f32"], f32_cache=True)
    for prompt in ("say a poem", "def add(a, b):"):
        ours = _run_json(["generate", "--model", str(qwen3_dir), "--prompt", prompt, "--chat", "--max-new-tokens",
                          "24", "--device", "cpu", "--json"])
        assert ours["ok"], ours
        text = tok.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True).text
        prompt_ids = llama_cpp_tokenize(llm, text)
        assert prompt_ids == tok.encode_rendered(text)
        theirs = llama_cpp_greedy(llm, prompt_ids, 24, tok.stop_ids)
        assert len(theirs) > 1 and theirs == ours["token_ids"], (prompt, theirs, ours["token_ids"])


# ---- verify: the bisection knows q_norm / k_norm ------------------------------------------------------------
@pytest.fixture(scope="module")
def probe():
    from entrenar.verify.probe import build_probe
    from tests.test_verify import SEQ_LEN, byte_tokenizer

    return build_probe(byte_tokenizer(), SEQ_LEN)


def tiny_qwen3(seed: int = 0):
    return tiny_causal_lm(tiny_config("qwen3", vocab_size=272, rope_theta=1e6), seed, norm_std=0.1)


def test_qwen3_verify_compares_q_norm_and_k_norm_against_transformers(probe, monkeypatch):
    from entrenar.verify import format_report, verify_model
    from entrenar.verify.trace import OP_ORDER, block_ops
    from tests.test_verify import FAST_OPS, fast_path, first, ops_of

    model = fast_path(monkeypatch, tiny_qwen3())
    assert block_ops(model.cfg) == (*OP_ORDER[:4], "q_norm", "k_norm", *OP_ORDER[4:])
    assert "q_norm" not in block_ops(tiny_config("llama"))
    for against in ("reference", "hf"):
        rep = verify_model(model, probe=probe, against=against, grads=against == "reference")
        assert rep["ok"], format_report(rep)
    # a defect at the MLP makes pass 2 list every op of block 0: q_norm and k_norm measured on both sides
    model = fast_path(monkeypatch, tiny_qwen3(), dataclasses.replace(
        FAST_OPS, swiglu=lambda g, u: torch.nn.functional.silu(g) * u * 1.01))
    rep = verify_model(model, probe=probe, against="hf", grads=False)
    ops = ops_of(rep)
    assert {"q_norm", "k_norm"} <= set(ops) and all(e["rel_l2"] is not None for e in ops.values()), ops
    assert ops["q_norm"]["ok"] and ops["k_norm"]["ok"] and first(rep) == "layers.0.act"


def _rms_norm_without_weight_on_heads(hidden: int):
    """A fast RMSNorm that drops the weight on rows other than the hidden size: only qk-norm is wrong."""
    from entrenar.kernels.rmsnorm import rms_norm_reference

    return lambda x, w, eps: rms_norm_reference(x, w if x.shape[-1] == hidden else torch.ones_like(w), eps)


@pytest.mark.parametrize("defect,op", [("qk-norm-weight", "layers.0.q_norm"), ("eps-1e-5", "layers.0.input_norm"),
                                        ("rope-pairs", "layers.0.q_rope")])
def test_qwen3_seeded_defects_are_named_and_stop_the_preflight(defect, op, probe, monkeypatch):
    """The family's facts are checked as the other families' are: eps (1e-6), RoPE pairing, and its own qk-norm."""
    from entrenar.errors import GuardError
    from entrenar.kernels.rmsnorm import rms_norm_reference
    from entrenar.kernels.rope import rope_reference
    from entrenar.verify import format_report, preflight, verify_model
    from tests.test_verify import FAST_OPS, fast_path, first

    model = tiny_qwen3()
    ops = {"qk-norm-weight": dataclasses.replace(FAST_OPS, rms_norm=_rms_norm_without_weight_on_heads(64)),
           "eps-1e-5": dataclasses.replace(FAST_OPS, rms_norm=lambda x, w, eps: rms_norm_reference(x, w, 1e-5)),
           "rope-pairs": dataclasses.replace(FAST_OPS, rope=lambda q, k, c, s, style: rope_reference(
               q, k, c, s, "gptj" if style == "neox" else "neox"))}[defect]
    rep = verify_model(fast_path(monkeypatch, model, ops), probe=probe, grads=False)
    assert first(rep) == op, format_report(rep)
    if defect == "qk-norm-weight":
        assert "qk-norm" in rep["first_divergent"]["hint"]
    from tests.test_verify import byte_tokenizer

    with pytest.raises(GuardError) as e:
        preflight(model, byte_tokenizer(), "cpu", "fp32", "triton")
    assert e.value.guard_id == "GUARD-PARITY" and op in str(e.value)


# ---- pretrain end to end on the CPU -------------------------------------------------------------------------
def test_pretrain_tiny_qwen3_end_to_end_on_cpu(tmp_path, capsys):
    """`pretrain --model tiny-qwen3` with the parity preflight on: trains, and final/ is a Qwen3 transformers
    loads with our logits."""
    from entrenar.data.corpus import pack
    from tests.test_train_cli import ByteTokenizer, main

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(24):
        (docs / f"d{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox. " * (3 + i % 4))
    pack([str(docs)], ByteTokenizer(), tmp_path / "shards", val_fraction=0.25, seed=1)
    run = tmp_path / "run"
    code, result, err = main(["pretrain", "--model", "tiny-qwen3", "--data", str(tmp_path / "shards"), "--out",
                              str(run), "--steps", "6", "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3",
                              "--warmup", "1", "--eval-batches", "2", "--json"], capsys)
    assert code == 0 and result["ok"], err
    assert json.loads((run / "preflight.json").read_text())["verify"]["ok"]
    written = json.loads((run / "final" / "config.json").read_text())
    assert written["model_type"] == "qwen3" and written["head_dim"] == 32 and written["vocab_size"] == 320
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    from transformers import AutoModelForCausalLM

    ours = load_model(run / "final", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(run / "final"), dtype=torch.float32).eval()
    ids = torch.randint(0, 258, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(ours(ids), hf(ids).logits) <= PARITY_BOUND
