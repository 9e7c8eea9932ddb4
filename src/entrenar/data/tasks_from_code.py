"""`entrenar data tasks-from-code`: coding problems with tests from the docstring examples (doctests) of Python's
standard library (`stdlib`) or a given source tree, written as task rows usable both as `eval --task humaneval
--data` and as GRPO prompts with `--reward tests`.

A task is a module-level function whose docstring holds doctest examples (`>>> call` then its expected output): the
prompt is the imports it needs, what it reads of its module beyond them (its context), then its signature and
docstring (HumanEval's form, whose prompts hold their helpers too). The context: the top-level `def`, `class` and
simple assignments (`NAME = ...`, `A, B = ...`, `NAME: T = ...`) binding the names the function reads
(from_code.free_names), then, recursively, those these read, in source order and as written; their imports join the
prompt's, and so do the module's `__future__` imports. A name bound any other way (`from x import *`, inside an `if`
or `try`, through `globals()`, declared `global`, bound or changed by more than one top-level statement), a context
reading the function itself, or one over MAX_CONTEXT_LINES lines or MAX_CONTEXT_CHARS characters leaves the function
out (counted as `not_self_contained`); `with_context` counts the tasks kept with a context (a row's "context" names
its statements' names). The tests run the examples through `doctest` against the candidate: "test" is HumanEval's
`def check(candidate)` (every example must pass), "tests" one snippet per example with output (the examples before
it without output, e.g. assignments, run first), so `--reward tests` pays the share passed.

Disjoint from HumanEval: a function whose name is one of HumanEval's 164 entry points, or whose prompt's docstring
or context shares a line of 30+ characters with a HumanEval prompt, is left out (counted as `humaneval_overlap`).
With `--verify` (the default) each task keeps only if the function's own source passes its "test" in the sandbox
after the prompt, context included (the same isolation as `eval --task humaneval`): examples that depend on state
outside the function are dropped. That sandbox has Python's standard library only: a task importing anything else
(a package such as sympy, or the source tree's own modules, relative imports included), in its prompt's imports,
its body, its context or its examples, could never pass there (not in verification, `--reward tests` or `eval
--task humaneval --data`), so it is left out, with or without `--verify`, and counted as `needs_packages`, per
module in `packages`.
"""

from __future__ import annotations

import ast
import doctest
import json
import sys
import sysconfig
from collections.abc import Sequence
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
# the most module context (helpers, constants, classes: the statements' source, imports not counted) a prompt holds
MAX_CONTEXT_LINES = 60
MAX_CONTEXT_CHARS = 4000


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


def _prompt(node: ast.FunctionDef, docstring: str, imports: list[str], context: str = "") -> str:
    doc = docstring.replace('"""', '\\"\\"\\"').splitlines()
    body = f'    """{doc[0]}\n' + "\n".join(("    " + ln) if ln.strip() else "" for ln in doc[1:]) + '\n    """\n'
    head = "".join(i + "\n" for i in imports) + ("\n\n" if imports else "") + context
    return f"{head}{_signature(node)}\n{body}"


def _simple_targets(stmt: ast.stmt) -> set[str] | None:
    """The names a top-level def, class or simple assignment (NAME = / A, B = / NAME: T = value) binds; None for any
    other statement."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, ast.AnnAssign):
        return {stmt.target.id} if isinstance(stmt.target, ast.Name) and stmt.value is not None else None
    if not isinstance(stmt, ast.Assign):
        return None
    elts = [e for t in stmt.targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
    return {e.id for e in elts} if all(isinstance(e, ast.Name) for e in elts) else None


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _touched(stmt: ast.stmt) -> set[str]:
    """The names any other top-level statement may bind or change: its stored or deleted names, the roots of its
    stored or deleted items and attributes (`X[k] = v`, `X.a += 1`) and of the methods it calls as a statement
    (`X.update(...)`), its definitions and imports."""
    roots: list[str | None] = []
    for sub in ast.walk(stmt):
        if isinstance(sub, (ast.Name, ast.Subscript, ast.Attribute)) and not isinstance(sub.ctx, ast.Load):
            roots.append(_root(sub))
        elif isinstance(sub, ast.Expr) and isinstance(sub.value, ast.Call) and isinstance(sub.value.func,
                                                                                           ast.Attribute):
            roots.append(_root(sub.value.func))
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            roots.append(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            roots += [a.asname or a.name.split(".")[0] for a in sub.names]
    return {r for r in roots if r}


def _first_line(stmt: ast.stmt) -> int:
    return min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])


def module_bindings(tree: ast.Module) -> dict[str, ast.stmt]:
    """{name: the top-level statement binding it} for the names a prompt can define by copying that statement's lines:
    bound by exactly one simple statement (_simple_targets) with lines of its own (not `A = f(); B = 2`), bound or
    changed by no other top-level statement (an `if`, a `try`, a loop, an augmented or item assignment, a method
    call), and declared `global` nowhere."""
    simple: dict[str, list[ast.stmt]] = {}
    other: set[str] = {n for sub in ast.walk(tree) if isinstance(sub, ast.Global) for n in sub.names}
    for i, stmt in enumerate(tree.body):
        targets = _simple_targets(stmt)
        shares_line = any(tree.body[j].end_lineno == _first_line(tree.body[j + 1]) for j in (i - 1, i)
                          if 0 <= j < len(tree.body) - 1)
        for name in targets or ():
            simple.setdefault(name, []).append(stmt)
            if shares_line:
                other.add(name)
        if targets is None:
            other |= _touched(stmt)
    return {name: stmts[0] for name, stmts in simple.items() if len(stmts) == 1 and name not in other}


def module_context(node: ast.FunctionDef, imports: set[str], bindings: dict[str, ast.stmt]
                   ) -> tuple[list[ast.stmt], set[str]] | None:
    """(the top-level statements `node` needs beyond its module's imports, with those they need in turn, in source
    order; the imported names it and they read), or None when a name resolves to no statement of `bindings` or the
    context needs `node` itself."""
    stmts: dict[int, ast.stmt] = {}
    needed_imports: set[str] = set()
    todo, seen = sorted(free_names(node) - {node.name}), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in imports:
            needed_imports.add(name)
            continue
        stmt = bindings.get(name)
        if stmt is None or name == node.name:
            return None
        if id(stmt) not in stmts:
            stmts[id(stmt)] = stmt
            todo.extend(free_names(stmt))
    return sorted(stmts.values(), key=lambda s: s.lineno), needed_imports


def _capped_context(node: ast.FunctionDef, lines: list[str], imports: set[str], bindings: dict[str, ast.stmt]
                    ) -> tuple[list[ast.stmt], set[str], str] | None:
    """module_context and its text as the prompt holds it (each statement's source, from_code._source, then two blank
    lines); None when it does not resolve or its text is over MAX_CONTEXT_LINES or MAX_CONTEXT_CHARS."""
    found = module_context(node, imports, bindings)
    if found is None:
        return None
    text = "".join(_source(lines, stmt) + "\n\n" for stmt in found[0])
    if text.count("\n") > MAX_CONTEXT_LINES or len(text) > MAX_CONTEXT_CHARS:
        return None
    return found[0], found[1], text


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


def modules_outside_stdlib(node: ast.FunctionDef, import_lines: list[str], examples: list[doctest.Example],
                           context: Sequence[ast.stmt] = ()) -> set[str]:
    """The modules a task imports that are not Python's standard library: in its prompt's import lines, its body, its
    context statements and its doctest examples. The sandbox that runs the tests (evaluate/sandbox.py) has the
    standard library only, so a task needing one of these could never pass there (a package, or the source tree's own
    modules)."""
    stmts: list[ast.AST] = [s for top in [node, *context] for s in ast.walk(top)
                            if isinstance(s, (ast.Import, ast.ImportFrom))]
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
    imports, bindings = _module_imports(tree), module_bindings(tree)
    rows = []
    for node, owner in _functions(tree):
        if owner is not None or node.col_offset != 0 or isinstance(node, ast.AsyncFunctionDef) or node.decorator_list:
            continue
        docstring = ast.get_docstring(node, clean=True)
        examples = _examples(docstring or "")
        if not examples or not any(e.want.strip() for e in examples):
            continue
        counts["functions_with_doctests"] += 1
        found = _capped_context(node, lines, imports, bindings)
        if found is None:
            counts["not_self_contained"] += 1
            continue
        stmts, needed, context = found
        if stmts:  # the context runs under its module's __future__ imports (annotations), as it does there
            needed |= {a.name for f in tree.body if isinstance(f, ast.ImportFrom) and f.module == "__future__"
                       for a in f.names}
        if node.name in entry_points or any(ln.strip() in shared for ln in f"{docstring}\n{context}".splitlines()
                                            if len(ln.strip()) >= MIN_SHARED_LINE):
            counts["humaneval_overlap"] += 1
            continue
        import_lines = _import_lines(tree, needed)
        outside = modules_outside_stdlib(node, import_lines, examples, stmts)
        if outside:
            counts["needs_packages"] += 1
            for name in outside if packages is not None else ():
                packages[name] = packages.get(name, 0) + 1
            continue
        check, snippets = task_tests(node.name, examples)
        rows.append({"task_id": f"{rel}:{node.name}", "prompt": _prompt(node, docstring or "", import_lines, context),
                     "entry_point": node.name, "test": check, "tests": snippets,
                     "canonical_solution": _source(lines, node), "source": rel,
                     "context": [n for s in stmts for n in sorted(_simple_targets(s) or ())]})
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
    counts["with_context"] = sum(1 for r in rows if r["context"])
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {**counts, "packages": dict(sorted(packages.items(), key=lambda kv: (-kv[1], kv[0]))),
            "rows": len(rows), "out": str(out), "sources": list(sources), "verified": verify,
            "humaneval_entry_points_excluded": len(entry_points)}


__all__ = ["MAX_CONTEXT_CHARS", "MAX_CONTEXT_LINES", "STDLIB_EXCLUDES", "file_tasks", "module_bindings",
           "module_context", "modules_outside_stdlib", "task_tests", "tasks_from_code", "verify_task"]
