"""Issue 38 item 5: destroyed models reported as success. Before: LoRA DPO at --lr 0.5 exited 0 while the policy's
NLL of its chosen answers went to ln V (the DPO loss, the only thing judged, stayed near ln 2); a full fine-tune at
--lr 5 without a val split went 5.48 -> 7611 with only a GUARD-SPIKE warning; a LoRA run whose eval ended worse than
it started said "ok": true and nothing else. Now: GUARD-PREF-CHOSEN-DIVERGED and GUARD-TRAIN-DIVERGED stop such runs
(exit 3, no final/), and a run that ends worse than it started carries GUARD-END-WORSE in its summary's "warnings".
A healthy run stays quiet. Tiny models on the CPU (tests/test_distributed.py's "pretrained" one)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from entrenar.errors import GuardError
from entrenar.fileio import read_jsonl
from entrenar.train import guards
from tests.helpers.cli import run_cli
from tests.test_distributed import base_model, sft_data  # noqa: F401
from tests.test_dpo_train import pref_data  # noqa: F401

LN_V = math.log(49152)  # SmolLM2's vocabulary, the tiny model's


# ---- the rules --------------------------------------------------------------------------------------------
def test_train_watch_median_limit_and_state():
    watch = guards.TrainWatch(window=4)
    assert watch.update(3.0) == (3.0, None)
    assert watch.update(3.2) == (pytest.approx(3.1), None)  # a median of 2 is a mean: not judged yet
    assert watch.update(120.0) == (3.2, 3.0)  # one spike at step 3 moves a median of 3 little
    assert watch.update(2.8) == (pytest.approx(3.1), 3.0)
    smoothed, best = watch.update(2.9)  # the spike is still in the window of 4: the median does not see it
    assert smoothed == pytest.approx(3.05) and best == pytest.approx(3.0)
    guards.check_train_diverged(smoothed, best, LN_V, 4, "train loss", None)
    resumed = guards.TrainWatch(window=4)
    resumed.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert resumed.state_dict() == watch.state_dict() and resumed.start() == watch.start()
    with pytest.raises(GuardError) as e:  # a destroyed model moves every step: the median follows
        resumed.update(200.0)
        smoothed, best = resumed.update(300.0)
        guards.check_train_diverged(smoothed, best, LN_V, 6, "train loss", Path("RUN/checkpoints/step-0000004"))
    err = e.value
    assert err.guard_id == "GUARD-TRAIN-DIVERGED" and err.exit_code == 3 and "at step 6" in str(err)
    assert err.details["best_train_loss"] == 3.0 and err.details["train_loss"] == pytest.approx(101.45)  # of 4
    assert err.details["limit"] == pytest.approx(guards.diverged_limit(3.0, LN_V))
    assert "--resume RUN/checkpoints/step-0000004 --lr" in err.remedy


def test_chosen_nll_limit():
    guards.check_chosen_diverged(4.0, 3.0, LN_V, 2, lambda: None)  # displacement: below best + (ln V - best) / 2
    guards.check_chosen_diverged(99.0, None, LN_V, 2, lambda: None)  # no start yet: nothing to compare with
    with pytest.raises(GuardError, match="GUARD-PREF-CHOSEN-DIVERGED") as e:
        guards.check_chosen_diverged(guards.diverged_limit(3.0, LN_V) + 1e-6, 3.0, LN_V, 2, lambda: None)
    assert e.value.exit_code == 3 and "--beta" in e.value.remedy


def test_end_worse_rule():
    assert guards.end_worse(3.0, 2.9, "eval loss", "a", "b") is None
    assert guards.end_worse(3.0, 3.0, "eval loss", "a", "b") is None
    assert guards.end_worse(None, 5.0, "eval loss", "a", "b") is None
    w = guards.end_worse(3.9, 4.82, "eval loss", "eval at step 0", "eval at step 6")
    assert w["guard"] == "GUARD-END-WORSE" and w["start"] == 3.9 and w["end"] == 4.82 and "--lr" in w["message"]


# ---- the reported runs, on the CPU ------------------------------------------------------------------------
def finetune(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", "6",
            "--batch-size", "2", "--max-seq-len", "64", "--warmup", "0", "--seed", "3", "--device", "cpu",
            "--no-preflight", "--json", *extra]


def test_lora_dpo_at_a_destroying_lr_is_exit_3(tmp_path, base_model, pref_data, capsys):  # noqa: F811
    """The DPO eval loss stays at ln 2 (0.6931 -> 0.6922: GUARD-EVAL-DIVERGED has nothing to see) while the
    chosen answers' NLL per token goes 3.0 -> 11.7, above ln V."""
    out = tmp_path / "run"
    code, result, err = run_cli(finetune(base_model, pref_data, out, "--objective", "dpo", "--mode", "lora",
                                         "--rank", "4", "--batch-size", "4", "--lr", "0.5", "--val-fraction", "0.25",
                                         "--eval-every", "2", "--save-every", "2"), capsys)
    assert code == 3 and result["guard"] == "GUARD-PREF-CHOSEN-DIVERGED", (result, err[-2000:])
    d = result["details"]
    evals = [r for _, r in read_jsonl(out / "eval.jsonl")]
    assert evals[-1]["step"] == d["step"] and evals[-1]["nll/chosen"] == d["nll_chosen"] > d["limit"]
    assert evals[0]["nll/chosen"] == d["best_nll_chosen"]  # the reference's, at step 0
    assert abs(evals[-1]["loss"] - math.log(2)) < 0.05  # the preference loss alone looked healthy
    assert not (out / "final").exists() and "GUARD-PREF-CHOSEN-DIVERGED" in err


def test_full_finetune_without_val_at_lr_5_is_exit_3(tmp_path, base_model, sft_data, capsys):  # noqa: F811
    out = tmp_path / "run"
    code, result, err = run_cli(finetune(base_model, sft_data, out, "--mode", "full", "--lr", "5",
                                         "--val-fraction", "0", "--steps", "8"), capsys)
    assert code == 3 and result["guard"] == "GUARD-TRAIN-DIVERGED", (result, err[-2000:])
    steps = [r for _, r in read_jsonl(out / "metrics.jsonl")]
    assert steps[-1]["step"] == result["details"]["step"] < 8  # stopped at once, not at the end
    assert result["details"]["train_loss"] > result["details"]["limit"] and not (out / "final").exists()


def test_a_run_that_ends_worse_says_so(tmp_path, base_model, sft_data, capsys):  # noqa: F811
    out = tmp_path / "run"
    code, result, err = run_cli(finetune(base_model, sft_data, out, "--mode", "lora", "--rank", "4", "--lr", "0.2",
                                         "--val-fraction", "0.25"), capsys)
    assert code == 0 and result["ok"] is True, err[-2000:]
    assert result["eval_loss_final"] > result["eval_loss_start"]
    [w] = [x for x in result["warnings"] if x["guard"] == "GUARD-END-WORSE"]
    assert w["guard"] == "GUARD-END-WORSE" and w["start"] == result["eval_loss_start"]
    assert w["end"] == result["eval_loss_final"] and "GUARD-END-WORSE (warning)" in err


@pytest.mark.parametrize("val, steps", [("0.25", "6"), ("0", "12")])  # 12: the first and last 8 steps differ
def test_a_healthy_run_is_quiet(tmp_path, base_model, sft_data, capsys, val, steps):  # noqa: F811
    out = tmp_path / "run"
    code, result, err = run_cli(finetune(base_model, sft_data, out, "--mode", "full", "--lr", "3e-3",
                                         "--val-fraction", val, "--steps", steps), capsys)
    assert code == 0 and result["ok"] is True and result["warnings"] == [], err[-2000:]
    assert "GUARD-END-WORSE" not in err and (out / "final" / "model.safetensors").is_file()
