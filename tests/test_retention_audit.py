"""An audit of the retention features (the task panel, GUARD-TASK-REGRESSION, `--keep-best task`, `eval --compare`,
the `chat` task) against docs/design.md: each test guards a promise no other test would see broken.

- `--compare` pairs the two files' problems by task id (not by their position in the files) and reads sample 0 only;
- `--keep-best task` sums the *target* units only (a retained task's gains buy nothing), and falls back to the least
  bad trained step only when no trained step kept every retained task;
- GUARD-TASK-REGRESSION with stop names every unit that dropped, with the problems it lost;
- the chat task's drift in a run is measured against step 0's answers, not each step's own;
- Holm's adjusted p-values are capped at 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from entrenar.errors import GuardError
from entrenar.evaluate import chat_task, in_loop
from entrenar.evaluate.compare import compare_results
from entrenar.evaluate.paired import holm, panel_changes
from entrenar.evaluate.panel import PanelMember, TaskPanel
from entrenar.train import guards
from tests.test_task_in_loop import ALL, SeededTask, _fit


def _n(k: int, size: int = 12) -> list[bool]:
    return [i < k for i in range(size)]


def _panel(target: list[list[bool]], retained: list[list[bool]]) -> tuple[TaskPanel, SeededTask, SeededTask]:
    t, r = SeededTask(target), SeededTask(retained)
    t.name, r.name = "target-task", "kept-task"
    return TaskPanel([PanelMember(t, "target"), PanelMember(r, "retain")]), t, r


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- eval --compare: paired by task id --------------------------------------------------------------------------
def test_compare_pairs_problems_by_task_id_not_by_position(tmp_path):
    """BEFORE passes h0-h5 and fails h6-h11; AFTER holds the same verdicts in reverse file order, with an extra
    problem BEFORE never saw first. Paired by task id nothing changed (p = 1); paired by position 12 problems would
    flip. Later samples of a problem (sample 1, every one failed) never replace sample 0's verdict."""
    before = [{"task_id": f"h{i}", "sample": 0, "passed": i < 6} for i in range(12)]
    after = [{"task_id": "extra", "sample": 0, "passed": False}]
    after += [{"task_id": f"h{i}", "sample": s, "passed": i < 6 and s == 0} for i in reversed(range(12))
              for s in (0, 1)]
    c = compare_results(_write(tmp_path / "b.jsonl", before), _write(tmp_path / "a.jsonl", after), "humaneval")
    ch = c["units"]["humaneval"]
    assert ch["problems"] == 12 and ch["passed_before"] == 6 and ch["passed_after"] == 6
    assert ch["gained"] == [] and ch["lost"] == [] and ch["p_value"] == 1.0
    assert ch["verdict"] == "no significant change"
    # a real change is attributed to the right problems whatever the order of the rows
    after = [{"task_id": f"h{i}", "passed": i in (0, 1, 7)} for i in reversed(range(12))]
    ch = compare_results(tmp_path / "b.jsonl", _write(tmp_path / "a2.jsonl", after), "humaneval")["units"]["humaneval"]
    assert ch["lost"] == ["h2", "h3", "h4", "h5"] and ch["gained"] == ["h7"]


# ---- --keep-best task ------------------------------------------------------------------------------------------
def test_keep_best_task_counts_the_target_units_only(tmp_path):
    """Step 2 has the most target problems (10); step 4 fewer targets (8) but the retained task passes 4 more (not
    significant alone): summed over every unit step 4 would look best (20 > 18). The targets decide: step 2."""
    panel, target, _ = _panel([_n(4), _n(10), _n(8)], [_n(8), _n(8), ALL])
    finals: list = []
    result = _fit(tmp_path / "r", panel, steps=4, every=2, keep_best="task", finals=finals)
    task = result["task"]
    assert task["best"] == {"step": 2, "targets_passed": 10, "targets_problems": 12}
    assert task["final_holds_step"] == 2 and task["keep_best"]["eligible"] is True
    assert all(torch.equal(a, b) for a, b in zip(finals[0], target.seen[1]))


def test_keep_best_task_keeps_an_eligible_step_over_the_least_bad_one(tmp_path):
    """Step 2 kept the retained task (with fewer targets than the base: 8 < 10); step 4 had the most targets (12)
    but lost the whole retained task. A trained step qualified, so there is no fallback: final/ holds the best
    qualifying step, the base (step 0), never step 4 with its significant retained drop."""
    panel, target, _ = _panel([_n(10), _n(8), _n(12)], [ALL, ALL, _n(0)])
    finals: list = []
    result = _fit(tmp_path / "r", panel, steps=4, every=2, keep_best="task", finals=finals)
    task = result["task"]
    assert task["units"]["kept-task"]["change"]["verdict"] == "regressed"  # step 4 is not eligible
    assert task["keep_best"]["eligible"] is True and task["keep_best"]["step"] == 0, task["keep_best"]
    assert task["best"]["step"] == 0 and task["final_holds_step"] == 0
    assert all(torch.equal(a, b) for a, b in zip(finals[0], target.seen[0]))  # the base's weights


# ---- GUARD-TASK-REGRESSION ---------------------------------------------------------------------------------------
def test_task_regression_stop_names_every_dropped_unit_and_its_lost_problems(tmp_path):
    """Two retained units drop significantly at once: the stop message names each with its counts and the problems
    it lost, and the details list both units."""
    a, b = SeededTask([ALL, _n(0)]), SeededTask([ALL, _n(1)])
    a.name, b.name = "kept-a", "kept-b"
    t = SeededTask([_n(4), _n(4)])
    t.name = "target-task"
    panel = TaskPanel([PanelMember(t, "target"), PanelMember(a, "retain"), PanelMember(b, "retain")])
    with pytest.raises(GuardError) as e:
        _fit(tmp_path / "r", panel, steps=2, every=2, on_task_regression="stop")
    assert e.value.exit_code == 3 and e.value.details["units"] == ["kept-a", "kept-b"]
    msg = str(e.value)
    assert "kept-a fell from 12/12 at step 0 to 0/12 (lost 12: p0, p1," in msg
    assert "kept-b fell from 12/12 at step 0 to 1/12 (lost 11: p1, p2," in msg


def test_task_regression_warning_lists_each_unit_once():
    drop = panel_changes({"x": {f"p{i}": True for i in range(12)}, "y": {f"p{i}": True for i in range(12)}},
                         {"x": {f"p{i}": False for i in range(12)}, "y": {f"p{i}": i < 1 for i in range(12)}})
    text = guards.task_regression(list(drop.items()), 4, "warn", (0, "targets 0/0", None), "")
    assert text is not None and "x fell from 12/12" in text and "y fell from 12/12 at step 0 to 1/12" in text


# ---- the chat task's drift in a run -----------------------------------------------------------------------------
class _Completion:
    def __init__(self, text: str):
        self.text, self.truncated = text, False


def test_chat_drift_in_a_run_scores_step_zeros_answers(monkeypatch):
    """The base of the drift is the step-0 model: every later run scores the step-0 answers under its model (not
    its own answers, which would make the drift 0 whatever the fine-tune did); each record keeps its own answer."""
    version = [0]  # which "model" answers: 0 at step 0, then 1, 2

    def fake_completer(model, tok, max_new, chat, *, token_ids, **_: Any):
        def complete(prompts, seeds):
            out = []
            for p in prompts:
                token_ids[tuple(p)] = [100 + version[0], p[0]]  # this model's answer to this prompt
                out.append(_Completion("The capital of France is Paris."))
            return out
        return complete

    scored: list[list[list[int]]] = []

    def fake_logp(model, prompts, answers, device, bf16=False):
        scored.append([list(a) for a in answers])
        return [(-1.0 * len(a), len(a)) for a in answers]

    monkeypatch.setattr(in_loop, "entrenar_completer", fake_completer)
    monkeypatch.setattr(chat_task, "answers_logp", fake_logp)
    tok = SimpleNamespace(chat_template="t", encode_chat=lambda msgs, add_generation_prompt: SimpleNamespace(
        ids=[len(msgs[0]["content"]), 7]))
    ev = in_loop.ChatEvaluator(tok, limit=3, batch_size=2)
    model = torch.nn.Linear(2, 2)
    own = []
    for v in range(3):
        version[0] = v
        records = ev.run(model)
        own.append([r["answer_ids"] for r in records])
        assert all(a[0] == 100 + v for a in own[-1])  # each record keeps this model's own answer
    assert scored[0] == own[0] and scored[1] == own[0] and scored[2] == own[0], scored
    # a resumed process reads step 0's answers back and scores them, not its own
    ev2 = in_loop.ChatEvaluator(tok, limit=3, batch_size=2)
    ev2.set_base_answers([{"task_id": r.task_id, "answer_ids": a} for r, a in zip(ev.items, own[0])])
    version[0] = 5
    ev2.run(model)
    assert scored[-1] == own[0]


# ---- Holm ----------------------------------------------------------------------------------------------------
def test_holm_adjusted_p_is_capped_at_one_and_monotone():
    assert holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}  # 2 x 0.6 = 1.2, capped; 0.7 made monotone
    got = holm({"a": 0.01, "b": 0.012, "c": 0.5})  # 3 x 0.01 = 0.03, 2 x 0.012 = 0.024 -> 0.03 (monotone), 0.5
    assert got == pytest.approx({"a": 0.03, "b": 0.03, "c": 0.5})
    changes = panel_changes({"u": {"p0": True, "p1": False}, "v": {"p0": True}},
                            {"u": {"p0": False, "p1": True}, "v": {"p0": True}})
    assert changes["u"]["p_holm"] == 1.0 and changes["v"]["p_holm"] == 1.0


# ---- curves.png ------------------------------------------------------------------------------------------------
def test_curves_png_draws_one_line_per_unit(tmp_path, monkeypatch):
    """metrics.jsonl holds rows of three units (two BFCL categories, accuracy; humaneval, pass@1): curves.png has
    one line per unit, each through its own points."""
    import matplotlib.axes

    from entrenar.plot import plot_run

    rows: list[dict[str, Any]] = [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tok_s": 10.0}
                                  for s in range(1, 5)]
    for s in (0, 4):
        rows += [{"step": s, "task": "bfcl:simple_python", "metric": "accuracy", "accuracy": 0.1 + s / 10},
                 {"step": s, "task": "bfcl:irrelevance", "metric": "accuracy", "accuracy": 0.9 - s / 10},
                 {"step": s, "task": "humaneval", "metric": "pass@1", "pass@1": 0.05}]
    _write(tmp_path / "metrics.jsonl", rows)
    drawn: list[tuple[Any, list, list]] = []
    real = matplotlib.axes.Axes.plot

    def plot(self, xs, ys, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(xs), list(ys)))
        return real(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    plot_run(tmp_path)
    lines = {tuple(ys) for _, xs, ys in drawn if xs == [0, 4]}
    assert lines == {(0.1, 0.5), (0.9, 0.5), (0.05, 0.05)}, drawn
