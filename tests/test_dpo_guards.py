"""The preference objectives' guards (train/guards.py): the step-0 check (GUARD-INIT-LOSS against the loss at policy =
reference), GUARD-PREF-MARGINS and GUARD-PREF-ACCURACY (warnings, once per run, their state checkpointed), flags."""

from __future__ import annotations

import math

import pytest

from entrenar.errors import GuardError
from entrenar.train import guards
from entrenar.train.objective import PreferenceLoss


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
