"""`--seed` covers the LoRA/QLoRA adapter init: the same `entrenar finetune` twice gives the same losses.

Before the fix A was drawn with ``kaiming_uniform_`` on torch's global RNG, before the run seeded it, so
two identical commands gave different losses from step 2 (10.59812 vs 10.59959 on the tiny base below).
The runs here are in one process, whose global RNG moves between them: exactly the state that exposed it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from entrenar import peft as ep
from entrenar.config import ModelConfig
from entrenar.formats import save_hf_dir
from entrenar.model import CausalLM
from tests.helpers.cli import run_cli
from tests.helpers.models import tiny_causal_lm, tiny_config

WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight")


def tiny_base_and_data(root: Path, seed: int = 0, boost: float = 4.0) -> tuple[Path, Path]:
    """A tiny HF dir with SmolLM2's tokenizer whose start is better than uniform (GUARD-INIT-LOSS passes):
    the embeddings of the data's tokens share one direction (of length `boost`: the smaller, the closer
    the start is to ln V), so the tied head favours them."""
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")  # reads the GGUF's tokenizer metadata only
    rows = [{"prompt": f"Say {w}.", "completion": f"{w}!"} for w in WORDS]
    ids: set[int] = set()
    for r in rows:
        ids.update(tok.encode_chat([{"role": "user", "content": r["prompt"]},
                                    {"role": "assistant", "content": r["completion"]}]).ids)
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, tie_word_embeddings=True,
                      max_position_embeddings=256)
    m = tiny_causal_lm(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    d = torch.randn(cfg.hidden_size, generator=gen)
    with torch.no_grad():
        for i in sorted(ids):
            m.model.embed_tokens.weight[i] = boost * d / d.norm() + 0.1 * torch.randn(cfg.hidden_size, generator=gen)
    base = save_hf_dir(m, root / f"base{seed}", tok)
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(base), data


@pytest.fixture(scope="module")
def base_and_data(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_base_and_data(tmp_path_factory.mktemp("seedbase"))


def finetune_losses(base: Path, data: Path, out: Path, mode: str, seed: int, capsys) -> list[float]:
    code, _, err = run_cli(["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--mode", mode,
                            "--steps", "3", "--batch-size", "2", "--seed", str(seed), "--no-preflight", "--json"], capsys)
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3
    return losses


@pytest.mark.parametrize("mode", ["full", "lora", "qlora"])
def test_same_seed_same_losses(base_and_data, tmp_path, capsys, mode):
    base, data = base_and_data
    first = finetune_losses(base, data, tmp_path / "a", mode, 5, capsys)
    torch.rand(1000)  # the global RNG moves between the runs, as it does between two processes' inits
    second = finetune_losses(base, data, tmp_path / "b", mode, 5, capsys)
    assert first == second


def test_different_seed_different_lora_init(base_and_data, tmp_path, capsys):
    base, data = base_and_data
    a = finetune_losses(base, data, tmp_path / "a", "lora", 5, capsys)
    b = finetune_losses(base, data, tmp_path / "b", "lora", 6, capsys)
    assert a != b
    note = json.loads((tmp_path / "a" / "final" / "entrenar_adapter.json").read_text())
    assert note["init_seed"] == 5


def test_unseeded_lora_init_mutation_is_caught(base_and_data, tmp_path, capsys, monkeypatch):
    """Mutation: apply_lora ignores the seed (A from the global RNG, the old behaviour) -> runs differ."""
    real = ep.apply_lora
    monkeypatch.setattr(ep, "apply_lora", lambda *a, seed=None, **kw: real(*a, seed=None, **kw))
    base, data = base_and_data
    first = finetune_losses(base, data, tmp_path / "a", "lora", 5, capsys)
    torch.rand(1000)
    second = finetune_losses(base, data, tmp_path / "b", "lora", 5, capsys)
    assert first != second


def test_apply_lora_seed_fixes_a_and_leaves_global_rng_alone():
    def a_of(seed):
        m = CausalLM(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                                 num_kv_heads=2))
        state = torch.get_rng_state()
        ep.apply_lora(m, rank=4, alpha=8, seed=seed)
        assert torch.equal(torch.get_rng_state(), state)  # a seeded init draws nothing from the global RNG
        return torch.cat([x.lora_A.weight.flatten() for x in ep.lora_modules(m).values()])

    a1 = a_of(11)
    assert torch.equal(a_of(11), a1) and not torch.equal(a_of(12), a1)
