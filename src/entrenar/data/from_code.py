"""`entrenar data sft-from-code`: an instruction data set from real Python source.

For every function or method with a docstring: the user asks for a function with that signature
and docstring, and the assistant answers with the function's source (decorators included,
dedented). Files are visited in sorted relative-path order and functions in source order, so the
output is identical on every run. Files that do not parse are skipped and counted, not fatal.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import json
import os
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..fileio import atomic_write
from ..outpaths import check_creatable, check_replaceable_file, looks_like_jsonl

# Directory names never descended into: caches, VCS data, and installed third-party packages
# (the standard library's directory holds site-packages, which is not the standard library).
DEFAULT_EXCLUDED_DIRS = ("__pycache__", "site-packages", "dist-packages", "node_modules")
MAX_UNPARSABLE_LISTED = 20
ANSWER_FORMATS = ("plain", "fenced")


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"


def _source(lines: list[str], node: ast.stmt) -> str:
    """The function's lines (decorators included) with the def line's indentation removed (any statement: a class,
    an assignment, the same way)."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    indent = node.col_offset
    out = []
    for line in lines[first - 1:node.end_lineno]:
        if not line.strip():
            out.append("\n")
        elif line[:indent].strip() == "":
            out.append(line[indent:])
        else:  # a continuation line of a string indented less than the def: keep it as it is
            out.append(line)
    return "".join(out).rstrip() + "\n"


def _is_stub(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A body that is only the docstring (plus pass / ... / raise NotImplementedError)."""
    for stmt in node.body[1:]:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
            continue
        if isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.unparse(stmt):
            continue
        return False
    return True


def _user_message(node: ast.FunctionDef | ast.AsyncFunctionDef, docstring: str, owner: str | None) -> str:
    doc_lines = docstring.replace('"""', '\\"\\"\\"').splitlines()
    if len(doc_lines) == 1:
        quoted = f'    """{doc_lines[0]}"""'
    else:
        rest = "\n".join(("    " + line) if line.strip() else "" for line in doc_lines[1:])
        quoted = f'    """{doc_lines[0]}\n{rest}\n    """'
    where = f" It is a method of the class `{owner}`." if owner else ""
    return (f"Write a Python function with this signature and docstring.{where} Reply with the complete "
            f"function only.\n\n```python\n{_signature(node)}\n{quoted}\n```")


def _module_imports(tree: ast.AST) -> set[str]:
    """Names bound by the module's top-level imports (``import a.b`` binds ``a``)."""
    names: set[str] = set()
    for stmt in getattr(tree, "body", []):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                names.add(alias.asname or alias.name.split(".")[0])
    return names


def free_names(node: ast.AST) -> set[str]:
    """Names the function reads that it does not bind itself (parameters, assignments, loop and
    comprehension targets, imports, nested definitions) and that are not builtins: what it needs from
    the module around it. Any other node (a class, an assignment) reads the same way: the names loaded
    in it that it does not bind (an assignment's own targets are bound)."""
    bound: set[str] = set()
    loaded: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (loaded if isinstance(sub.ctx, ast.Load) else bound).add(sub.id)
        elif isinstance(sub, ast.arg):
            bound.add(sub.arg)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub is not node:
            bound.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            bound.update(a.asname or a.name.split(".")[0] for a in sub.names)
        elif isinstance(sub, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and sub.name:
            bound.add(sub.name)
    return loaded - bound - set(dir(builtins))


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Source lines of the body after the docstring (blank lines and comments inside it included)."""
    body = node.body[1:] if ast.get_docstring(node, clean=False) is not None else node.body
    return 0 if not body else body[-1].end_lineno - body[0].lineno + 1


def _functions(tree: ast.AST) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str | None]]:
    """Every function and method (nested ones too) in source order, with its enclosing class."""
    found: list[tuple[Any, str | None]] = []

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child, owner))
                visit(child, None)
            elif isinstance(child, ast.ClassDef):
                visit(child, child.name)
            else:
                visit(child, owner)

    visit(tree, None)
    found.sort(key=lambda item: (item[0].lineno, item[0].col_offset))
    return found


def python_files(root: Path, excludes: list[str]) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in DEFAULT_EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                rel = path.relative_to(root).as_posix()
                if not any(fnmatch.fnmatch(rel, pat) for pat in excludes):
                    files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _file_rows(path: Path, rel: str, system_prompt: str | None, skip_stubs: bool,
               stats: dict[str, Any], answer: str = "plain", min_body_lines: int = 1,
               self_contained: bool = False) -> Iterator[dict[str, Any]]:
    """The rows of one source file (counted into ``stats``); an unparsable file gives none."""
    try:
        with tokenize.open(path) as src:  # honours PEP 263 encoding declarations
            text = src.read()
        tree = ast.parse(text, filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:
        stats["files_unparsable"] += 1
        if len(stats["unparsable"]) < MAX_UNPARSABLE_LISTED:
            stats["unparsable"].append(f"{rel}: {type(e).__name__}: {e}")
        return
    lines = text.splitlines(keepends=True)
    imports = _module_imports(tree)
    for node, owner in _functions(tree):
        stats["functions"] += 1
        doc = ast.get_docstring(node, clean=True)
        if not doc or not doc.strip():
            continue
        stats["functions_with_docstring"] += 1
        if skip_stubs and _is_stub(node):
            stats["stubs_skipped"] += 1
            continue
        if min_body_lines > 1 and _body_lines(node) < min_body_lines:  # 1: every function, as before the flag
            stats["short_skipped"] += 1
            continue
        if self_contained and (owner is not None or free_names(node) - imports):
            stats["not_self_contained_skipped"] += 1
            continue
        code = _source(lines, node)
        if answer == "fenced":  # a markdown block, as chat models answer (and `eval --task humaneval` extracts)
            code = f"```python\n{code}```"
        messages = [{"role": "user", "content": _user_message(node, doc, owner)},
                    {"role": "assistant", "content": code}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        yield {"messages": messages, "source": f"{rel}:{node.lineno}"}


def sft_from_code(dirs: list[str], out: str | Path, system_prompt: str | None = None,
                  excludes: list[str] | None = None, skip_stubs: bool = True,
                  overwrite: bool = False, answer: str = "plain", min_body_lines: int = 1,
                  self_contained: bool = False) -> dict[str, Any]:
    """Write the JSONL; returns counts (files, unparsable files, functions, rows, what each filter skipped).

    ``answer``: "plain" (the function's source) or "fenced" (inside a python markdown block).
    ``min_body_lines``: skip functions whose body after the docstring spans fewer lines.
    ``self_contained``: skip methods and functions that read module names other than imports (helpers,
    constants, globals): an answer that calls code the prompt never shows teaches guessing."""
    if answer not in ANSWER_FORMATS:
        raise InputError(f"--answer {answer}: choose one of {', '.join(ANSWER_FORMATS)}")
    if min_body_lines < 1:
        raise InputError(f"--min-body-lines {min_body_lines}: must be at least 1")
    excludes = list(excludes or [])
    sources: list[tuple[Path, list[Path]]] = []  # (root the rows name paths from, its .py files)
    for d in dirs:
        p = Path(d)
        if p.is_file() and p.suffix == ".py":  # a single file, as `data pack` accepts (issue 18 item 12)
            sources.append((p.parent, [p]))
        elif p.is_dir():
            sources.append((p, python_files(p, excludes)))
        else:
            raise InputError(f"{d}: not a directory or a .py file (sft-from-code reads Python source)")
    if system_prompt is not None and not system_prompt.strip():
        raise InputError("the system prompt file is empty")
    out = Path(out)
    if out.is_dir():  # was an IsADirectoryError traceback (issue 18 item 8)
        raise InputError(f"--out {out}: is a directory; give the path of the JSONL file to write")
    if out.exists() and not overwrite:  # was a silent replacement (issue 18 item 10)
        raise InputError(f"--out {out}: already exists; choose another --out, or pass --overwrite to replace it")
    if out.exists():  # --overwrite replaces a JSONL file, never a source file or a model (issue 28 item 1)
        check_replaceable_file(out, "a JSONL file (a previous output)", looks_like_jsonl)
    check_creatable(out.parent if out.is_file() else out, "--out")  # a file replaced: its folder  # under /proc or read-only: exit 2 before the walk (issue 38 item 8)
    out.parent.mkdir(parents=True, exist_ok=True)
    stats = {"files": 0, "files_unparsable": 0, "unparsable": [], "functions": 0,
             "functions_with_docstring": 0, "stubs_skipped": 0, "short_skipped": 0,
             "not_self_contained_skipped": 0, "rows": 0}

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for root, files in sources:
                for path in files:
                    stats["files"] += 1
                    rel = f"{root.name}/{path.relative_to(root).as_posix()}"
                    for row in _file_rows(path, rel, system_prompt, skip_stubs, stats, answer, min_body_lines,
                                          self_contained):
                        f.write(json.dumps(row, ensure_ascii=False) + "\n")
                        stats["rows"] += 1
        if stats["rows"] == 0:
            raise InputError(f"no documented functions found in {', '.join(dirs)} "
                             f"({stats['files']} .py files, {stats['files_unparsable']} unparsable)")

    atomic_write(out, write)  # a failure or an interrupt leaves the previous file (or none)
    stats["out"] = str(out)
    return stats
