"""The preference objectives' guards (train/guards.py): the step-0 check (GUARD-INIT-LOSS against the loss at policy =
reference), GUARD-PREF-MARGINS and GUARD-PREF-ACCURACY (warnings, once per run, their state checkpointed),
GUARD-PREF-NO-GRADIENT (a --beta so small that nothing trains, issue 38 item 11), flags."""

from __future__ import annotations

import math

import pytest

from entrenar.errors import GuardError
from entrenar.fileio import read_jsonl
from entrenar.train import guards
from entrenar.train.objective import CausalLMLoss, PreferenceLoss
from tests.helpers.cli import run_cli


def step(i: int, loss: float, acc: float, margin: float = 0.5) -> dict:
    return {"step": i, "loss": loss, "rewards/accuracies": acc, "rewards/margins": margin, "rewards/chosen": -1.0,
            "rewards/rejected": -1.0 - margin, "skipped": False}


def test_start_check_passes_at_ln2_and_fires_off_it():
    guards.check_preference_start(math.log(2), math.log(2), {"rewards/chosen": 0.0, "rewards/rejected": 0.0}, "dpo",
                                  "M")
    with pytest.raises(GuardError, match="reference is not the starting policy") as e:
        guards.check_preference_start(0.70, math.log(2), {"rewards/chosen": 0.3, "rewards/rejected": 0.2}, "dpo", "M")
    assert e.value.guard_id == "GUARD-INIT-LOSS" and e.value.exit_code == 3
    # rewards that cancel in the mean loss still show: each must be 0 at step 0
    with pytest.raises(GuardError):
        guards.check_preference_start(math.log(2), math.log(2), {"rewards/chosen": 0.5, "rewards/rejected": 0.5},
                                      "dpo", "M")


def test_margins_running_away_warn_once():
    watch = guards.PreferenceWatch(math.log(2))
    assert watch.update(step(1, 0.3, 0.9, margin=5.0)) == []
    msgs = watch.update(step(2, 1e-9, 1.0, margin=25.0))
    assert len(msgs) == 1 and msgs[0].startswith("GUARD-PREF-MARGINS") and "--beta" in msgs[0]
    assert watch.update(step(3, 1e-9, 1.0, margin=40.0)) == []  # said once
    # IPO regresses the margin to a target: no run-away guard
    assert guards.PreferenceWatch(25.0, margin_guard=False).update(step(1, 1.0, 1.0, margin=100.0)) == []


def test_accuracy_stuck_at_half_while_the_loss_falls_warns_and_its_state_resumes():
    watch = guards.PreferenceWatch(math.log(2))
    out = []
    for i in range(1, guards.ACCURACY_WINDOW):
        out += watch.update(step(i, 0.5, 0.5 if i % 2 else 0.4))
    assert out == []  # the window is not full yet
    saved = watch.state_dict()
    resumed = guards.PreferenceWatch(math.log(2))
    resumed.load_state_dict(saved)
    msgs = resumed.update(step(guards.ACCURACY_WINDOW, 0.5, 0.5))
    assert len(msgs) == 1 and msgs[0].startswith("GUARD-PREF-ACCURACY") and "swapped" in msgs[0]
    # healthy: accuracy rises while the loss falls
    healthy = guards.PreferenceWatch(math.log(2))
    assert all(healthy.update(step(i, 0.5, 0.9)) == [] for i in range(1, 40))
    # stuck at 0.5 with the loss NOT falling (nothing learned yet): no warning
    flat = guards.PreferenceWatch(math.log(2))
    assert all(flat.update(step(i, 0.69, 0.5)) == [] for i in range(1, 40))


def test_a_trainer_says_the_warnings_through_its_objective():
    obj = PreferenceLoss("dpo", 0.1, "adapters-off")
    msgs = obj.watch(step(1, 1e-9, 1.0, margin=30.0))
    assert msgs and "GUARD-PREF-MARGINS" in msgs[0]
    assert obj.state_dict()["fired"] == ["margins"]


@pytest.mark.parametrize("argv,needle", [
    (["--beta", "0"], "--beta must be a finite number > 0"),
    (["--beta", "nan"], "--beta must be a finite number > 0"),
    (["--mode", "full", "--dtype", "bf16-weights"], "--dtype bf16-weights is not supported"),
])
def test_bad_preference_flags_exit_2(argv, needle, tmp_path, capsys):
    from tests.helpers.cli import run_cli

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' * 3)
    code, result, _ = run_cli(["finetune", "--model", "smollm2-135m-instruct", "--data", str(data), "--out",
                               str(tmp_path / "run"), "--objective", "dpo", "--device", "cpu", "--json", *argv], capsys)
    assert code == 2 and needle in result["error"], result
    assert not (tmp_path / "run").exists()


def test_no_gradient_rule_fires_below_the_optimizers_floor_only():
    """The floor is eps x sqrt(trainable): a gradient whose RMS per parameter is below AdamW's eps."""
    with pytest.raises(GuardError, match="--beta 1e-09 is far too small") as e:
        guards.check_preference_gradient(3.27e-11, 4096, 1e-8, 1e-9, "dpo")
    assert e.value.guard_id == "GUARD-PREF-NO-GRADIENT" and e.value.exit_code == 3
    assert "a larger --beta" in e.value.remedy and "0.1" in e.value.remedy
    assert e.value.details["floor"] == pytest.approx(1e-8 * 64)
    with pytest.raises(GuardError, match="GUARD-PREF-NO-GRADIENT"):
        guards.check_preference_gradient(0.0, 10, 1e-8, 1e-30, "dpo-norm")  # underflowed to 0
    guards.check_preference_gradient(1e-8 * 64, 4096, 1e-8, 1e-5, "dpo")  # at the floor: quiet
    guards.check_preference_gradient(3.27e-3, 4096, 1e-8, 0.1, "dpo")
    guards.check_preference_gradient(float("nan"), 4096, 1e-8, 0.1, "dpo")  # GUARD-NONFINITE's
    # IPO's start gradient grows as 1/tau and cross-entropy has no beta: neither is judged
    PreferenceLoss("ipo", 1e-9, "adapters-off").check_first_gradient(0.0, 4096, 1e-8)
    CausalLMLoss().check_first_gradient(0.0, 4096, 1e-8)
    with pytest.raises(GuardError):
        PreferenceLoss("dpo-norm", 1e-9, "adapters-off").check_first_gradient(1e-12, 4096, 1e-8)


@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory):
    """A random tiny model with the byte-level ChatML tokenizer (no weights to load) and 8 preference rows."""
    import json

    from entrenar.formats import save_hf_dir
    from tests.helpers.models import tiny_causal_lm, tiny_config
    from tests.helpers.tokenizers import tiny_tokenizer

    root = tmp_path_factory.mktemp("pairs")
    tok = tiny_tokenizer()
    model = save_hf_dir(tiny_causal_lm(tiny_config("qwen2", vocab_size=len(tok), max_position_embeddings=128), 0),
                        root / "m", tokenizer=tok)
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"count from {i}", "chosen": f"{i} {i + 1} {i + 2}",
                                        "rejected": f"{i + 2} {i} {i + 1}"}) + "\n" for i in range(8)))
    return model, data


@pytest.mark.parametrize("beta", ["1e-9", "0.1"])
def test_a_beta_so_small_that_nothing_trains_stops_at_step_0(beta, tmp_path, tiny_pairs, capsys):
    """LoRA DPO: --beta 1e-9 gives a first gradient far below AdamW's floor (the loss would stay ln 2, gnorm
    0.000) and stops before the first update, exit 3, no step row, no checkpoint, no final/; the default --beta 0.1
    trains."""
    model, data = tiny_pairs
    out = tmp_path / "run"
    code, result, err = run_cli(["finetune", "--model", str(model), "--data", str(data), "--out", str(out),
                                 "--objective", "dpo", "--mode", "lora", "--rank", "4", "--beta", beta, "--steps",
                                 "1", "--batch-size", "4", "--max-seq-len", "64", "--val-fraction", "0",
                                 "--device", "cpu", "--no-preflight", "--json"], capsys)
    if beta == "0.1":
        assert code == 0 and "GUARD-PREF-NO-GRADIENT" not in err, (result, err[-2000:])
        return
    assert code == 3 and result["guard"] == "GUARD-PREF-NO-GRADIENT", (result, err[-2000:])
    assert result["details"]["grad_norm"] < result["details"]["floor"] and "--beta 1e-09" in result["error"]
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or not [r for _, r in read_jsonl(metrics)]  # no step was trained
    assert not (out / "final").exists() and not (out / "checkpoints").exists()
