"""`--lr auto` for LoRA at rank 256 on the `tiny` preset through the one training loop.

A tiny-preset model (vocab cut to 128 so 200 steps take seconds) is first trained in full on a
synthetic language (affine rules t[i+1] = a t[i] + b mod V); then a rank-256 LoRA (alpha = 2r, the
finetune default) continues on the same language at the auto rate for 200 steps: no GUARD-SPIKE, no
GUARD-NONFINITE, loss below its start. At 30x the auto rate the first update throws the model off its
minimum (loss x3 at step 1) -- the divergence --lr auto exists to avoid -- and GUARD-SPIKE says so.
"""

from __future__ import annotations

import json

import pytest
import torch

from entrenar import peft as ep
from entrenar.config import preset
from entrenar.model import CausalLM
from entrenar.train.loop import TrainConfig, train

V, T, B = 128, 32, 8
RULES = [[1, 1], [1, 3]]


class RuleLoader:
    """Deterministic batches of affine-rule sequences; sample i of a batch follows rule i % len(rules)."""

    def __init__(self, seed: int):
        self.seed, self.i, self.epoch = seed, 0, 0
        self.rules = torch.tensor(RULES)

    def _batch(self, i: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 100003 + i)
        r = self.rules[torch.arange(B) % len(self.rules)]
        x = torch.empty(B, T + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, V, (B,), generator=gen)
        for t in range(T):
            x[:, t + 1] = (r[:, 0] * x[:, t] + r[:, 1]) % V
        return {"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous(), "sample_ids": [i]}

    def next_batch(self) -> dict:
        self.i += 1
        return self._batch(self.i)

    def iter_epoch(self):
        for i in range(2):
            yield self._batch(10**6 + i)

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, sd: dict) -> None:
        self.i = sd["i"]


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead on a shared 2-core box
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pretrained_state(one_thread, tmp_path_factory):
    cfg = preset("tiny").replace(vocab_size=V)
    torch.manual_seed(0)
    m = CausalLM(cfg)
    m.init_weights(0)
    tc = TrainConfig(steps=150, batch_size=B, seq_len=T, lr=3e-3, warmup=10, weight_decay=0.0, seed=0)
    train(m, RuleLoader(0), None, tc, tmp_path_factory.mktemp("pre"), log=lambda s: None)
    return cfg, {k: v.clone() for k, v in m.state_dict().items()}


def _lora_run(pretrained_state, tmp_path, mult: float, steps: int = 200) -> tuple[list[dict], dict]:
    cfg, state = pretrained_state
    m = CausalLM(cfg)
    m.load_state_dict(state)
    ep.apply_lora(m, rank=256, alpha=512)
    lr, reason = ep.auto_lr("lora", 256, False)
    assert lr == pytest.approx(5e-5), reason
    tc = TrainConfig(steps=steps, batch_size=B, seq_len=T, lr=lr * mult, warmup=0, weight_decay=0.0, seed=0,
                     on_spike="warn", on_nonfinite="stop")
    result = train(m, RuleLoader(1), None, tc, tmp_path, log=lambda s: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return rows, result


def test_auto_lr_rank256_trains_without_guards(pretrained_state, tmp_path):
    rows, result = _lora_run(pretrained_state, tmp_path, 1.0)
    assert len(rows) == 200
    assert result["counters"]["spikes"] == 0 and result["counters"]["nonfinite_skipped"] == 0
    assert not any(r["skipped"] for r in rows)
    first = rows[0]["loss"]
    last10 = sum(r["loss"] for r in rows[-10:]) / 10
    assert last10 < first
    assert max(r["loss"] for r in rows) < 1.5 * first  # never thrown off the pretrained minimum


def test_auto_lr_x30_throws_the_model_off(pretrained_state, tmp_path):
    """30x the auto rate: the first LoRA step more than doubles the loss of the pretrained model."""
    rows, _ = _lora_run(pretrained_state, tmp_path, 30.0, steps=20)
    assert max(r["loss"] for r in rows[1:4]) > 2.0 * rows[0]["loss"]


def test_auto_lr_x30_trips_a_guard(pretrained_state, tmp_path):
    """GUARD-SPIKE's early phase (loss vs the run's starting loss, before 16 steps of history) sees it."""
    _, result = _lora_run(pretrained_state, tmp_path, 30.0)
    assert result["counters"]["spikes"] > 0 or result["counters"]["nonfinite_skipped"] > 0


def test_auto_lr_printed_at_ranks_8_64_256(capsys):
    for r in (8, 64, 256):
        lr, reason = ep.auto_lr("lora", r, False)
        print(f"rank {r}: {lr:.3g} -- {reason}")
    out = capsys.readouterr().out
    assert "rank 8: 0.0002" in out and "rank 64: 0.0001" in out and "rank 256: 5e-05" in out


def test_qlora_resume_is_bit_exact(pretrained_state, tmp_path):
    """QLoRA (NF4 base re-quantized on resume, dropout on): 6 steps == 3 steps + resume for 3 more."""
    import shutil

    from safetensors.torch import load_file

    cfg, state = pretrained_state

    def model():
        m = CausalLM(cfg)
        m.load_state_dict(state)
        return ep.apply_lora(m, rank=8, alpha=16, dropout=0.1, quantize_nf4=True)

    tc = TrainConfig(steps=6, batch_size=B, seq_len=T, lr=1e-3, warmup=0, weight_decay=0.0, seed=0, save_every=3)
    run = tmp_path / "run"
    train(model(), RuleLoader(1), None, tc, run, save_final=lambda m, d: ep.save_adapter(m, d, "tiny"),
          log=lambda s: None)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed, symlinks=True)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-0000006")
    (resumed / "checkpoints" / "latest").unlink()
    torch.manual_seed(123)  # a different fresh A: the checkpoint must overwrite it
    train(model(), RuleLoader(1), None, tc, resumed, resume="auto",
          save_final=lambda m, d: ep.save_adapter(m, d, "tiny"), log=lambda s: None)
    a = load_file(str(run / "final" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((run / "final" / "entrenar_adapter.json").read_text())["trained_against"] == "nf4"
