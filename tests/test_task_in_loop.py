"""`pretrain|finetune --eval-task`: the task metric inside the run (issue 35 part 1).

The paired test (exact McNemar) against known values; the Trainer with a seeded evaluator (the per-problem
verdicts of each measurement are given), so GUARD-TASK-REGRESSION must fire on a real drop and stay quiet on
noise, `--keep-best task` must put the best step's weights into final/, and a resume must keep step 0's
results; then the CLI end to end on a tiny model with a task file (rows in metrics.jsonl, per-problem files,
the summary, exit 2 for flags without --eval-task).
"""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import pytest
import torch

from entrenar.errors import GuardError
from entrenar.evaluate.paired import describe_change, mcnemar_exact, paired_change
from entrenar.train.loop import TrainConfig, build_trainer
from entrenar.train.metrics import read_jsonl
from tests.helpers.cli import run_cli as main
from tests.test_eval_task import GOOD, _tiny_dir
from tests.test_train_loop import ListLoader, make_samples, quiet, tiny_model


# ---- the paired test -------------------------------------------------------------------------------------
def _binomial_two_sided(b: int, c: int) -> float:
    """An independent reference: the probability of every split of n = b + c fair coins at most as likely
    as the one seen (the exact test's definition; equal to twice the smaller tail for p = 1/2)."""
    n = b + c
    seen = comb(n, b)
    return min(1.0, sum(comb(n, i) for i in range(n + 1) if comb(n, i) <= seen) / 2 ** n)


@pytest.mark.parametrize("lost,gained", [(0, 0), (3, 0), (6, 0), (0, 6), (10, 2), (2, 10), (5, 4), (1, 1), (9, 1)])
def test_mcnemar_exact_is_the_two_sided_binomial_test(lost, gained):
    assert mcnemar_exact(lost, gained) == pytest.approx(_binomial_two_sided(lost, gained), rel=1e-12)


def test_mcnemar_known_values():
    assert mcnemar_exact(6, 0) == pytest.approx(0.03125)  # 2 / 2^6
    assert mcnemar_exact(3, 0) == pytest.approx(0.25)  # the 6 -> 3 could be noise
    assert mcnemar_exact(0, 0) == 1.0


def test_paired_change_counts_gained_and_lost_on_common_problems():
    before = {"a": True, "b": True, "c": False, "d": False, "e": True}
    after = {"a": False, "b": True, "c": True, "d": False, "x": True}  # e missing after, x missing before
    ch = paired_change(before, after)
    assert ch["problems"] == 4 and ch["lost"] == ["a"] and ch["gained"] == ["c"]
    assert ch["passed_before"] == 2 and ch["passed_after"] == 2 and ch["verdict"] == "no significant change"
    drop = paired_change({str(i): True for i in range(8)}, {str(i): i < 7 for i in range(8)})
    assert "a drop, not significant" in describe_change(drop, "t", 0, 5)  # a drop is never called success


# ---- the Trainer with a seeded evaluator -----------------------------------------------------------------
class SeededTask:
    """An evaluator whose verdicts per measurement are given: verdicts[k] for its k-th run. It records the
    trainable weights it saw, so a test can tell which step's weights final/ holds."""

    metric = "pass@1"
    name = "seeded"

    def __init__(self, verdicts: list[list[bool]]):
        self.verdicts, self.calls, self.seen = verdicts, 0, []
        self.task_ids = [f"p{i}" for i in range(len(verdicts[0]))]

    def run(self, model, rank=0, world=1, log=None, on_record=None):
        v = self.verdicts[min(self.calls, len(self.verdicts) - 1)]
        self.calls += 1
        self.seen.append([p.detach().clone() for p in model.parameters()])
        return [{"task_id": t, "passed": ok} for t, ok in list(zip(self.task_ids, v))[rank::world]]

    def summarize(self, records):
        passed = sum(r["passed"] for r in records)
        return {"pass@1": passed / len(records), "passed": passed, "problems": len(records)}

    def truncation_note(self, score):
        return None


def _fit(run_dir: Path, task, steps=4, every=2, resume=None, finals: list | None = None, **overrides):
    cfg = TrainConfig(steps=steps, batch_size=2, seq_len=32, lr=3e-3, warmup=1, keep=5, seed=5, eval_task="seeded",
                      eval_task_every=every, **overrides)

    def save_final(model, final):
        if finals is not None:
            finals.append([p.detach().clone() for p in model.parameters()])

    trainer = build_trainer(tiny_model(), ListLoader(make_samples(16), 2, seed=3), ListLoader(make_samples(8, 99), 4),
                            cfg, run_dir, save_final=save_final, log=quiet, task_eval=task)
    trainer.begin(resume, {})
    return trainer.fit()


ALL = [True] * 12
DROP = [i < 2 for i in range(12)]  # 12 -> 2 passing: lost 10, gained 0, p = 2 / 2^10


def test_task_regression_warns_on_a_significant_drop(tmp_path, capsys):
    result = _fit(tmp_path / "r", SeededTask([ALL, ALL, DROP]))
    task = result["task"]
    unit = task["units"]["seeded"]
    assert unit["change"]["verdict"] == "regressed" and len(unit["change"]["lost"]) == 10
    assert unit["change"]["p_value"] == pytest.approx(2 / 2 ** 10) and unit["role"] == "target"
    assert [w["guard"] for w in task["warnings"]] == ["GUARD-TASK-REGRESSION"] and task["warnings"][0]["step"] == 4
    assert unit["start"]["passed"] == 12 and unit["end"]["passed"] == 2 and task["best"]["step"] == 2
    rows = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "task" in r]
    assert [(r["step"], r["passed"]) for r in rows] == [(0, 12), (2, 12), (4, 2)]
    per_problem = [json.loads(x) for x in (tmp_path / "r" / "task_eval" / "step-0000004.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in per_problem] == [f"p{i}" for i in range(12)]


def test_task_regression_stops_the_run_with_stop(tmp_path):
    with pytest.raises(GuardError) as e:
        _fit(tmp_path / "r", SeededTask([ALL, DROP]), on_task_regression="stop", save_every=2)
    assert e.value.guard_id == "GUARD-TASK-REGRESSION" and e.value.exit_code == 3
    d = e.value.details
    assert d["step"] == 2 and d["passed_before"] == 12 and d["passed_after"] == 2 and len(d["lost"]) == 10
    assert d["best_step"] == 0 and "starting model" in str(e.value)  # nothing trained beat the base
    assert not (tmp_path / "r" / "final").exists()


def test_task_regression_names_the_best_kept_checkpoint(tmp_path):
    base = [i < 10 for i in range(12)]
    with pytest.raises(GuardError) as e:  # 10/12, then 12/12 at step 2 (checkpointed), then 0/12 at step 4
        _fit(tmp_path / "r", SeededTask([base, ALL, [False] * 12]), on_task_regression="stop", save_every=2,
             steps=6)
    d = e.value.details
    assert d["step"] == 4 and d["best_step"] == 2
    assert d["checkpoint"] == str(tmp_path / "r" / "checkpoints" / "step-0000002") and "export gguf" in str(e.value)


def test_noise_level_change_is_not_a_regression(tmp_path):
    before = [i < 6 for i in range(12)]
    after = [i < 4 or i == 7 for i in range(12)]  # 6 -> 5: lost p4 and p5, gained p7: p = 1.0
    result = _fit(tmp_path / "r", SeededTask([before, before, after]), on_task_regression="stop")
    task = result["task"]
    assert task["warnings"] == [] and task["units"]["seeded"]["change"]["verdict"] == "no significant change"
    assert "a drop, not significant" in task["units"]["seeded"]["line"]


def test_keep_best_task_puts_the_best_steps_weights_into_final(tmp_path):
    best_at_2 = [[i < 4 for i in range(12)], [i < 8 for i in range(12)], [i < 5 for i in range(12)]]
    task, finals = SeededTask(best_at_2), []
    result = _fit(tmp_path / "r", task, keep_best="task", finals=finals)
    assert result["task"]["final_holds_step"] == 2 and result["task"]["best"]["step"] == 2
    step2, step4 = task.seen[1], task.seen[2]
    assert any(not torch.equal(a, b) for a, b in zip(step2, step4))  # training moved the weights
    assert all(torch.equal(a, b) for a, b in zip(finals[0], step2))
    task, finals = SeededTask(best_at_2), []  # the default keeps the last step's weights
    result = _fit(tmp_path / "r2", task, finals=finals)
    assert result["task"]["final_holds_step"] == 4 and all(torch.equal(a, b) for a, b in zip(finals[0], task.seen[2]))


def test_resume_keeps_step_zeros_results(tmp_path):
    _fit(tmp_path / "r", SeededTask([ALL, ALL]), steps=2, every=2, save_every=2)
    result = _fit(tmp_path / "r", SeededTask([DROP]), steps=4, every=2, resume="auto", allow_config_change=True)
    task = result["task"]["units"]["seeded"]  # step 0's 12/12 came from the first process, step 4's 2/12 from the second
    assert task["start"]["passed"] == 12 and task["end"]["passed"] == 2 and task["change"]["verdict"] == "regressed"


# ---- the command line --------------------------------------------------------------------------------------
@pytest.fixture()
def sft_rows(tmp_path) -> Path:
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": f"add {i} and {i}"},
                                                  {"role": "assistant", "content": f"{2 * i}"}]}) + "\n"
                         for i in range(8)))
    return f


def _finetune_with_task(tmp_path: Path, rows: Path, capsys, problems: int, *flags: str):
    """A tiny LoRA finetune with --eval-task on a file of `problems` passing problems t0, t1, ...:
    (exit code, --json summary, stderr, run directory)."""
    model = _tiny_dir(tmp_path, "m")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({**GOOD, "task_id": f"t{i}"}) + "\n" for i in range(problems)))
    out = tmp_path / "run"
    code, js, err = main(["finetune", "--model", str(model), "--data", str(rows), "--out", str(out),
                          "--mode", "lora", "--batch-size", "2", "--eval-task", str(tasks), "--no-preflight",
                          "--json", *flags], capsys)
    return code, js, err, out


def test_cli_finetune_eval_task_rows_files_and_summary(tmp_path, sft_rows, capsys):
    code, js, err, out = _finetune_with_task(tmp_path, sft_rows, capsys, 2, "--steps", "2", "--eval-task-every",
                                             "1", "--eval-task-max-new-tokens", "4", "--val-fraction", "0.25")
    assert code == 0, err
    task, unit = js["task"], js["task"]["units"]["tasks.jsonl"]
    assert unit["task"] == "tasks.jsonl" and unit["metric"] == "pass@1" and unit["start"]["problems"] == 2
    assert set(task["steps"]) == {"0", "1", "2"} and unit["change"]["problems"] == 2
    assert "training rows' system prompt" in err  # the run's own system prompt reaches the task prompts
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "task" in r]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["problems"] == 2 for r in rows)
    assert sorted(p.name for p in (out / "task_eval").iterdir()) == [f"step-000000{i}.jsonl" for i in range(3)]
    first = json.loads((out / "task_eval" / "step-0000000.jsonl").read_text().splitlines()[0])
    assert first["task_id"] == "t0" and {"passed", "completion", "code", "error"} <= set(first)
    # 4 new tokens finish no answer: each row says it was cut, the rows and the summary count them, a note says so
    assert first["truncated"] is True and all(r["truncated"] == 2 for r in rows) and unit["end"]["truncated"] == 2
    assert "step 0: tasks.jsonl: note: 2 of 2 completions stopped at --eval-task-max-new-tokens 4" in err
    code, js, err = main(["plot", str(out), "--json"], capsys)  # task rows do not break the curves
    assert code == 0, err


@pytest.mark.parametrize("limit", [1, -1])
def test_cli_eval_task_limit_takes_the_first_problems(tmp_path, sft_rows, capsys, limit):
    code, js, err, out = _finetune_with_task(tmp_path, sft_rows, capsys, 3, "--steps", "1", "--eval-task-limit",
                                             str(limit), "--eval-task-max-new-tokens", "2")
    if limit < 0:
        assert code == 2 and "--eval-task-limit must be >= 0" in err, err
        assert not (out / "metrics.jsonl").exists()
        return
    assert code == 0, err
    unit = js["task"]["units"]["tasks.jsonl"]
    assert unit["start"]["problems"] == 1 and unit["end"]["problems"] == 1
    rows = read_jsonl(out / "task_eval" / "step-0000000.jsonl")
    assert [r["task_id"] for r in rows] == ["t0"]  # the first N of the file, in its order


@pytest.mark.parametrize("flags,expect", [
    (["--eval-task-every", "2"], "needs --eval-task"),
    (["--keep-best", "task"], "needs --eval-task"),
    (["--eval-task", "no-such-task"], "not humaneval, bfcl"),
])
def test_cli_eval_task_flags_are_checked_before_training(tmp_path, sft_rows, capsys, flags, expect):
    model = _tiny_dir(tmp_path, "m")
    out = tmp_path / "run"
    code, _, err = main(["finetune", "--model", str(model), "--data", str(sft_rows), "--out", str(out),
                          "--mode", "lora", "--steps", "2", "--batch-size", "2", "--no-preflight", "--json", *flags],
                         capsys)
    assert code == 2 and expect in err, err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_cli_on_task_regression_warns_by_default_and_stops_with_stop(tmp_path, sft_rows, capsys, monkeypatch,
                                                                   policy):
    """`--on-task-regression` reaches the run through the command line: a drop of 12 -> 2 problems (p = 2/2^10) at
    step 2 is a warning in the summary by default (exit 0, final/ written) and GUARD-TASK-REGRESSION, exit 3 before
    final/, with stop. The verdicts are seeded (TaskEvaluator.run); the rest is the real command."""
    from entrenar.evaluate.in_loop import TaskEvaluator

    seeded = SeededTask([ALL, DROP])

    def seeded_run(self, model, rank=0, world=1, log=None, on_record=None):
        seeded.task_ids = self.task_ids  # the task file's problems, with the seeded verdicts
        return seeded.run(model, rank, world, log)
    monkeypatch.setattr(TaskEvaluator, "run", seeded_run)
    flags = ["--steps", "2", "--eval-task-every", "2"] + ([] if policy == "warn" else ["--on-task-regression", "stop"])
    code, js, err, out = _finetune_with_task(tmp_path, sft_rows, capsys, 12, *flags)
    assert seeded.calls == 2  # step 0 and step 2
    if policy == "warn":
        assert code == 0, err
        assert [w["guard"] for w in js["task"]["warnings"]] == ["GUARD-TASK-REGRESSION"]
        assert js["task"]["units"]["tasks.jsonl"]["change"]["verdict"] == "regressed" and (out / "final").is_dir()
        return
    assert code == 3 and js["guard"] == "GUARD-TASK-REGRESSION", err
    assert js["details"]["passed_before"] == 12 and js["details"]["passed_after"] == 2
    assert not (out / "final").exists()


def test_cli_eval_task_progress_has_an_eta_and_an_interrupt_says_what_was_kept(tmp_path, sft_rows, capsys,
                                                                               monkeypatch):
    """A CPU task eval waited 14 minutes with no output: each batch is now announced and followed by a line with an
    ETA, prefixed with the step. Ctrl-C in the task eval of step 2: the problems it finished are in
    task_eval/step-0000002.partial.jsonl and the message says so (and that --resume runs the eval again)."""
    from entrenar.evaluate import harness

    real, calls = harness.run_program, []

    def run_program(src, limits):
        calls.append(1)
        if len(calls) == 5:  # step 0 ran 3 programs; the second of step 2's
            raise KeyboardInterrupt
        return real(src, limits)

    monkeypatch.setattr(harness, "run_program", run_program)
    code, _, err, out = _finetune_with_task(tmp_path, sft_rows, capsys, 3, "--steps", "2",
                                            "--eval-task-max-new-tokens", "2", "--val-fraction", "0")
    assert "step 0: tasks.jsonl problems 1-3 of 3: generating" in err
    assert "step 0: tasks.jsonl 3/3 problems, 0 passing samples so far (" in err and "ETA" in err
    assert code == 130, err
    partial = out / "task_eval" / "step-0000002.partial.jsonl"
    kept = partial.read_text().splitlines()
    assert f"step 2: tasks.jsonl eval interrupted: the {len(kept)} problems it finished are in {partial}" in err
    assert "--resume runs this eval again" in err and len(kept) <= 2
    assert not (out / "task_eval" / "step-0000000.partial.jsonl").exists()  # a finished eval leaves the whole file
    assert (out / "task_eval" / "step-0000000.jsonl").is_file()
