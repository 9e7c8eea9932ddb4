"""`entrenar finetune --objective dpo|ipo|dpo-norm` end to end on the CPU: a tiny model with the SmolLM2 tokenizer
(tests/test_distributed.py's "pretrained" one), preference rows counting in words (chosen right, rejected with
two words swapped).

  - LoRA/QLoRA/full runs write the preference metrics per step and on eval, step 0 is ln 2 exactly;
  - GUARD-INIT-LOSS fires when the reference is not the starting policy (adapters not zero at the start);
  - chosen == rejected rows exit 2 naming file:line; --pack is refused;
  - resume: stopped at step 3 and resumed, metrics equal the uninterrupted run bit for bit;
  - 2 gloo ranks (DDP for LoRA, FSDP2 for full) == one process on the same global batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from entrenar.fileio import read_jsonl
from tests.helpers.cli import run_cli, run_cli_process
from tests.test_distributed import _rewind, base_model, close, ok, sft_data, weights, worst_rel  # noqa: F401

WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")
STEPS = 6


def count_row(i: int) -> dict:
    n = i % 10 + 3
    words = [WORDS[(i % 5 + k) % 12] for k in range(n)]
    wrong = list(words)
    j = i % (n - 1)
    wrong[j], wrong[j + 1] = wrong[j + 1], wrong[j]
    return {"prompt": f"Count to {n} in words, starting at {WORDS[i % 5]}.", "chosen": " ".join(words) + ".",
            "rejected": " ".join(wrong) + "."}


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pref") / "pairs.jsonl"
    path.write_text("".join(json.dumps(count_row(i)) + "\n" for i in range(24)))
    return path


def dpo_args(model: Path, data: Path, out: Path, batch: int = 4, extra: tuple = ()) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", str(STEPS),
            "--batch-size", str(batch), "--grad-accum", "2", "--max-seq-len", "64", "--lr", "1e-3",
            "--warmup", "1", "--val-fraction", "0.25", "--eval-every", "3", "--eval-batches", "0",
            "--save-every", "3", "--seed", "3", "--device", "cpu", "--no-preflight", "--json",
            "--objective", "dpo", "--mode", "lora", "--rank", "4", *extra]


def records(path: Path) -> list[dict]:
    return [r for _, r in read_jsonl(path)]


PREF_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_model, pref_data) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("dpo-lora") / "run"
    code, result, err = run_cli(dpo_args(base_model, pref_data, out), capture=True)
    assert code == 0, (result, err)
    return out


def test_lora_dpo_logs_the_preference_metrics_and_starts_at_ln2(lora_run):
    steps = records(lora_run / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert all(k in r and math.isfinite(r[k]) for k in PREF_KEYS), r
        assert 0.0 <= r["rewards/accuracies"] <= 1.0 and r["loss_tokens"] == 8  # pairs: 4 x accumulation 2
    evals = records(lora_run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3, 6] and all("rewards/accuracies" in e for e in evals)
    assert evals[0]["loss"] == pytest.approx(math.log(2), abs=1e-7) and evals[0]["rewards/margins"] == 0.0
    step0 = json.loads((lora_run / "preflight.json").read_text())["step0"]
    assert step0["ln_vocab"] == pytest.approx(math.log(2))
    assert evals[-1]["loss"] < evals[0]["loss"]  # it learns the pairs
    report = json.loads((lora_run / "data_report.json").read_text())
    assert report["kind"] == "preference" and report["train"]["kept"] == 24
    assert (lora_run / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("objective,mode", [("ipo", "full"), ("dpo-norm", "qlora")])
def test_other_objectives_and_modes_run_and_start_at_their_start_value(objective, mode, tmp_path, base_model,  # noqa: F811
                                                                       pref_data, capsys):
    out = tmp_path / "run"
    extra = ("--objective", objective, "--mode", mode, "--steps", "2", "--beta", "0.5")
    code, result, err = run_cli(dpo_args(base_model, pref_data, out, extra=extra), capsys)
    assert code == 0, (result, err)
    ev0 = records(out / "eval.jsonl")[0]
    start = 1.0 if objective == "ipo" else math.log(2)  # ipo: (1 / (2 beta))^2 at beta 0.5
    assert ev0["loss"] == pytest.approx(start, rel=1e-6)
    assert "GUARD-INIT-LOSS ok" in err
    lines = [ln for ln in err.splitlines() if ln.startswith("step ") and "/2 " in ln]
    steps = records(out / "metrics.jsonl")
    assert len(lines) == len(steps) == 2, err
    for line, r in zip(lines, steps, strict=True):  # the progress line carries the step's preference means
        assert f"acc {r['rewards/accuracies']:.3f}" in line and f"margin {r['rewards/margins']:.3f}" in line, line


def test_a_reference_that_is_not_the_start_stops_with_guard_init_loss(tmp_path, base_model, pref_data,  # noqa: F811
                                                                      monkeypatch):
    """Adapters that are not zero at step 0 (a trained adapter continued as a new run, a wrong init): the
    adapters-off reference is then not the starting policy, and every reward measures that difference."""
    import torch

    from entrenar import peft

    real = peft.apply_lora

    def nonzero_b(*a, **k):
        model = real(*a, **k)
        with torch.no_grad():
            for m in peft.lora_modules(model).values():
                m.lora_B.weight.normal_(0, 1.0)
        return model

    monkeypatch.setattr(peft, "apply_lora", nonzero_b)
    out = tmp_path / "run"
    code, result, err = run_cli(dpo_args(base_model, pref_data, out), capture=True)
    assert code == 3 and result["guard"] == "GUARD-INIT-LOSS", (result, err)
    assert "reference is not the starting policy" in result["error"]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_identical_chosen_and_rejected_is_exit_2_naming_the_line(tmp_path, base_model, pref_data):  # noqa: F811
    data = tmp_path / "bad.jsonl"
    rows = pref_data.read_text().splitlines()
    same = {"prompt": "Say hi.", "chosen": "hi", "rejected": "hi"}
    data.write_text("\n".join([*rows[:5], json.dumps(same), *rows[5:]]) + "\n")
    code, result, _ = run_cli(dpo_args(base_model, data, tmp_path / "run"), capture=True)
    assert code == 2 and f"{data}:6" in result["error"] and "chosen and rejected are the same" in result["error"]
    assert not (tmp_path / "run").exists()


def test_pack_is_refused_for_pairs(tmp_path, base_model, pref_data):  # noqa: F811
    code, result, _ = run_cli(dpo_args(base_model, pref_data, tmp_path / "run", extra=("--pack",)), capture=True)
    assert code == 2 and "--pack" in result["error"]


def test_mix_is_refused_for_pairs(tmp_path, base_model, pref_data):  # noqa: F811
    """--mix adds SFT rows or GRPO prompts; preference pairs are refused, exit 2 naming it."""
    code, result, _ = run_cli(dpo_args(base_model, pref_data, tmp_path / "run", extra=("--mix", f"{pref_data}:0.3")),
                              capture=True)
    assert code == 2 and "--mix and --kl-to-base apply to SFT rows" in result["error"], result


def test_resume_from_step_3_equals_the_uninterrupted_run(tmp_path, lora_run, base_model, pref_data):  # noqa: F811
    resumed = tmp_path / "resumed"
    _rewind(lora_run, resumed, 3)
    code, result, err = run_cli(dpo_args(base_model, pref_data, resumed, extra=("--resume", "auto")), capture=True)
    assert code == 0 and result["start_step"] == 3, (result, err)
    drop = ("tok_s", "mfu", "mem_mb")

    def numbers(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in drop} for r in records(path)]

    assert numbers(resumed / "metrics.jsonl") == numbers(lora_run / "metrics.jsonl")  # bit-exact
    assert records(resumed / "eval.jsonl") == records(lora_run / "eval.jsonl")


# accumulation 1 is the DDP path of every other gloo test (test_distributed.py): here 2, LoRA and full
@pytest.mark.parametrize("mode,accum", [("lora", "2"), ("full", "2")])
def test_two_gloo_ranks_equal_one_process(mode, accum, tmp_path, base_model, pref_data):  # noqa: F811
    """DDP (LoRA: the reference through the same DDP module, adapters off; with one micro-batch per step DDP's graph
    is static and sees a no-grad forward before each training forward) and FSDP2 (full: a frozen copy beside the
    sharded policy): 2 ranks x batch 2 == 1 process x batch 4, with the same accumulation."""
    extra = ("--mode", mode, "--grad-accum", accum, *(("--lr", "1e-4") if mode == "full" else ()))
    one, two = tmp_path / "one", tmp_path / "two"
    ok(run_cli_process(dpo_args(base_model, pref_data, one, 4, extra)))
    ok(run_cli_process(dpo_args(base_model, pref_data, two, 2, extra), nproc=2))
    a, b = records(two / "metrics.jsonl"), records(one / "metrics.jsonl")
    assert close([r["loss"] for r in a], [r["loss"] for r in b])
    # rewards are beta x a difference of two log-prob sums of ~-100 nats each: their rounding (~1e-5 nats in fp32,
    # another summation order on 2 ranks) is absolute, so they are compared to 1e-6 absolute; the log-probs
    # themselves relatively, the accuracies exactly
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert all(abs(x[k] - y[k]) <= 1e-6 for x, y in zip(a, b, strict=True)), k
    for k in ("logps/chosen", "logps/rejected"):
        assert close([r[k] for r in a], [r[k] for r in b]), k
    assert [r["rewards/accuracies"] for r in a] == [r["rewards/accuracies"] for r in b]
    assert [r["loss_tokens"] for r in a] == [r["loss_tokens"] for r in b] == [4 * int(accum)] * STEPS
    assert close([e["loss"] for e in records(two / "eval.jsonl")], [e["loss"] for e in records(one / "eval.jsonl")])
    name = "adapter_model.safetensors" if mode == "lora" else "model.safetensors"
    assert worst_rel(weights(two / "final" / name), weights(one / "final" / name)) <= 1e-4


def test_full_dpo_under_bf16_keeps_its_reference_linears_in_bf16_and_starts_at_ln2(tmp_path, base_model,  # noqa: F811
                                                                                  pref_data, capsys, monkeypatch):
    """--mode full --dtype bf16: the frozen reference copy's linears are stored in bf16 (half its memory) and the
    step-0 loss is still ln 2 exactly: autocast rounds the policy's fp32 linears to the same bf16 values."""
    import torch

    from entrenar.train import precision as precision_mod

    seen = []
    prepare_frozen = precision_mod.Precision.prepare_frozen

    def record(self, model):
        out = prepare_frozen(self, model)
        seen.append({p.dtype for path, m in out.named_modules() if type(m) is torch.nn.Linear
                     and ".layers." in f".{path}" for p in m.parameters(recurse=False)})
        return out

    monkeypatch.setattr(precision_mod.Precision, "prepare_frozen", record)
    out = tmp_path / "run"
    extra = ("--mode", "full", "--steps", "2", "--dtype", "bf16")
    code, result, err = run_cli(dpo_args(base_model, pref_data, out, extra=extra), capsys)
    assert code == 0, (result, err)
    assert seen == [{torch.bfloat16}]
    assert records(out / "eval.jsonl")[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert "GUARD-INIT-LOSS ok" in err
