"""`entrenar data tasks-from-code`: coding problems with tests from the docstring examples (doctests) of Python's
standard library (`stdlib`) or a given source tree, written as task rows usable both as `eval --task humaneval
--data` and as GRPO prompts with `--reward tests`.

A task is a module-level function whose docstring holds doctest examples (`>>> call` then its expected output) and
that reads nothing from its module but its imports (from_code.free_names): the prompt is those imports, the
signature and the docstring (HumanEval's form); the tests run the examples through `doctest` against the candidate:
"test" is HumanEval's `def check(candidate)` (every example must pass), "tests" one snippet per example with output
(the examples before it without output, e.g. assignments, run first), so `--reward tests` pays the share passed.

Disjoint from HumanEval: a function whose name is one of HumanEval's 164 entry points, or whose prompt's docstring
shares a line of 30+ characters with a HumanEval prompt, is left out (counted as `humaneval_overlap`). With
`--verify` (the default) each task keeps only if the function's own source passes its "test" in the sandbox (the
same isolation as `eval --task humaneval`): examples that depend on state outside the function are dropped. That
sandbox has Python's standard library only: a task importing anything else (a package such as sympy, or the source
tree's own modules, relative imports included), in its prompt's imports, its body or its examples, could never pass
there (not in verification, `--reward tests` or `eval --task humaneval --data`), so it is left out, with or without
`--verify`, and counted as `needs_packages`, per module in `packages`.
"""

from __future__ import annotations

import ast
import doctest
import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..fileio import atomic_write
from ..outpaths import check_jsonl_out
from .from_code import _functions, _module_imports, _signature, _source, free_names, python_files

# stdlib directories that are tests, demos or GUIs: their doctests are not the library's behaviour
STDLIB_EXCLUDES = ("test/*", "*/test/*", "*/tests/*", "idlelib/*", "tkinter/*", "turtledemo/*", "lib2to3/*",
                   "ensurepip/*", "turtle.py", "pydoc_data/*")
MIN_SHARED_LINE = 30  # a docstring line this long found in a HumanEval prompt marks an overlap
FLAGS = "doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE"


def _examples(docstring: str) -> list[doctest.Example]:
    try:
        return doctest.DocTestParser().get_examples(docstring)
    except ValueError:  # malformed doctest (e.g. inconsistent indentation): no examples
        return []


def _doctest_text(examples: list[doctest.Example]) -> str:
    lines = []
    for ex in examples:
        src = ex.source.rstrip("\n").splitlines()
        lines.append(">>> " + src[0])
        lines += ["... " + s for s in src[1:]]
        lines += ex.want.rstrip("\n").splitlines()
        lines.append("")
    return "\n".join(lines)


def _runner(text: str, globs: str) -> list[str]:
    """Lines that run doctest `text` with `globs` and fail (AssertionError) unless every example passes."""
    return ["import doctest", f"_runner = doctest.DocTestRunner(optionflags={FLAGS})",
            f"_test = doctest.DocTestParser().get_doctest({text!r}, {globs}, 'task', None, 0)",
            "_runner.run(_test, out=lambda s: None)",
            "assert _runner.failures == 0, f'{_runner.failures} of {_runner.tries} examples failed'"]


def task_tests(entry: str, examples: list[doctest.Example]) -> tuple[str, list[str]]:
    """(HumanEval's check(candidate) over every example, one snippet per example with output)."""
    check = ["def check(candidate):"] + ["    " + ln for ln in
                                         _runner(_doctest_text(examples), f"{{**globals(), {entry!r}: candidate}}")]
    snippets = []
    for i, ex in enumerate(examples):
        if not ex.want.strip():
            continue
        setup = [e for e in examples[:i] if not e.want.strip()]
        snippets.append("\n".join(_runner(_doctest_text([*setup, ex]), "dict(globals())")))
    return "\n".join(check) + "\n", snippets


def _humaneval() -> tuple[set[str], set[str]]:
    from ..evaluate.tasks import humaneval_problems

    problems = humaneval_problems()
    lines = {ln.strip() for p in problems for ln in p.prompt.splitlines() if len(ln.strip()) >= MIN_SHARED_LINE}
    return {p.entry_point for p in problems}, lines


def _prompt(node: ast.FunctionDef, docstring: str, imports: list[str]) -> str:
    doc = docstring.replace('"""', '\\"\\"\\"').splitlines()
    body = f'    """{doc[0]}\n' + "\n".join(("    " + ln) if ln.strip() else "" for ln in doc[1:]) + '\n    """\n'
    head = "".join(i + "\n" for i in imports) + ("\n\n" if imports else "")
    return f"{head}{_signature(node)}\n{body}"


def _import_lines(tree: ast.Module, needed: set[str]) -> list[str]:
    out = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names = {a.asname or a.name.split(".")[0] for a in stmt.names}
            if names & needed:
                out.append(ast.unparse(stmt))
    return out


def _import_roots(stmt: ast.Import | ast.ImportFrom) -> set[str]:
    """The top-level modules an import statement loads (a relative import: "." + its module, its package's own)."""
    if isinstance(stmt, ast.ImportFrom):
        return {"." + (stmt.module or "")} if stmt.level else {(stmt.module or "").split(".")[0]}
    return {a.name.split(".")[0] for a in stmt.names}


def modules_outside_stdlib(node: ast.FunctionDef, import_lines: list[str], examples: list[doctest.Example]
                           ) -> set[str]:
    """The modules a task imports that are not Python's standard library: in its prompt's import lines, its body and
    its doctest examples. The sandbox that runs the tests (evaluate/sandbox.py) has the standard library only, so a
    task needing one of these could never pass there (a package, or the source tree's own modules)."""
    stmts: list[ast.AST] = [s for s in ast.walk(node) if isinstance(s, (ast.Import, ast.ImportFrom))]
    for text in [*import_lines, *(ex.source for ex in examples)]:
        try:
            stmts += [s for s in ast.walk(ast.parse(text)) if isinstance(s, (ast.Import, ast.ImportFrom))]
        except SyntaxError:  # an example that is not a statement on its own (a continuation): no import to read
            continue
    roots = set().union(*(_import_roots(s) for s in stmts)) if stmts else set()
    return {r for r in roots if r != "__future__" and r not in sys.stdlib_module_names}


def file_tasks(path: Path, rel: str, entry_points: set[str], shared: set[str], counts: dict[str, int],
               packages: dict[str, int] | None = None) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        counts["files_unparsable"] += 1
        return []
    lines = text.splitlines(keepends=True)
    imports = _module_imports(tree)
    rows = []
    for node, owner in _functions(tree):
        if owner is not None or node.col_offset != 0 or isinstance(node, ast.AsyncFunctionDef) or node.decorator_list:
            continue
        docstring = ast.get_docstring(node, clean=True)
        examples = _examples(docstring or "")
        if not examples or not any(e.want.strip() for e in examples):
            continue
        counts["functions_with_doctests"] += 1
        needed = free_names(node) - {node.name}
        if not needed <= imports:
            counts["not_self_contained"] += 1
            continue
        if node.name in entry_points or any(ln.strip() in shared for ln in (docstring or "").splitlines()
                                            if len(ln.strip()) >= MIN_SHARED_LINE):
            counts["humaneval_overlap"] += 1
            continue
        import_lines = _import_lines(tree, needed)
        outside = modules_outside_stdlib(node, import_lines, examples)
        if outside:
            counts["needs_packages"] += 1
            for name in outside if packages is not None else ():
                packages[name] = packages.get(name, 0) + 1
            continue
        check, snippets = task_tests(node.name, examples)
        rows.append({"task_id": f"{rel}:{node.name}", "prompt": _prompt(node, docstring or "", import_lines),
                     "entry_point": node.name, "test": check, "tests": snippets,
                     "canonical_solution": _source(lines, node), "source": rel})
    return rows


def verify_task(row: dict[str, Any]) -> bool:
    """The function's own source passes its check() in the sandbox."""
    from ..evaluate.sandbox import run_program
    from ..evaluate.tasks import Problem, program

    problem = Problem(row["task_id"], row["prompt"], row["test"], row["entry_point"])
    return run_program(program(problem, row["canonical_solution"], True)).passed


def tasks_from_code(sources: list[str], out: str | Path, excludes: list[str] | None = None, overwrite: bool = False,
                    verify: bool = True, limit: int = 0) -> dict[str, Any]:
    """`data tasks-from-code`: the task rows of `sources` (directories or .py files; `stdlib` = this Python's
    standard library, STDLIB_EXCLUDES left out) at `out`, written atomically. Returns the counts."""
    out = check_jsonl_out(out, overwrite)
    entry_points, shared = _humaneval()
    counts = {"files": 0, "files_unparsable": 0, "functions_with_doctests": 0, "not_self_contained": 0,
              "humaneval_overlap": 0, "needs_packages": 0, "failed_verification": 0}
    packages: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    for source in sources:
        is_stdlib = source == "stdlib"
        root = Path(sysconfig.get_paths()["stdlib"]) if is_stdlib else Path(source)
        if not root.exists():
            raise InputError(f"{source}: no such file or directory (give directories of Python source, .py files, or "
                             f"`stdlib`)")
        files = [root] if root.is_file() else python_files(root, list(excludes or []) +
                                                           (list(STDLIB_EXCLUDES) if is_stdlib else []))
        base = root.parent if root.is_file() else root
        for path in files:
            counts["files"] += 1
            rel = ("stdlib/" if is_stdlib else "") + path.relative_to(base).as_posix()
            rows.extend(file_tasks(path, rel, entry_points, shared, counts, packages))
    if verify:
        kept = []
        for row in rows:
            if limit and len(kept) >= limit:
                break
            if verify_task(row):
                kept.append(row)
            else:
                counts["failed_verification"] += 1
        rows = kept
    elif limit:
        rows = rows[:limit]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {**counts, "packages": dict(sorted(packages.items(), key=lambda kv: (-kv[1], kv[0]))),
            "rows": len(rows), "out": str(out), "sources": list(sources), "verified": verify,
            "humaneval_entry_points_excluded": len(entry_points)}


__all__ = ["STDLIB_EXCLUDES", "file_tasks", "modules_outside_stdlib", "task_tests", "tasks_from_code", "verify_task"]
