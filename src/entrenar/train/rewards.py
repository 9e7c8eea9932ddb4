"""The rewards of `finetune --objective grpo --reward SPEC` (several `--reward` flags are summed with their weights).

A reward is a plain callable, TRL's style: `reward(prompts, completions, rows) -> list[float]`, one value per
completion (the prompt's text, the completion's text without its stop token, the prompt's JSONL row). SPEC is
NAME[:WEIGHT] (weight 1 when left out):

  bfcl                BFCL's AST verdict, 1 or 0 (evaluate/bfcl.py `score`): the calls read from the completion
                      (`parse_calls`) against the row's ground truth. A row whose "id" is a BFCL question (`data
                      sft-from-bfcl` rows) is judged against BFCL's own possible answers; any other row with "tools"
                      and an assistant turn with "tool_calls" against those calls (each argument its one allowed
                      value, the tools' parameters not called optional). A row whose answer has no call
                      (irrelevance): 1 iff no call is made.
  bfcl-graded         a decomposed score in [0, 1] (ToolRL's idea): GRADED_WEIGHTS x (format: at least one call read
                      and nothing unreadable; function names: the share of the answer's calls whose name is called,
                      matched one to one; argument names: for matched calls, the Jaccard overlap of the argument
                      names; argument values: for matched calls, the share of the answer's arguments given an allowed
                      value, BFCL's string rules). A full BFCL pass scores 1. No-call answers: 1 iff no call.
  tests               the completion's code (as `eval --task humaneval` extracts it, chat format) run in the sandbox
                      (evaluate/sandbox.py, the same isolation) against the row's tests: the share of "tests" (a list
                      of assertion snippets, `data tasks-from-code` rows) that pass; a row with only "test" (HumanEval
                      form, check(entry_point)) scores 1 or 0.
  tests-all           1 iff every test passes, else 0.
  python:FILE.py:FUNC the user's FUNC(prompt, completion, row) -> float, run in a separate Python process
                      (reward_worker.py) with PYTHON_REWARD_TIMEOUT_S per completion at most; a return that is not a
                      finite number is exit 2 naming FILE:LINE of FUNC.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import InputError

# bfcl-graded's weights: format, function names, argument names, argument values (sum 1)
GRADED_WEIGHTS = {"format": 0.2, "name": 0.2, "arg_names": 0.2, "arg_values": 0.4}
PYTHON_REWARD_TIMEOUT_S = 10.0  # per completion: a python: reward's batch may take this x its completions
BUILTIN = ("bfcl", "bfcl-graded", "tests", "tests-all")
WORKER = Path(__file__).with_name("reward_worker.py")
TESTS_MARK = "GRPO-TESTS-PASSED"
TESTS_WORKERS = max(1, min(8, os.cpu_count() or 1))  # sandboxed programs run at once by the tests rewards

Reward = Callable[[Sequence[str], Sequence[str], Sequence[dict]], list[float]]


class Rewards:
    """Several rewards with their names and weights: calling it gives each completion's rewards [N][K]."""

    def __init__(self, funcs: list[Reward], names: list[str], weights: list[float]):
        self.funcs, self.names, self.weights = funcs, names, weights

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict]) -> list[list[float]]:
        columns = []
        for f, name in zip(self.funcs, self.names, strict=True):
            values = list(f(prompts, completions, rows))
            if len(values) != len(completions):
                raise InputError(f"--reward {name}: gave {len(values)} values for {len(completions)} completions")
            columns.append([float(v) for v in values])
        return [list(r) for r in zip(*columns, strict=True)]


# ---- specs ---------------------------------------------------------------------------------------------------
def _split_weight(spec: str) -> tuple[str, float]:
    """(NAME, WEIGHT) of NAME[:WEIGHT]. The last field is the weight when float() reads it, except the FUNC of
    python:FILE.py:FUNC without a weight: a function may be named `nan`, `inf` or `Infinity`, which float() reads
    (non-finite) but which leave python:FILE.py without a function."""
    head, sep, tail = spec.rpartition(":")
    if sep:
        try:
            weight = float(tail)
        except ValueError:
            return spec, 1.0
        if math.isfinite(weight) or not (head.startswith("python:") and head.count(":") == 1):
            return head, weight
    return spec, 1.0


def parse_reward(spec: str) -> tuple[str, Reward, float]:
    """(name, callable, weight) of one --reward SPEC; exit 2 naming the spec on anything wrong."""
    name, weight = _split_weight(spec.strip())
    if not math.isfinite(weight):
        raise InputError(f"--reward {spec}: the weight must be a finite number")
    if name in BUILTIN:
        return name, {"bfcl": bfcl_reward, "bfcl-graded": bfcl_graded_reward, "tests": tests_reward(False),
                      "tests-all": tests_reward(True)}[name], weight
    if name.startswith("python:"):
        rest = name[len("python:"):]
        file, sep, func = rest.rpartition(":")
        if not sep or not file or not func:
            raise InputError(f"--reward {spec}: a user reward is python:FILE.py:FUNC[:WEIGHT]")
        return name, PythonReward(file, func), weight
    raise InputError(f"--reward {spec}: unknown reward {name!r}; one of {', '.join(BUILTIN)}, or "
                     f"python:FILE.py:FUNC (each optionally :WEIGHT)")


def parse_rewards(specs: Sequence[str] | None) -> Rewards:
    if not specs:
        raise InputError("--objective grpo needs at least one --reward (bfcl, bfcl-graded, tests, tests-all or "
                         "python:FILE.py:FUNC, each optionally :WEIGHT)")
    parsed = [parse_reward(s) for s in specs]
    return Rewards([p[1] for p in parsed], [p[0] for p in parsed], [p[2] for p in parsed])


# ---- bfcl, bfcl-graded -------------------------------------------------------------------------------------------
_BFCL_CACHE: dict[str, dict[str, Any]] = {}
_OPENAPI_TO_BFCL = {"number": "float", "object": "dict"}


def _bfcl_question_by_id(task_id: str) -> Any:
    from ..data.bfcl_data import CATEGORIES, load_bfcl

    category = re.sub(r"_\d+(-\d+)*$", "", task_id)
    if category not in CATEGORIES:
        return None
    if category not in _BFCL_CACHE:
        try:
            _BFCL_CACHE[category] = {q.task_id: q for q in load_bfcl([category])}
        except InputError:
            _BFCL_CACHE[category] = {}
    return _BFCL_CACHE[category].get(task_id)


def _schema_to_doc(schema: dict[str, Any]) -> dict[str, Any]:
    out = dict(schema)
    out["type"] = _OPENAPI_TO_BFCL.get(schema.get("type", "string"), schema.get("type", "string"))
    if isinstance(schema.get("items"), dict):
        out["items"] = _schema_to_doc(schema["items"])
    return out


def _args(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    return json.loads(args) if isinstance(args, str) else dict(args or {})


def question_of_row(row: dict[str, Any]) -> Any:
    """The BfclQuestion a row is judged against: BFCL's own by "id", else one made from the row's tools (as BFCL's
    docs) and its answer's tool_calls (one allowed value per argument; uncalled parameters optional)."""
    from ..data.bfcl_data import BfclQuestion

    if isinstance(row.get("id"), str):
        q = _bfcl_question_by_id(row["id"])
        if q is not None:
            return q
    msgs = row.get("messages") or []
    answer = msgs[-1] if msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant" else None
    if answer is None:
        raise InputError(f"--reward bfcl: row {row.get('id', '')!r} has no assistant turn (the ground truth) and no "
                         f"BFCL id; give `data sft-from-bfcl` rows")
    functions = []
    for tool in row.get("tools") or []:
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {}
        functions.append({"name": fn["name"], "description": fn.get("description", ""),
                          "parameters": {"type": "dict", "required": list(params.get("required", [])),
                                         "properties": {k: _schema_to_doc(v) for k, v in
                                                        (params.get("properties") or {}).items()}}})
    calls = answer.get("tool_calls") or []
    if not calls:
        return BfclQuestion(str(row.get("id", "")), "irrelevance", [], functions, None)
    docs = {f["name"]: f for f in functions}
    truth = []
    for c in calls:
        name = c.get("function", c)["name"]
        args = _args(c)
        props = docs.get(name, {}).get("parameters", {}).get("properties", {})
        allowed = {p: [v] for p, v in args.items()}
        allowed.update({p: [""] for p in props if p not in args})
        truth.append({name: allowed})
    category = "parallel" if len(calls) > 1 else "multiple" if len(functions) > 1 else "simple"
    return BfclQuestion(str(row.get("id", "")), category, [], functions, truth)


def bfcl_reward(prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict]) -> list[float]:
    """1.0 where BFCL's AST rules pass the completion's calls, else 0.0."""
    from ..evaluate.bfcl import parse_calls, score

    out = []
    for text, row in zip(completions, rows, strict=True):
        calls, _ = parse_calls(text)
        out.append(1.0 if score(question_of_row(row), calls)[0] else 0.0)
    return out


def _value_ok(value: Any, allowed: list[Any]) -> bool:
    from ..evaluate.bfcl import standardize_string

    if isinstance(value, str):
        return any(isinstance(a, str) and standardize_string(a) == standardize_string(value) for a in allowed)
    if isinstance(value, float) and not isinstance(value, bool):
        return any(isinstance(a, (int, float)) and not isinstance(a, bool) and float(a) == value for a in allowed)
    return value in allowed


def graded_score(question: Any, text: str) -> dict[str, float]:
    """bfcl-graded's parts and total for one completion (see the module docstring)."""
    from ..data.bfcl_data import tool_name
    from ..evaluate.bfcl import parse_calls, score

    calls, error = parse_calls(text)
    if question.answer is None:  # no call is the answer
        v = 1.0 if not calls else 0.0
        return {"format": v, "name": v, "arg_names": v, "arg_values": v, "total": v}
    if score(question, calls)[0]:
        return {"format": 1.0, "name": 1.0, "arg_names": 1.0, "arg_values": 1.0, "total": 1.0}
    names = {tool_name(f["name"]): f["name"] for f in question.functions}
    outputs = [(names.get(c["name"], c["name"]), c.get("arguments") or {}) for c in calls]
    parts = {"format": 1.0 if calls and error is None else 0.0, "name": 0.0, "arg_names": 0.0, "arg_values": 0.0}
    used: set[int] = set()
    n = max(len(question.answer), len(outputs))
    for entry in question.answer:
        (name, params), = entry.items()
        k = next((i for i, (o, _) in enumerate(outputs) if o == name and i not in used), None)
        if k is None:
            continue
        used.add(k)
        args = outputs[k][1] if isinstance(outputs[k][1], dict) else {}
        expected = {p for p, allowed in params.items() if allowed != [""]}
        given = set(args)
        union = expected | given
        parts["name"] += 1.0 / n
        parts["arg_names"] += (len(expected & given) / len(union) if union else 1.0) / n
        right = sum(1 for p in expected if p in args and _value_ok(args[p], params[p]))
        parts["arg_values"] += (right / len(expected) if expected else 1.0) / n
    parts["total"] = sum(GRADED_WEIGHTS[k] * parts[k] for k in GRADED_WEIGHTS)
    return parts


def bfcl_graded_reward(prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict]) -> list[float]:
    return [graded_score(question_of_row(row), text)["total"] for text, row in zip(completions, rows, strict=True)]


# ---- tests (the sandbox) -----------------------------------------------------------------------------------------
def _solution(code: str, row: dict[str, Any]) -> str:
    """The code as `eval --task humaneval` runs it (tasks.program, chat): after the row's prompt (its imports and
    helpers) when the code defines the entry point, else as the prompt's body."""
    from ..evaluate.tasks import _parses

    prompt, entry = row.get("prompt"), row.get("entry_point")
    if not (isinstance(prompt, str) and isinstance(entry, str)):
        return code
    if re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        return (prompt + "\n" if _parses(prompt) else "") + code
    return prompt + code


def tests_program(code: str, row: dict[str, Any]) -> tuple[str, int]:
    """(the program the sandbox runs, the number of tests): the code, then each of the row's "tests" in its own
    try (their count passed printed with TESTS_MARK; it exits 1 unless all passed), or the row's "test" with
    check(entry_point) (HumanEval's form, one test)."""
    tests = row.get("tests")
    if isinstance(tests, list) and tests:
        lines = [_solution(code, row), "", "_passed = 0"]
        for t in tests:
            body = "\n".join("        " + ln for ln in str(t).splitlines()) or "        pass"
            lines += ["try:", "    def _t():", body, "    _t()", "    _passed += 1", "except BaseException:",
                      "    pass"]
        lines += ["import sys", f"print('{TESTS_MARK}', _passed, file=sys.stderr)",
                  f"assert _passed == {len(tests)}, '{TESTS_MARK} %d' % _passed"]
        return "\n".join(lines) + "\n", len(tests)
    from ..evaluate.tasks import problem_from_row, program

    return program(problem_from_row(row, "row", 0), code, True), 1


def tests_reward(all_or_nothing: bool) -> Reward:
    def reward(prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict]) -> list[float]:
        from ..evaluate.sandbox import run_program
        from ..evaluate.tasks import extract_code

        def one(text: str, row: dict) -> float:
            source, n = tests_program(extract_code(text, True), row)
            result = run_program(source)
            if result.passed:
                return 1.0
            found = re.findall(rf"{TESTS_MARK} (\d+)", result.error)
            passed = int(found[-1]) if found and n > 1 else 0
            return 0.0 if all_or_nothing else passed / n

        with ThreadPoolExecutor(max_workers=TESTS_WORKERS) as pool:  # each program in its own sandbox
            return list(pool.map(one, completions, rows))
    return reward


# ---- python:FILE.py:FUNC -------------------------------------------------------------------------------------------
class PythonReward:
    """A user's FUNC(prompt, completion, row) -> float in FILE.py, called in a separate process (reward_worker.py)
    per batch of completions, with PYTHON_REWARD_TIMEOUT_S per completion; checked up front (the file exists and
    defines FUNC at its top level) without running it here."""

    def __init__(self, file: str, func: str):
        path = Path(file)
        self.spec = f"python:{file}:{func}"
        if path.suffix != ".py" or not path.is_file():
            raise InputError(f"--reward {self.spec}: {file} is not a Python file (.py)")
        try:
            tree = ast.parse(path.read_text(), str(path))
        except SyntaxError as e:
            raise InputError(f"--reward {self.spec}: {file}:{e.lineno}: {e.msg}") from None
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func]
        if not defs:
            raise InputError(f"--reward {self.spec}: {file} defines no top-level function {func}(prompt, completion, "
                             f"row)")
        self.path, self.func, self.line = path.resolve(), func, defs[-1].lineno

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict]) -> list[float]:
        items = [[p, c, r] for p, c, r in zip(prompts, completions, rows, strict=True)]
        limit = PYTHON_REWARD_TIMEOUT_S * max(1, len(items))
        try:
            proc = subprocess.run([sys.executable, str(WORKER), str(self.path), self.func], input=json.dumps(items),
                                  capture_output=True, text=True, timeout=limit, cwd=str(self.path.parent),
                                  check=False)
        except subprocess.TimeoutExpired:
            raise InputError(f"--reward {self.spec}: {self.path}:{self.line}: {self.func} took more than {limit:g} s "
                             f"for {len(items)} completions ({PYTHON_REWARD_TIMEOUT_S:g} s each at most)") from None
        try:
            answer = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise InputError(f"--reward {self.spec}: {self.path}:{self.line}: the reward process ended without an "
                             f"answer (exit {proc.returncode}): {proc.stderr[-800:]}") from None
        if not answer.get("ok"):
            raise InputError(f"--reward {self.spec}: {self.path}:{answer.get('line', self.line)}: "
                             f"{answer.get('error')}")
        return [float(v) for v in answer["rewards"]]


__all__ = ["BUILTIN", "GRADED_WEIGHTS", "PYTHON_REWARD_TIMEOUT_S", "PythonReward", "Rewards", "bfcl_graded_reward",
           "bfcl_reward", "graded_score", "parse_reward", "parse_rewards", "question_of_row", "tests_program",
           "tests_reward"]
