"""Real-model training on the CPU (run under `flock /tmp/entrenar-real.lock`).

- full fine-tune of smollm2-135m-instruct on sft-from-code data from the standard library at
  --max-seq-len 512 for 15 steps of one sample (6 samples: the last 5 steps see them a second and third
  time): step-0 eval loss < ln V, the last 5 train losses average at most half the first 5 (a learning rate
  zeroed after the 3 warm-up steps: 0.68 of it), no guard fires (GUARD-QA's decoding on a real fine-tune:
  tests/test_qlora_long_system_real.py);
- pretraining the `tiny` preset from scratch on standard-library shards for 200 steps brings the
  loss below 60% of ln(vocab).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from entrenar import cli
from entrenar.train.metrics import read_jsonl

pytestmark = pytest.mark.real_model
STDLIB = Path(os.__file__).parent


def run_cli(argv: list[str], capsys) -> dict:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def short_sft(tmp_path_factory) -> tuple[Path, Path]:
    """Docstring -> function pairs from json/ and email/, only short ones (fast on 2 cores)."""
    from entrenar.data.from_code import sft_from_code

    d = tmp_path_factory.mktemp("sft")
    sft_from_code([str(STDLIB / "json"), str(STDLIB / "email")], d / "all.jsonl")
    rows = [json.loads(line) for line in (d / "all.jsonl").read_text().splitlines()]
    short = [r for r in rows if sum(len(m["content"]) for m in r["messages"]) <= 420]
    assert len(short) >= 8, len(short)
    train, val = short[:6], short[6:8]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (d / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))
    return d / "train.jsonl", d / "val.jsonl"


def test_finetune_smollm2_15_steps_loss_falls(tmp_path, short_sft, capsys):
    train, val = short_sft
    out = tmp_path / "run"
    result = run_cli(["finetune", "--model", "smollm2-135m-instruct", "--data", str(train), "--val", str(val),
                      "--out", str(out), "--mode", "full", "--max-seq-len", "512", "--steps", "15",
                      "--batch-size", "1", "--lr", "5e-5", "--warmup", "3", "--eval-batches", "0",
                      "--keep", "1", "--on-qa-fail", "off", "--json"], capsys)
    ln_v = math.log(49152)
    assert result["eval_loss_start"] < ln_v
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert len(losses) == 15
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"\nfinetune smollm2: step-0 eval {result['eval_loss_start']:.4f}, final eval {result['eval_loss_final']:.4f}, "
          f"train first5 {first:.4f} last5 {last:.4f}, {result['tok_s']:.0f} tok/s")
    # measured: 1.351 -> 0.419 (0.31); with no learning after warm-up 1.356 -> 0.918 (0.68), which the 30-step
    # test's ">= 10% lower" let pass (0.999 -> 0.791). Batches of 2 of 16 samples: 0.29 vs 0.61, at twice the time
    assert last <= 0.5 * first, (first, last)
    assert result["counters"] == {"nonfinite_skipped": 0, "spike_skipped": 0, "zero_loss_samples": 0,
                                  "spikes": 0}
    assert result["eval_loss_final"] < result["eval_loss_start"]
    pre = json.loads((out / "preflight.json").read_text())
    assert pre["verify"]["ok"] is True and pre["step0"]["eval"]["loss"] < ln_v
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()


def test_pretrain_tiny_from_scratch_200_steps(tmp_path, capsys):
    shards = tmp_path / "shards"
    from entrenar.data.corpus import pack
    from entrenar.tokenizer import load_tokenizer

    # json/ alone (~12k tokens): 200 steps of 4 x 32 tokens see it about twice (8 x 32, twice the time, ended
    # at eval 6.24, this at 6.17)
    pack([str(STDLIB / "json")], load_tokenizer("smollm2-135m-instruct"), shards,
         val_fraction=0.1, seed=0, tokenizer_spec="smollm2-135m-instruct")
    out = tmp_path / "run"
    result = run_cli(["pretrain", "--model", "tiny", "--data", str(shards), "--out", str(out), "--steps", "200",
                      "--seq-len", "32", "--batch-size", "4", "--lr", "1.5e-2", "--warmup", "20",
                      "--eval-batches", "4", "--no-preflight", "--json"], capsys)
    ln_v = math.log(49152)
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert losses[0] > 0.95 * ln_v  # a random init starts at the uniform guess
    print(f"\npretrain tiny: loss {losses[0]:.4f} -> last10 {sum(losses[-10:]) / 10:.4f} (0.6 ln V = {0.6 * ln_v:.4f}), "
          f"eval {result['eval_loss_final']:.4f}")
    assert sum(losses[-10:]) / 10 < 0.6 * ln_v, losses[-10:]
    assert result["eval_loss_final"] < 0.6 * ln_v
