"""`entrenar eval --data PAIRS.jsonl` on preference pairs (issue 38 item 11): the model's DPO implicit rewards
beta * (logp_policy - logp_reference) of the chosen and rejected responses, against the reference its training
used (an adapter's base without the adapter, a full fine-tune's starting model) or --ref-model.

Known by construction: a policy equal to its reference (an untrained adapter, or --ref-model the model itself) has
every reward 0 (margin 0, accuracy 0: ties are no wins, reward_ties 1); a few DPO steps on the pairs win them. Parity:
eval's numbers are the trainer's eval metrics of the same weights on the same pairs (the same PreferenceLoss, the
same sequence_logps)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from entrenar.fileio import read_jsonl
from tests.helpers.cli import run_cli
from tests.test_messages38 import WORDS, tiny_chat_model  # noqa: F401

KEYS = {"reward_accuracy": "rewards/accuracies", "reward_margin": "rewards/margins",
        "reward_chosen": "rewards/chosen", "reward_rejected": "rewards/rejected", "logps_chosen": "logps/chosen",
        "logps_rejected": "logps/rejected", "loss": "loss", "nll_chosen": "nll/chosen"}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {w}.", "chosen": f"{w}!", "rejected": f"no {w}"}) + "\n"
                            for w in WORDS))
    return path


def dpo(model: Path, data: Path, out: Path, mode: str, *extra: str) -> Path:
    """A few DPO steps on the pairs, the same pairs as its eval set (so eval.jsonl's last row is final/'s)."""
    code, result, err = run_cli(["finetune", "--model", str(model), "--data", str(data), "--val", str(data),
                                 "--out", str(out), "--steps", "6", "--batch-size", "5", "--max-seq-len", "64",
                                 "--lr", "2e-2" if mode == "lora" else "3e-3", "--warmup", "0", "--eval-batches", "0",
                                 "--device", "cpu", "--no-preflight", "--json", "--objective", "dpo", "--mode", mode,
                                 "--rank", "4", "--seed", "1", *extra], capture=True)
    assert code == 0, (result, err)
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_chat_model, pairs) -> Path:  # noqa: F811
    return dpo(tiny_chat_model, pairs, tmp_path_factory.mktemp("lora") / "run", "lora", "--beta", "0.5")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_chat_model, pairs) -> Path:  # noqa: F811
    return dpo(tiny_chat_model, pairs, tmp_path_factory.mktemp("full") / "run", "full")


@pytest.fixture(scope="module")
def untrained_adapter(tmp_path_factory, tiny_chat_model) -> Path:  # noqa: F811
    """An adapter whose B is zero (as apply_lora leaves it): the policy is its base exactly."""
    from entrenar.formats import load_model
    from entrenar.peft import apply_lora, save_adapter

    model = apply_lora(load_model(tiny_chat_model, dtype=torch.float32), 4, 8.0, seed=0)
    return save_adapter(model, tmp_path_factory.mktemp("untrained") / "adapter", tiny_chat_model)


def evaluate(model: Path, data: Path, *extra: str) -> tuple[int, dict, str]:
    code, result, err = run_cli(["eval", "--model", str(model), "--data", str(data), "--max-seq-len", "64",
                                 "--batch-size", "4", "--device", "cpu", "--json", *extra], capture=True)
    return code, result, err


def test_a_policy_equal_to_its_reference_has_every_reward_zero(untrained_adapter, tiny_chat_model, pairs):  # noqa: F811
    for model, extra in ((untrained_adapter, ()), (tiny_chat_model, ("--ref-model", str(tiny_chat_model)))):
        code, r, err = evaluate(model, pairs, *extra)
        assert code == 0, (r, err)
        assert r["kind"] == "preference" and r["pairs"] == len(WORDS)
        assert r["reference"]["kind"] == ("adapters-off" if not extra else "--ref-model")
        assert r["reward_margin"] == 0.0 and r["reward_chosen"] == 0.0 and r["reward_rejected"] == 0.0
        assert r["reward_accuracy"] == 0.0 and r["reward_ties"] == 1.0  # a tie is no win, as TRL counts it
        assert r["logps_chosen"] == r["ref_logps_chosen"] and r["logps_rejected"] == r["ref_logps_rejected"]
        assert r["logps_chosen"] < 0 and r["loss"] == pytest.approx(math.log(2), abs=1e-7)
        assert r["beta"] == 0.1 and r["beta_from"] == "default"


def test_a_lora_dpo_run_wins_its_pairs_and_eval_equals_the_trainers_metrics(lora_run, tiny_chat_model, pairs,  # noqa: F811
                                                                            capsys):
    code, r, err = evaluate(lora_run, pairs)
    assert code == 0, (r, err)
    last = [row for _, row in read_jsonl(lora_run / "eval.jsonl")][-1]
    assert last["step"] == 6 and last["tokens"] == r["pairs"] == len(WORDS)
    for ours, theirs in KEYS.items():  # the trainer's eval of final/'s weights on the same pairs
        assert r[ours] == pytest.approx(last[theirs], rel=1e-6, abs=1e-7), ours
    assert r["reward_accuracy"] >= 0.8 and r["reward_margin"] > 0  # above the reference's 0 (previous test)
    assert r["beta"] == 0.5 and r["beta_from"] == "run" and r["objective"] == "dpo"
    ref = r["reference"]
    assert ref["kind"] == "adapters-off" and ref["model"] == str(tiny_chat_model)
    # the reference's logps are the base's: the same as the untrained adapter's policy logps
    code, base, err = evaluate(tiny_chat_model, pairs, "--ref-model", str(tiny_chat_model))
    assert code == 0, err
    assert r["ref_logps_chosen"] == pytest.approx(base["logps_chosen"], rel=1e-6)
    assert r["ref_logps_rejected"] == pytest.approx(base["logps_rejected"], rel=1e-6)
    # --beta scales every reward (and is said to be the flag's)
    code, r2, err = evaluate(lora_run, pairs, "--beta", "1.0")
    assert code == 0, err
    assert r2["beta_from"] == "--beta" and r2["reward_margin"] == pytest.approx(2 * r["reward_margin"], rel=1e-5)
    # the text form names the reference and the numbers
    run = run_cli(["eval", "--model", str(lora_run), "--data", str(pairs), "--max-seq-len", "64",
                   "--device", "cpu"], capsys)
    assert run[0] == 0 and f"{len(WORDS)} pairs" in run.out and "the base without the adapter" in run.out
    assert f"reward accuracy {r['reward_accuracy']:.3f}" in run.out and "beta 0.5 (the run's)" in run.out


def test_a_full_dpo_run_is_measured_against_the_model_it_started_from(full_run, tiny_chat_model, pairs):  # noqa: F811
    code, r, err = evaluate(full_run, pairs)
    assert code == 0, (r, err)
    assert r["reference"] == {"kind": "run-start", "model": str(tiny_chat_model),
                              "run": str(full_run)}
    last = [row for _, row in read_jsonl(full_run / "eval.jsonl")][-1]
    for ours, theirs in KEYS.items():
        assert r[ours] == pytest.approx(last[theirs], rel=1e-6, abs=1e-7), ours
    assert r["reward_accuracy"] > 0.5 and r["reward_margin"] > 0


def test_a_plain_model_without_a_reference_is_exit_2_naming_ref_model(tiny_chat_model, pairs, tmp_path):  # noqa: F811
    code, r, err = evaluate(tiny_chat_model, pairs)
    assert code == 2 and "--ref-model" in r["error"] and "reference" in r["error"], (r, err)


def test_ref_model_of_another_vocabulary_is_exit_2(tiny_chat_model, pairs, tmp_path):  # noqa: F811
    from entrenar.formats import save_hf_dir
    from tests.helpers.models import tiny_causal_lm, tiny_config

    other = save_hf_dir(tiny_causal_lm(tiny_config(vocab_size=97, hidden_size=32, intermediate_size=64,
                                                   num_layers=1), 0), tmp_path / "other")
    code, r, err = evaluate(tiny_chat_model, pairs, "--ref-model", str(other))
    assert code == 2 and "--ref-model" in r["error"] and "vocab" in r["error"], (r, err)


@pytest.mark.parametrize("flag", [("--ref-model", "X"), ("--beta", "0.2")])
def test_preference_flags_on_other_data_are_exit_2(tiny_chat_model, tmp_path, flag):  # noqa: F811
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "Say one.", "completion": "one!"}) + "\n")
    code, r, err = evaluate(tiny_chat_model, sft, *flag)
    assert code == 2 and flag[0] in r["error"] and "preference" in r["error"], (r, err)
    code, r, err = run_cli(["eval", "--model", str(tiny_chat_model), "--task", "humaneval", "--json", *flag],
                           capture=True)
    assert code == 2 and flag[0] in r["error"], (r, err)
