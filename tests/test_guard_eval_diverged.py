"""GUARD-EVAL-DIVERGED (issue 28 item 2): a run whose eval ends far above its best is a destroyed model,
not a success. Before the guard all three of these exited 0 with "ok": true and a final/:
`finetune --mode lora --lr 0.5` on SmolLM2 (eval 0.9995 -> 9.51, ln V 10.80, answers '....'),
`pretrain --model tiny --lr 10 --clip 0` (6.94 -> 101.6) and `finetune --mode full --lr 5 --clip 0`
(6.56 -> 873). Now: exit 3 naming the guard, no final/, eval.jsonl keeps the eval that showed it, the
message names the best kept checkpoint and the remedy, and the run stops at the first such eval.
A healthy run whose eval rises a little (noise, mild overfitting) is not stopped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from entrenar.errors import GuardError
from entrenar.train import guards, loop
from entrenar.train.loop import TrainConfig, train
from entrenar.train.metrics import read_jsonl
from tests import test_distributed as D
from tests import test_train_cli
from tests import test_train_loop as T
from tests.helpers.cli import run_cli as main
from tests.test_peft_seed import tiny_base_and_data

byte_shards = test_train_cli.byte_shards  # module-scoped there: built once per module
base_model, sft_data = D.base_model, D.sft_data


def no_checkpoint() -> None:
    """The guard's best-checkpoint finder when none was kept."""


# ---- the rule ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("start, final, vocab", [
    (0.9995, 9.51, 49152),  # LoRA --lr 0.5 on SmolLM2: still below ln V (10.80), so COLLAPSE let it through
    (6.94, 101.6, 1024),  # pretrain tiny --lr 10 --clip 0: a from-scratch start at ln V
    (6.56, 873.0, 1024),  # finetune --mode full --lr 5 --clip 0
])
def test_the_reported_runs_fire(start, final, vocab):
    guards.check_eval_collapse(final, start, math.log(vocab), 9)  # what let them through: none is back at ln V
    with pytest.raises(GuardError) as e:
        guards.check_eval_diverged(final, start, math.log(vocab), 9, lambda: (Path("RUN/checkpoints/step-0000004"), 4, start))
    err = e.value
    assert err.guard_id == "GUARD-EVAL-DIVERGED" and err.exit_code == 3
    assert "at step 9" in str(err) and "final/ was not written" in str(err)
    assert "RUN/checkpoints/step-0000004" in str(err) and err.details["checkpoint"] == "RUN/checkpoints/step-0000004"
    assert "--lr" in err.remedy and "--clip" in err.remedy


def test_the_limit_and_what_passes():
    v = 49152  # SmolLM2's vocabulary: ln V = 10.80
    ln_v = math.log(v)  # the objective's uniform loss (cross-entropy)
    assert guards.diverged_limit(1.0, ln_v) == pytest.approx(1.0 + 0.5 * (math.log(v) - 1.0))  # halfway to ln V
    assert guards.diverged_limit(6.94, math.log(1024)) == pytest.approx(7.94)  # at/above ln V: the 1-nat floor
    assert guards.diverged_limit(9.0, math.log(256)) == pytest.approx(10.0)  # a start worse than uniform: floor too
    called = []

    def finder() -> None:
        called.append(1)
    guards.check_eval_diverged(50.0, None, ln_v, 3, finder)  # no eval before: nothing to compare with
    guards.check_eval_diverged(1.05, 1.0, ln_v, 3, finder)  # noise
    guards.check_eval_diverged(2.9, 1.0, ln_v, 3, finder)  # a fine-tune overfitting its small set
    guards.check_eval_diverged(7.9, 6.94, math.log(1024), 3, finder)  # an early from-scratch wobble
    guards.check_eval_diverged(guards.diverged_limit(1.0, ln_v), 1.0, ln_v, 3, finder)  # at the limit: passes
    guards.check_eval_diverged(float("nan"), 1.0, ln_v, 3, finder)  # NaN is GUARD-NONFINITE's (checked first)
    assert called == []  # the checkpoint directory is read only when the guard fires
    guards.check_eval_collapse(math.log(v) + 1.01, 0.586, ln_v, 3)  # far above ln V: not uniform, so DIVERGED's
    with pytest.raises(GuardError, match="GUARD-EVAL-COLLAPSE"):  # up to ln V + 1 inclusive it is COLLAPSE's
        guards.check_eval_collapse(math.log(v) + 1.0, 0.586, ln_v, 3)
    with pytest.raises(GuardError, match="GUARD-EVAL-DIVERGED"):
        guards.check_eval_diverged(math.log(v) + 1.01, 0.586, ln_v, 3, no_checkpoint)
    with pytest.raises(GuardError, match="no checkpoint with an eval was kept") as e:
        guards.check_eval_diverged(guards.diverged_limit(1.0, ln_v) + 1e-6, 1.0, ln_v, 3, finder)
    assert called == [1] and e.value.details["checkpoint"] is None


# ---- in the loop: stop at the first destroyed eval, name the best kept checkpoint ----------------------
def fake_evals(monkeypatch, values: dict[int, float]) -> list[int]:
    """loop.evaluate returns values[n] for its n-th call (the real eval runs, its loss is replaced)."""
    real, calls = loop.evaluate, []

    def fake(model, batches, *a, **k):
        ev = real(model, batches, *a, **k)
        calls.append(len(calls))
        return {**ev, "loss": values[len(calls) - 1]}
    monkeypatch.setattr(loop, "evaluate", fake)
    return calls


def test_stops_at_the_first_destroyed_eval_and_names_the_best_checkpoint_across_a_resume(tmp_path, monkeypatch):
    """Evals at steps 0, 2, 4 | resume | 6, 8 of 12: 4.2, 3.7 (best), 4.1 (+0.4: passes), then 6.0 at step 8,
    above 3.7 + max(1, (ln 97 - 3.7) / 2) = 4.7 (and below ln V: not a collapse). The run stops there:
    steps 9-12 never run, step 8 is not checkpointed, no final/, eval.jsonl keeps the step-8 line, and the
    best checkpoint is step-2, whose eval happened before the resume."""
    fake_evals(monkeypatch, {0: 4.2, 1: 3.7, 2: 4.1, 3: 4.0, 4: 6.0})  # the n-th eval of both runs together
    written = []
    cfg = {"batch_size": 2, "seq_len": 32, "lr": 1e-3, "warmup": 0, "eval_every": 2, "save_every": 2, "keep": 0,
           "seed": 5, "save_mode": "sync"}  # all on disk when the guard stops (async stops: test_async_checkpoint)
    train(T.tiny_model(), T.ListLoader(T.make_samples(16), 2), T.ListLoader(T.make_samples(8, 99), 4),
          TrainConfig(steps=4, **cfg), tmp_path, save_final=lambda m, p: written.append(p), log=T.quiet)
    written.clear()
    with pytest.raises(GuardError) as e:
        train(T.tiny_model(), T.ListLoader(T.make_samples(16), 2), T.ListLoader(T.make_samples(8, 99), 4),
              TrainConfig(steps=12, **cfg), tmp_path, resume="auto", save_final=lambda m, p: written.append(p),
              log=T.quiet)
    err = e.value
    assert err.guard_id == "GUARD-EVAL-DIVERGED" and "at step 8" in str(err), str(err)
    assert err.details["checkpoint"] == str(tmp_path / "checkpoints" / "step-0000002")
    assert "step-0000002 (eval loss 3.7000 at step 2)" in str(err)
    assert written == [] and not (tmp_path / "final").exists()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 9))
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "eval.jsonl")] == \
        [(0, 4.2), (2, 3.7), (4, 4.1), (6, 4.0), (8, 6.0)]
    assert sorted(d.name for d in (tmp_path / "checkpoints").glob("step-*")) == \
        ["step-0000002", "step-0000004", "step-0000006"]
    assert f"--resume {err.details['checkpoint']} --lr" in err.remedy and "--clip" in err.remedy
    # the remedy works: from the named checkpoint at a lower --lr (real evals now) the run finishes
    monkeypatch.undo()
    train(T.tiny_model(), T.ListLoader(T.make_samples(16), 2), T.ListLoader(T.make_samples(8, 99), 4),
          TrainConfig(steps=12, **{**cfg, "lr": 1e-4}), tmp_path, resume=err.details["checkpoint"],
          save_final=lambda m, p: written.append(p), log=T.quiet)
    assert written == [tmp_path / "final"]
    assert [r["step"] for r in read_jsonl(tmp_path / "eval.jsonl")] == [0, 2, 4, 6, 8, 10, 12]


def test_diverged_is_judged_before_eval_anomaly(tmp_path, monkeypatch):
    """A destroyed model's train loss can be 10x its eval loss: that is not a leaked eval set."""
    fake_evals(monkeypatch, {0: 4.2, 1: 20.0})
    monkeypatch.setattr(loop.Trainer, "train_step", lambda self, step: (
        self.recent_losses.append(500.0), {"step": step, "loss": 500.0, "lr": 0.0, "grad_norm": 0.0,
                                           "tok_s": 1.0})[1])
    with pytest.raises(GuardError) as e:
        train(T.tiny_model(), T.ListLoader(T.make_samples(16), 2), T.ListLoader(T.make_samples(8, 99), 4),
              TrainConfig(steps=2, batch_size=2, seq_len=32, lr=1e-3, warmup=0, seed=5), tmp_path, log=T.quiet)
    assert e.value.guard_id == "GUARD-EVAL-DIVERGED"


# ---- the reported commands, cheaply on the CPU -----------------------------------------------------------
def assert_diverged(code: int, result: dict | None, err: str, out: Path) -> dict:
    assert code == 3, err[-3000:]
    assert result["ok"] is False and result["guard"] == "GUARD-EVAL-DIVERGED" and result["exit_code"] == 3
    assert "GUARD-EVAL-DIVERGED" in err and "lower --lr" in err and "--clip" in err
    assert not (out / "final").exists()
    evals = read_jsonl(out / "eval.jsonl")
    assert evals[-1]["step"] == result["details"]["step"] and evals[-1]["loss"] == result["details"]["eval_loss"]
    return result["details"]


def test_pretrain_tiny_lr_10_clip_0_is_exit_3(tmp_path, byte_shards, capsys):
    out = tmp_path / "run"
    code, result, err = main(["pretrain", "--model", "tiny", "--data", str(byte_shards), "--out", str(out),
                              "--steps", "12", "--seq-len", "32", "--batch-size", "2", "--lr", "10", "--clip", "0",
                              "--warmup", "0", "--eval-every", "4", "--eval-batches", "3", "--save-every", "4",
                              "--seed", "4", "--no-preflight", "--json"], capsys)
    details = assert_diverged(code, result, err, out)
    assert details["step"] < 12  # stopped at the first eval that showed it, not at the end
    assert read_jsonl(out / "metrics.jsonl")[-1]["step"] == details["step"]


def finetune_argv(base: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--steps", "6",
            "--batch-size", "2", "--max-seq-len", "64", "--val-fraction", "0.25", "--eval-every", "3",
            "--save-every", "3", "--seed", "5", "--no-preflight", "--json", *extra]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_base_and_data(tmp_path_factory.mktemp("divbase"))


@pytest.mark.parametrize("boost", [0.5, 4.0])
def test_finetune_full_lr_5_clip_0_is_exit_3(tmp_path, capsys, boost):
    """boost 0.5: a start at 0.83 ln V (9.02), as in the report: GUARD-EVAL-COLLAPSE never applied, so the
    run ended at eval 701 with exit 0. boost 4.0: a start far below ln V; the eval of 590 made
    GUARD-EVAL-COLLAPSE say the model 'predicts (almost) uniformly', which a loss 55x ln V is not."""
    base, data = tiny_base_and_data(tmp_path, boost=boost)
    out = tmp_path / "run"
    code, result, err = main(finetune_argv(base, data, out, "--mode", "full", "--lr", "5", "--clip", "0"), capsys)
    details = assert_diverged(code, result, err, out)
    assert details["eval_loss"] > details["ln_vocab"] + 1 and "predicts (almost) uniformly" not in err


def test_a_healthy_finetune_is_not_stopped(tmp_path, tiny_base, capsys):
    base, data = tiny_base
    out = tmp_path / "run"
    code, result, err = main(finetune_argv(base, data, out, "--mode", "full", "--lr", "1e-3"), capsys)
    assert code == 0 and result["ok"], err[-3000:]
    assert (out / "final" / "model.safetensors").is_file() and len(read_jsonl(out / "eval.jsonl")) == 3


EXIT_PER_RANK = """
import os, sys
from pathlib import Path
from entrenar import cli
code = cli.main(sys.argv[1:])
Path(__file__).with_name(f"exit-rank{os.environ['RANK']}").write_text(str(code))  # what each rank returned
sys.exit(code)
"""


def test_two_ranks_stop_together_with_one_message(tmp_path, base_model, sft_data):
    """Under torchrun the verdict comes from the eval loss reduced over the ranks: both stop at the same
    eval with exit 3, rank 0 prints the one message and JSON line, nothing is written as final/."""
    script = tmp_path / "run.py"
    script.write_text(EXIT_PER_RANK)
    out = tmp_path / "run"
    proc = D.run_cli(D.finetune_args(base_model, sft_data, out, 2, ("--mode", "full", "--lr", "5", "--clip", "0")),
                     nproc=2, script=str(script))
    assert proc.returncode == 1 and "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]
    assert [(tmp_path / f"exit-rank{r}").read_text() for r in (0, 1)] == ["3", "3"], proc.stderr[-3000:]
    assert proc.stderr.count("GUARD-EVAL-DIVERGED: at step") == 1
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["guard"] == "GUARD-EVAL-DIVERGED"
    assert not (out / "final").exists()


@pytest.mark.real_model
def test_lora_lr_half_on_smollm2_is_exit_3(tmp_path, capsys):
    """The reported run, shortened: LoRA at --lr 0.5 on the packaged SmolLM2 (eval 3.80 -> 103 at step 2;
    the later flags override finetune_argv's)."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "completion": f"{w}!"}) + "\n"
                            for w in ("one", "two", "three", "four", "five", "six", "seven", "eight")))
    out = tmp_path / "run"
    code, result, err = main(finetune_argv("smollm2-135m-instruct", data, out, "--mode", "lora", "--lr", "0.5",
                                           "--steps", "4", "--batch-size", "1", "--eval-every", "2"), capsys)
    details = assert_diverged(code, result, err, out)
    assert details["best_eval_loss"] < details["ln_vocab"] / 2 < details["eval_loss"]
