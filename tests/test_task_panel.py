"""The task panel of a run: targets (`--eval-task`, several) and retained tasks (`--retain-task`), every task and
every BFCL category tested on its own against step 0 (exact McNemar, Holm over the panel), GUARD-TASK-REGRESSION
on a drop of any unit, `--keep-best task` among the steps that kept every retained task; the `chat` task's gates
and its drift from the base.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from entrenar.evaluate.chat_task import (
    CHAT_SET,
    ChatRequest,
    answers_logp,
    chat_gates,
    chat_summary,
    tool_call_in,
)
from entrenar.evaluate.paired import holm, panel_changes
from entrenar.evaluate.panel import PanelMember, TaskPanel
from entrenar.train.metrics import read_jsonl
from tests.helpers.cli import run_cli as main
from tests.test_eval_task import GOOD, _tiny_dir
from tests.test_task_in_loop import ALL, SeededTask, _fit


# ---- Holm over the panel ----------------------------------------------------------------------------------
def test_holm_known_values():
    # R: p.adjust(c(0.01, 0.04, 0.03, 0.005), "holm") = 0.03 0.06 0.06 0.02
    got = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert got == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02})
    assert holm({"x": 0.2}) == {"x": 0.2} and holm({}) == {}


def _holm_rejects(p: dict[str, float], alpha: float) -> set[str]:
    """Holm's procedure as written in the paper: walk the sorted p-values, reject while p_(i) <= alpha/(m-i)."""
    out = set()
    for i, (k, v) in enumerate(sorted(p.items(), key=lambda kv: kv[1])):
        if v > alpha / (len(p) - i):
            break
        out.add(k)
    return out


def test_holm_adjusted_p_rejects_exactly_what_the_procedure_rejects():
    rng = random.Random(3)
    for _ in range(200):
        p = {f"u{i}": rng.choice([rng.random(), rng.random() / 50]) for i in range(rng.randint(1, 8))}
        adjusted = holm(p)
        for alpha in (0.01, 0.05, 0.1):
            assert {k for k, v in adjusted.items() if v <= alpha} == _holm_rejects(p, alpha)


def test_panel_of_noise_level_drops_stays_quiet_and_a_real_drop_fires():
    before = {f"u{i}": {f"p{j}": True for j in range(12)} for i in range(8)}
    marginal = {f"p{j}": j >= 6 for j in range(12)}  # lost 6, gained 0: p = 0.03125 alone, not over 8 units
    after = {u: dict(marginal) for u in before}
    changes = panel_changes(before, after)
    assert all(c["p_value"] == pytest.approx(0.03125) for c in changes.values())
    assert all(c["verdict"] == "no significant change" for c in changes.values())
    after["u3"] = {f"p{j}": False for j in range(12)}  # lost 12: p = 2/4096, x8 = 0.0039
    changes = panel_changes(before, after)
    assert [u for u, c in changes.items() if c["verdict"] == "regressed"] == ["u3"]
    assert changes["u3"]["p_holm"] == pytest.approx(8 * 2 / 4096)


# ---- the Trainer with a seeded panel ------------------------------------------------------------------------
class SeededBfcl(SeededTask):
    """A seeded BFCL-like task: its problems belong to categories, each category its own unit."""

    kind = "bfcl"
    metric = "accuracy"

    def __init__(self, name: str, categories: list[str], verdicts: list[list[bool]]):
        super().__init__(verdicts)
        self.name, self.categories = name, categories

    def run(self, model, rank=0, world=1, log=None, on_record=None):
        records = super().run(model, rank, world, log, on_record)
        for r in records:
            r["category"] = self.categories[int(r["task_id"][1:])]
        return records

    def summarize(self, records):
        passed = sum(r["passed"] for r in records)
        return {"accuracy": passed / len(records), "passed": passed, "problems": len(records)}


def test_a_retained_category_drop_is_not_hidden_by_a_target_categorys_gain(tmp_path):
    """The pooled count of simple + irrelevance stays 12/24 -> 12/24 (what a pooled test called "no change", or a
    gain when the gains outnumber); per category the irrelevance drop is significant and the guard names it."""
    cats = ["simple"] * 12 + ["irrelevance"] * 12
    start = [False] * 12 + [True] * 12
    end = [True] * 12 + [False] * 12
    result = _fit(tmp_path / "r", SeededBfcl("bfcl:simple,irrelevance", cats, [start, start, end]))
    units = result["task"]["units"]
    assert set(units) == {"bfcl:simple", "bfcl:irrelevance"}
    assert units["bfcl:simple"]["change"]["verdict"] == "improved"
    assert units["bfcl:irrelevance"]["change"]["verdict"] == "regressed"
    assert [(w["guard"], w["task"]) for w in result["task"]["warnings"]] == [("GUARD-TASK-REGRESSION",
                                                                             "bfcl:irrelevance")]
    rows = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "task" in r]
    assert {(r["step"], r["task"]) for r in rows} == {(s, u) for s in (0, 2, 4) for u in units}
    per_problem = read_jsonl(tmp_path / "r" / "task_eval" / "step-0000004.jsonl")
    assert {r["unit"] for r in per_problem} == set(units) and len(per_problem) == 24


def _panel(target: list[list[bool]], retained: list[list[bool]]) -> tuple[TaskPanel, SeededTask, SeededTask]:
    t, r = SeededTask(target), SeededTask(retained)
    t.name, r.name = "target-task", "kept-task"
    return TaskPanel([PanelMember(t, "target"), PanelMember(r, "retain")]), t, r


def _n(k: int) -> list[bool]:
    return [i < k for i in range(12)]


def test_retained_drop_fires_and_stop_names_it(tmp_path):
    from entrenar.errors import GuardError

    panel, _, _ = _panel([_n(4), _n(10)], [ALL, _n(0)])
    with pytest.raises(GuardError) as e:
        _fit(tmp_path / "r", panel, steps=2, every=2, on_task_regression="stop")
    assert e.value.details["task"] == "kept-task" and e.value.details["units"] == ["kept-task"]
    assert "kept-task fell from 12/12 at step 0 to 0/12" in str(e.value)


def test_keep_best_task_skips_a_step_where_a_retained_task_dropped(tmp_path):
    panel, target, _ = _panel([_n(4), _n(10), _n(8), _n(5)], [ALL, _n(0), ALL, ALL])
    finals: list = []
    result = _fit(tmp_path / "r", panel, steps=6, every=2, keep_best="task", finals=finals)
    task = result["task"]
    assert task["best"]["step"] == 4 and task["final_holds_step"] == 4 and task["keep_best"]["eligible"]
    assert all(torch.equal(a, b) for a, b in zip(finals[0], target.seen[2]))  # step 4's weights, not step 2's


def test_keep_best_task_with_no_eligible_step_keeps_the_least_bad_and_says_so(tmp_path):
    panel, target, _ = _panel([_n(4), _n(10), _n(8)], [ALL, _n(2), _n(0)])
    finals: list = []
    result = _fit(tmp_path / "r", panel, steps=4, every=2, keep_best="task", finals=finals)
    task = result["task"]
    assert task["keep_best"]["eligible"] is False and "least bad" in task["keep_best"]["reason"]
    assert task["final_holds_step"] == 2  # lost 10 of the retained task at step 2, 12 at step 4
    assert all(torch.equal(a, b) for a, b in zip(finals[0], target.seen[1]))


def test_resume_keeps_the_panels_units(tmp_path):
    panel, _, _ = _panel([_n(4), _n(4)], [ALL, ALL])
    _fit(tmp_path / "r", panel, steps=2, every=2, save_every=2)
    panel, _, _ = _panel([_n(4)], [_n(0)])
    result = _fit(tmp_path / "r", panel, steps=4, every=2, resume="auto", allow_config_change=True)
    units = result["task"]["units"]
    assert units["kept-task"]["start"]["passed"] == 12 and units["kept-task"]["change"]["verdict"] == "regressed"


# ---- the chat task ----------------------------------------------------------------------------------------
def test_chat_set_has_at_least_100_distinct_requests():
    assert len(CHAT_SET) >= 100 and len({r.task_id for r in CHAT_SET}) == len(CHAT_SET)
    assert {r.topic for r in CHAT_SET} == {"fact", "explain", "code"}


FACT = ChatRequest("f", "What is the capital of France?", "fact", ("Paris",))
CODE = ChatRequest("c", "Write a Python function add(a, b).", "code", ("def",))


@pytest.mark.parametrize("request_,text,failed", [
    (FACT, "The capital of France is Paris.", set()),
    (FACT, "I'm sorry for any confusion, but as an AI, I can't answer personal questions.", {"no_refusal", "coherent"}),
    (FACT, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', {"no_tool_call"}),
    (FACT, '{"name": "get_weather", "arguments": {"city": "Paris"}}', {"no_tool_call"}),
    (FACT, "It is Lyon, a lovely city.", {"coherent"}),
    (FACT, "", {"non_empty", "coherent"}),
    (FACT, "Paris Paris Paris Paris", {"no_repetition"}),
    (CODE, "```python\ndef add(a, b):\n    return a + b\n```", set()),
    (CODE, "```python\ndef add(a, b)\n    return a + b\n```", {"code_parses"}),
])
def test_chat_gates(request_, text, failed):
    gates, notes = chat_gates(request_, text)
    assert {g for g, ok in gates.items() if not ok} == failed, notes


def test_a_plain_answer_mentioning_braces_is_no_tool_call():
    assert not tool_call_in("Use a dict like {'a': 1} to map keys.") and not tool_call_in("[1, 2, 3]")
    assert tool_call_in('```json\n[{"name": "f", "arguments": {}}]\n```')


def test_answers_logp_is_the_float64_log_likelihood_of_the_answer_tokens():
    from tests.test_train_loop import tiny_model

    model = tiny_model().eval()
    prompts, answers = [[1, 2, 3], [4, 5]], [[6, 7], [8]]
    got = answers_logp(model, prompts, answers, "cpu")
    for (logp, n), p, a in zip(got, prompts, answers):
        ids = torch.tensor([p + a])
        with torch.no_grad():
            logits = model(ids[:, :-1]).double()
        ref = torch.log_softmax(logits, -1)[0, len(p) - 1:].gather(-1, torch.tensor(a)[:, None]).sum().item()
        assert n == len(a) and logp == pytest.approx(ref, rel=1e-5)


def test_chat_summary_weights_the_drift_by_tokens():
    recs = [{"passed": True, "gates": {}, "base_logp": -2.0, "base_tokens": 1},
            {"passed": False, "gates": {"no_refusal": False}, "base_logp": -6.0, "base_tokens": 3}]
    s = chat_summary(recs)
    assert s["base_answer_logp"] == pytest.approx(-2.0) and s["passed"] == 1 and s["gate_failures"]["no_refusal"] == 1


# ---- the command line ---------------------------------------------------------------------------------------
@pytest.fixture()
def rows(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"add {i} and {i}"},
                                                  {"role": "assistant", "content": f"{2 * i}"}]}) + "\n"
                         for i in range(8)))
    return f


def _tasks(tmp_path, name, n):
    f = tmp_path / name
    f.write_text("".join(json.dumps({**GOOD, "task_id": f"t{i}"}) + "\n" for i in range(n)))
    return f


def test_cli_targets_and_retained_tasks_with_chat(tmp_path, rows, capsys):
    model = _tiny_dir(tmp_path, "m")
    a, b = _tasks(tmp_path, "a.jsonl", 2), _tasks(tmp_path, "b.jsonl", 1)
    out = tmp_path / "run"
    code, js, err = main(["finetune", "--model", str(model), "--data", str(rows), "--out", str(out), "--mode", "lora",
                          "--batch-size", "2", "--steps", "1", "--no-preflight", "--json", "--eval-task", str(a),
                          "--eval-task", str(b), "--retain-task", "chat", "--eval-task-limit", "2",
                          "--eval-task-max-new-tokens", "3"], capsys)
    assert code == 0, err
    task = js["task"]
    assert task["targets"] == ["a.jsonl", "b.jsonl"] and task["retained"] == ["chat"]
    assert {u: e["role"] for u, e in task["units"].items()} == {"a.jsonl": "target", "b.jsonl": "target",
                                                                 "chat": "retain"}
    chat = task["units"]["chat"]
    assert chat["metric"] == "pass_rate" and chat["start"]["problems"] == 2
    assert isinstance(chat["start"]["base_answer_logp"], float) and isinstance(chat["end"]["base_answer_logp"], float)
    assert "retain chat:" in err and "target a.jsonl:" in err
    rows_ = [r for r in read_jsonl(out / "metrics.jsonl") if "task" in r]
    assert sorted((r["step"], r["task"], r["role"]) for r in rows_) == sorted(
        (s, t, "retain" if t == "chat" else "target") for s, t in itertools.product((0, 1), ("a.jsonl", "b.jsonl",
                                                                                             "chat")))


@pytest.mark.parametrize("flags,expect", [
    (["--eval-task", "A", "--retain-task", "A"], "a task given twice"),
    (["--retain-task", "B", "--keep-best", "task"], "--keep-best task needs --eval-task: it picks"),
    (["--retain-task", "no-such-task"], "--retain-task no-such-task: not humaneval"),
])
def test_cli_panel_flags_are_checked_before_training(tmp_path, rows, capsys, flags, expect):
    model = _tiny_dir(tmp_path, "m")
    a = _tasks(tmp_path, "a.jsonl", 1)
    flags = [str(a) if f in ("A", "B") else f for f in flags]
    out = tmp_path / "run"
    code, _, err = main(["finetune", "--model", str(model), "--data", str(rows), "--out", str(out), "--mode", "lora",
                         "--steps", "1", "--batch-size", "2", "--no-preflight", "--json", *flags], capsys)
    assert code == 2 and expect in err, err
    assert not (out / "metrics.jsonl").exists()
