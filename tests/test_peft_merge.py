"""`entrenar merge`: merged logits equal base+adapter; QLoRA merges onto the NF4 weights it trained on."""

from __future__ import annotations

import json

import pytest
import torch

from entrenar import cli
from entrenar import merge as em
from entrenar import peft as ep
from entrenar.formats import load_model, save_hf_dir
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.test_peft import IDS, randomize_adapters, rel, tiny_model


@pytest.fixture()
def base_dir(tmp_path):
    m = tiny_model()
    save_hf_dir(m, tmp_path / "base")
    return tmp_path / "base"


def _adapter(base_dir, out, quantize_nf4: bool, seed: int = 3):
    m = load_model(base_dir, dtype=torch.float32)
    ep.apply_lora(m, rank=4, alpha=8, quantize_nf4=quantize_nf4)
    randomize_adapters(m, seed)
    m.eval()
    with torch.no_grad():
        logits = m(IDS)
    ep.save_adapter(m, out, str(base_dir))
    return logits


def test_lora_merge_equals_base_plus_adapter(base_dir, tmp_path):
    expected = _adapter(base_dir, tmp_path / "ad", quantize_nf4=False)
    result = em.merge(base_dir, tmp_path / "ad", tmp_path / "merged")
    assert result["adapters_merged"] == 14
    merged = load_model(tmp_path / "merged", dtype=torch.float32)
    assert not any(isinstance(x, (ep.LoRALinear, ep.NF4Linear)) for x in merged.modules())
    with torch.no_grad():
        assert rel(merged(IDS), expected) <= 1e-5
    base = load_model(base_dir, dtype=torch.float32)
    with torch.no_grad():
        assert rel(base(IDS), expected) > 1e-3


def test_qlora_merge_onto_trained_equals_adapter_model(base_dir, tmp_path):
    expected = _adapter(base_dir, tmp_path / "ad", quantize_nf4=True)
    result = em.merge(base_dir, tmp_path / "ad", tmp_path / "merged", onto="trained")
    assert result["trained_against"] == "nf4" and result["logit_rel_l2_vs_trained"] <= 1e-5
    merged = load_model(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert rel(merged(IDS), expected) <= 1e-5


def test_qlora_merge_onto_original_reports_difference(base_dir, tmp_path):
    expected = _adapter(base_dir, tmp_path / "ad", quantize_nf4=True)
    result = em.merge(base_dir, tmp_path / "ad", tmp_path / "orig", onto="original")
    assert result["logit_rel_l2_vs_trained"] > 1e-3
    assert "NF4" in result["note"]
    merged = load_model(tmp_path / "orig", dtype=torch.float32)
    with torch.no_grad():
        assert rel(merged(IDS), expected) > 1e-3


def test_qlora_merge_onto_original_weights_mutation_is_caught(base_dir, tmp_path, monkeypatch):
    """Mutation: the default merge uses the 16-bit weights (a QLoRA adapter merged onto weights it never
    saw changes the model) -> the trained-merge check fires."""
    _adapter(base_dir, tmp_path / "ad", quantize_nf4=True)
    real = em.merge_in_place
    monkeypatch.setattr(em, "merge_in_place", lambda model, onto="trained", original=None, dtype=None:
                        real(model, "original", original, dtype))
    with pytest.raises(em.GuardError, match="GUARD-MERGE"):
        em.merge(base_dir, tmp_path / "ad", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_merged_dir_loads_in_transformers(base_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    expected = _adapter(base_dir, tmp_path / "ad", quantize_nf4=False)
    em.merge(base_dir, tmp_path / "ad", tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(hf(IDS).logits, expected) <= 1e-5


def test_merge_cli_exit_codes(base_dir, tmp_path, capsys):
    other = tiny_model(hidden_size=32, intermediate_size=48)
    ep.apply_lora(other, rank=4, alpha=8)
    ep.save_adapter(other, tmp_path / "other", "other")
    code = cli.main(["merge", "--base", str(base_dir), "--adapter", str(tmp_path / "other"),
                     "--out", str(tmp_path / "m"), "--json"])
    assert code == 2
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "lora_A.weight" in out["error"] or "lora_B.weight" in out["error"]
    assert not (tmp_path / "m").exists()
    _adapter(base_dir, tmp_path / "ad", quantize_nf4=True)
    code = cli.main(["merge", "--base", str(base_dir), "--adapter", str(tmp_path / "ad"),
                     "--out", str(tmp_path / "m2"), "--onto", "original", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] and out["logit_rel_l2_vs_trained"] > 1e-3


def test_generate_and_eval_accept_adapter(tmp_path, capsys):
    """`generate --adapter` and `eval --adapter` run base + adapter unmerged (tiny model, SmolLM2 tokenizer)."""
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")  # reads the GGUF's tokenizer metadata only
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                      tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(0)
    m = tiny_causal_lm(cfg, 0)
    base = save_hf_dir(m, tmp_path / "base", tok)
    ep.apply_lora(m, rank=4, alpha=8)
    randomize_adapters(m, std=2.0)
    ep.save_adapter(m, tmp_path / "ad", str(base))

    def run(argv):
        code = cli.main([*argv, "--json"])
        assert code == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    gen = ["generate", "--model", str(base), "--prompt", "Hello there", "--max-new-tokens", "6", "--device", "cpu"]
    plain, adapted = run(gen), run([*gen, "--adapter", str(tmp_path / "ad")])
    assert plain["token_ids"] != adapted["token_ids"]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "completion": f"{w}!"}) + "\n"
                            for w in ("one", "two", "three")))
    ev = ["eval", "--model", str(base), "--data", str(data), "--max-seq-len", "64", "--batch-size", "2"]
    assert run(ev)["loss"] != run([*ev, "--adapter", str(tmp_path / "ad")])["loss"]


def test_finetune_unknown_target_exits_2_listing_linears(tmp_path, capsys):
    from entrenar.config import ModelConfig
    from entrenar.model import CausalLM
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")  # reads the GGUF's tokenizer metadata only
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=256)
    base = save_hf_dir(CausalLM(cfg), tmp_path / "base", tok)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "completion": f"{w}!"}) + "\n"
                            for w in ("one", "two", "three")))
    out = tmp_path / "run"
    code = cli.main(["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--mode", "lora",
                     "--targets", "q_proj,attn.c_attn", "--steps", "1", "--batch-size", "1", "--no-preflight", "--json"])
    err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert code == 2 and "attn.c_attn" in err
    assert all(name in err for name in ep.DEFAULT_TARGETS)
    assert not out.exists()  # refused before the run directory is created


def test_generate_and_eval_adapter_on_wrong_base_exit_2(tmp_path, capsys):
    """`generate/eval --adapter` onto a same-shape base the adapter was not trained on: exit 2 naming both
    bases; `--force-base` runs it anyway (a warning on stderr)."""
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")  # reads the GGUF's tokenizer metadata only
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                      tie_word_embeddings=True, max_position_embeddings=256)
    bases = {}
    for name, seed in (("A", 0), ("B", 1)):
        m = tiny_causal_lm(cfg, seed)
        bases[name] = save_hf_dir(m, tmp_path / f"base-{name}", tok)
    m = load_model(bases["A"], dtype=torch.float32)
    ep.apply_lora(m, rank=4, alpha=8, seed=0)
    randomize_adapters(m, std=2.0)
    ep.save_adapter(m, tmp_path / "ad", str(bases["A"]))
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "completion": f"{w}!"}) + "\n"
                            for w in ("one", "two", "three")))
    gen = ["generate", "--model", str(bases["B"]), "--adapter", str(tmp_path / "ad"), "--prompt", "Hello",
           "--max-new-tokens", "3", "--device", "cpu", "--json"]
    ev = ["eval", "--model", str(bases["B"]), "--adapter", str(tmp_path / "ad"), "--data", str(data),
          "--max-seq-len", "64", "--batch-size", "2", "--json"]
    for argv in (gen, ev):
        code = cli.main(argv)
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert code == 2 and str(bases["A"]) in out["error"] and str(bases["B"]) in out["error"], out
        code = cli.main([*argv, "--force-base"])
        captured = capsys.readouterr()
        assert code == 0 and "warning: --force-base" in captured.err
