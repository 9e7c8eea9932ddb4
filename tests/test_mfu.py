"""MFU as metrics.jsonl reports it: the FLOPs per token against torch's own FLOP counter, and the record's
arithmetic (FLOPs per token x tokens/s / the card's peak). A wrong count here misstates every MFU the
project publishes (RESULTS.md, issue goals) without failing anything else."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from entrenar.config import preset
from entrenar.model import CausalLM
from entrenar.train import loop
from entrenar.train.config import TrainConfig
from entrenar.train.metrics import read_jsonl
from tests import test_train_loop as T
from tests.helpers.models import tiny_config


@pytest.mark.parametrize("name", ["llama-370m", "smollm2-135m", "qwen2.5-0.5b", "qwen2.5-coder-7b"])
def test_matmul_parameters_are_every_linear_and_the_head(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = CausalLM(cfg)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # the LM head is a matmul per token also when tied (then it is no Linear of its own but the embedding)
    tied_head = cfg.vocab_size * cfg.hidden_size if model.lm_head is None else 0
    assert cfg.matmul_parameters() == linears + tied_head


@pytest.mark.parametrize("arch,heads,kv", [("llama", 4, 4), ("qwen2", 4, 2)])
def test_flops_per_token_is_what_torch_counts_for_a_training_step(arch, heads, kv):
    cfg = tiny_config(arch, vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=heads, num_kv_heads=kv, head_dim=8, attention_bias=arch == "qwen2",
                      tie_word_embeddings=arch == "qwen2", max_position_embeddings=64)
    model = CausalLM(cfg, kernels="torch")
    model.init_weights(seed=0)
    batch, seq = 2, 24
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    # the math backend: attention as matmuls the counter sees, the full T x T square (the convention)
    with sdpa_kernel(SDPBackend.MATH), counter:
        loss_sum, n = model(ids, labels=ids)
        (loss_sum / n).backward()
    counted = counter.get_total_flops()
    assert counted == pytest.approx(cfg.flops_per_token(seq) * batch * seq, rel=1e-9)


def test_step_record_mfu_is_flops_per_token_times_tok_s_over_the_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "peak_flops", lambda device, dtype: 2.5e9)  # a CPU has no listed peak
    cfg = TrainConfig(steps=3, batch_size=2, seq_len=32, lr=1e-3, warmup=1, seed=5)
    model = T.tiny_model()
    tr = loop.build_trainer(model, T.ListLoader(T.make_samples(16), 2, seed=3),
                      T.ListLoader(T.make_samples(8, seed=99), 4), cfg, tmp_path, log=T.quiet)
    tr.fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for r in rows:
        assert r["mfu"] == pytest.approx(model.cfg.flops_per_token(32) * r["tok_s"] / 2.5e9, rel=1e-12)
