"""The rewards of `finetune --objective grpo` (train/rewards.py): bfcl (BFCL's verdict on `data sft-from-bfcl` rows,
by BFCL id and from the row alone), bfcl-graded (its documented decomposition), tests / tests-all (the sandbox, the
share of a row's tests passed), python:FILE:FUNC (its own process: a bad return, an exception and a timeout are exit 2
naming FILE:LINE), and the specs' names and weights."""

from __future__ import annotations

import json

import pytest

from entrenar.errors import InputError
from entrenar.train import rewards as R


def hermes(calls: list[dict]) -> str:
    return "".join(f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c['arguments']})}\n</tool_call>"
                   for c in calls)


def truth_calls(row: dict) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": dict(c["function"]["arguments"])}
            for c in row["messages"][-1]["tool_calls"]]


@pytest.fixture(scope="module")
def bfcl_rows() -> list[dict]:
    from entrenar.data.bfcl_data import sft_rows_from_bfcl

    try:
        rows, _ = sft_rows_from_bfcl(["live_simple", "live_multiple"])
    except InputError as e:
        pytest.skip(str(e))
    return rows[:12] + rows[-12:]


def test_bfcl_pays_the_ground_truth_and_not_a_wrong_value(bfcl_rows):
    truths = [hermes(truth_calls(r)) for r in bfcl_rows]
    assert R.bfcl_reward([""] * len(truths), truths, bfcl_rows) == [1.0] * len(truths)
    # the same rows without their BFCL id: judged against the row's own calls
    anonymous = [{k: v for k, v in r.items() if k != "id"} for r in bfcl_rows]
    assert R.bfcl_reward([""] * len(truths), truths, anonymous) == [1.0] * len(truths)
    wrong = []
    for r in bfcl_rows:
        calls = truth_calls(r)
        arg = next(iter(calls[0]["arguments"]))
        calls[0]["arguments"][arg] = "a value no answer has" if not isinstance(calls[0]["arguments"][arg], str) \
            else 123456789
        wrong.append(hermes(calls))
    assert R.bfcl_reward([""] * len(wrong), wrong, bfcl_rows) == [0.0] * len(wrong)
    assert R.bfcl_reward([""], ["I cannot help with that."], bfcl_rows[:1]) == [0.0]


ROW = {"tools": [{"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "required": ["value", "unit"],
    "properties": {"value": {"type": "number"}, "unit": {"type": "string"}, "digits": {"type": "integer"}}}}}],
    "messages": [{"role": "user", "content": "5 inches in cm?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "convert",
                                                        "arguments": {"value": 5.0, "unit": "inches"}}}]}]}


@pytest.mark.parametrize("text,parts", [
    (hermes([{"name": "convert", "arguments": {"value": 5.0, "unit": "inches"}}]), (1, 1, 1, 1)),
    (hermes([{"name": "convert", "arguments": {"value": 5.0, "unit": "cm"}}]), (1, 1, 1, 0.5)),  # the case
    (hermes([{"name": "convert", "arguments": {"value": 5.0}}]), (1, 1, 0.5, 0.5)),
    (hermes([{"name": "convert", "arguments": {"value": 5.0, "unit": "Inches", "digits": 2}}]),
     (1, 1, 2 / 3, 1)),  # BFCL's string rule: case ignored; an argument not in the answer costs its name share
    (hermes([{"name": "other", "arguments": {"value": 5.0, "unit": "inches"}}]), (1, 0, 0, 0)),
    ("convert(value=5, unit='inches')", (1, 1, 1, 1)),  # Python call syntax; 5 == 5.0
    ("no call at all", (0, 0, 0, 0)),
], ids=["right", "wrong-value", "missing-arg", "extra-arg", "wrong-name", "python-syntax", "no-call"])
def test_bfcl_graded_decomposition(text, parts):
    got = R.graded_score(R.question_of_row(ROW), text)
    expected = dict(zip(("format", "name", "arg_names", "arg_values"), parts, strict=True))
    for k, v in expected.items():
        assert got[k] == pytest.approx(v), (k, got)
    total = sum(R.GRADED_WEIGHTS[k] * v for k, v in expected.items())
    assert got["total"] == pytest.approx(total)
    assert R.bfcl_graded_reward([""], [text], [ROW]) == [pytest.approx(total)]


def test_graded_no_call_answer_pays_no_call():
    row = {**ROW, "messages": [ROW["messages"][0], {"role": "assistant", "content": "I cannot."}]}
    assert R.bfcl_graded_reward(["", ""], ["I will not call.", hermes([{"name": "convert", "arguments": {}}])],
                                [row, row]) == [1.0, 0.0]
    assert R.bfcl_reward(["", ""], ["I will not call.", hermes([{"name": "convert", "arguments": {}}])],
                         [row, row]) == [1.0, 0.0]


TASK = {"task_id": "add", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n", "entry_point": "add",
        "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n",
        "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 5"]}


def test_tests_reward_runs_the_sandbox():
    right = "def add(a, b):\n    return a + b\n```"
    wrong = "def add(a, b):\n    return a - b\n```"
    assert R.tests_reward(False)(["", ""], [right, wrong], [TASK, TASK]) == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert R.tests_reward(True)(["", ""], [right, wrong], [TASK, TASK]) == [0.0, 0.0]
    humaneval_form = {k: v for k, v in TASK.items() if k != "tests"}
    assert R.tests_reward(False)(["", ""], [right, wrong], [humaneval_form] * 2) == [1.0, 0.0]
    all_pass = {**TASK, "tests": TASK["tests"][:2]}
    assert R.tests_reward(True)([""], [right], [all_pass]) == [1.0]
    hang = "def add(a, b):\n    while True:\n        pass\n```"
    assert R.tests_reward(False)([""], [hang], [humaneval_form]) == [0.0]


USER = '''\
import time


def good(prompt, completion, row):
    return len(completion) + row["bonus"]


def text(prompt, completion, row):
    return "x"


def boom(prompt, completion, row):
    return 1 / 0


def slow(prompt, completion, row):
    time.sleep(30)
    return 0.0


def nan(prompt, completion, row):
    return float("nan")
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_reward.py"
    path.write_text(USER)
    return path


def test_python_reward_runs_in_its_own_process(user_file):
    f = R.PythonReward(str(user_file), "good")
    assert f(["p", "p"], ["ab", "abcd"], [{"bonus": 1}, {"bonus": 0.5}]) == [3.0, 4.5]


@pytest.mark.parametrize("func,line,needle", [("text", 8, "returned 'x'"), ("boom", 13, "ZeroDivisionError"),
                                              ("nan", 21, "returned nan")])
def test_python_reward_errors_name_file_line(user_file, func, line, needle):
    with pytest.raises(InputError) as e:
        R.PythonReward(str(user_file), func)(["p"], ["c"], [{}])
    assert f"{user_file.resolve()}:{line}:" in str(e.value) and needle in str(e.value)


def test_python_reward_time_limit(user_file, monkeypatch):
    monkeypatch.setattr(R, "PYTHON_REWARD_TIMEOUT_S", 0.5)
    with pytest.raises(InputError, match=r"user_reward.py:16: slow took more than 0.5 s"):
        R.PythonReward(str(user_file), "slow")(["p"], ["c"], [{}])


def test_specs_names_weights_and_refusals(user_file):
    rewards = R.parse_rewards(["bfcl", "bfcl-graded:0.5", f"python:{user_file}:good:2", "tests-all:-1"])
    assert rewards.names == ["bfcl", "bfcl-graded", f"python:{user_file}:good", "tests-all"]
    assert rewards.weights == [1.0, 0.5, 2.0, -1.0]
    with pytest.raises(InputError, match="defines no top-level function missing"):
        R.parse_reward(f"python:{user_file}:missing")
    with pytest.raises(InputError, match="unknown reward 'bleu'"):
        R.parse_reward("bleu")
    with pytest.raises(InputError, match="at least one --reward"):
        R.parse_rewards([])
