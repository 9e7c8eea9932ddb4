"""Symbol anchors for the ``mutate:`` edits of contracts/*.yaml (tools/mutants.py, tools/anchor_contracts.py).

An edit anchored by symbol names a def, class or module/class-level assignment instead of a file:

    symbol: entrenar.train.loop:Trainer.load_trainer_state   # module:qualname (the module is a hint)
    symbol: Trainer.load_trainer_state                       # qualname alone: searched everywhere

and its ``find`` must occur exactly once inside that symbol's source (decorators included, from the start
of its first line to the end of its last). The symbol is looked up with ``ast`` in the hinted module
first; when it is not there (the code moved to another module or file) every ``*.py`` under ``src/``
(and the hint's own top folder, e.g. ``bench/``) is searched, by qualname, then by its last part (a
method moved to another class or out to a function). More than one candidate is an error that names
them all: the anchor must then say which one.
"""

from __future__ import annotations

import ast
import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SEARCH_ROOTS = ("src",)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: with the ASTs of the tree held for the lint, each collection
    walks their millions of nodes, which doubled the lint's time. ASTs hold no cycles (refcounts free them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class AnchorError(ValueError):
    """A symbol anchor that does not resolve to exactly one place (message says why, naming candidates)."""


@dataclass(frozen=True)
class Symbol:
    file: str  # posix path relative to the repository root
    qualname: str  # "Trainer.step": enclosing classes/functions joined with "."
    start: int  # offset of the first character of its first line (a decorator's, if any)
    end: int  # offset just past its last line's newline
    line: int  # 1-based line of that first line

    @property
    def spec(self) -> str:
        """The ``symbol:`` value that names this symbol (module:qualname)."""
        return f"{module_of(self.file)}:{self.qualname}"

    def where(self) -> str:
        return f"{self.spec} ({self.file}:{self.line})"


def module_of(file: str) -> str:
    """src/entrenar/train/loop.py -> entrenar.train.loop; src/entrenar/kernels/__init__.py -> entrenar.kernels;
    bench/e2e_corpus.py -> bench.e2e_corpus."""
    path = file.removeprefix("src/")
    path = path.removesuffix(".py").removesuffix("/__init__")
    return path.replace("/", ".")


def _line_starts(text: str) -> list[int]:
    starts = [0]
    pos = text.find("\n")
    while pos != -1:
        starts.append(pos + 1)
        pos = text.find("\n", pos + 1)
    return starts


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# compound statements whose bodies stay in the enclosing scope (an `if TYPE_CHECKING:` def is still top level)
_BLOCKS = (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While) + (
    (ast.TryStar,) if hasattr(ast, "TryStar") else ()) + ((ast.Match,) if hasattr(ast, "Match") else ())


def symbols_of(file: str, text: str, tree: ast.Module | None = None) -> list[Symbol]:
    """Every def, class and module/class-level assignment of a Python source (tree: its AST, if parsed).

    Raises SyntaxError when text does not parse."""
    tree = tree or ast.parse(text)
    starts = _line_starts(text)
    out: list[Symbol] = []

    def span(node: ast.stmt, name: str, prefix: str) -> None:
        first = _first_line(node)
        last = node.end_lineno or node.lineno
        end = starts[last] if last < len(starts) else len(text)
        out.append(Symbol(file, prefix + name, starts[first - 1], end, first))

    def visit(body: list[ast.stmt], prefix: str, in_function: bool) -> None:
        for node in body:
            if isinstance(node, _DEFS):
                span(node, node.name, prefix)
                visit(node.body, f"{prefix}{node.name}.", isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not in_function:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        span(node, t.id, prefix)
            elif isinstance(node, _BLOCKS):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []), prefix, in_function)
                # except handlers and match cases hold their statements one level down
                for child in getattr(node, "handlers", []) + getattr(node, "cases", []):
                    visit(child.body, prefix, in_function)

    visit(tree.body, "", False)
    return out


def search_roots(hint: str | None) -> list[str]:
    """Where a moved symbol or find is looked for: src/, and the top folder of the file it was in."""
    tops = list(SEARCH_ROOTS)
    if hint and "/" in hint and hint.split("/")[0] not in tops:
        tops.append(hint.split("/")[0])
    return tops


def same_code(before: str, before_tree: ast.Module, after: str, after_tree: ast.Module) -> bool:
    """Whether two versions of a module have the same AST (positions aside: comments and layout only).

    Dumping a whole module per mutation made the lint twice as slow, so only the statements outside the
    lines both versions share at their start and end are compared (those within are the same complete
    text and parse the same), descending into the one def/class that holds the change."""
    b, a = before.split("\n"), after.split("\n")
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1

    def middle(body: list[ast.stmt], n_lines: int) -> tuple[int, int, list[ast.stmt]]:
        above = sum((s.end_lineno or s.lineno) <= head for s in body)
        below = sum(_first_line(s) > n_lines - tail for s in body)
        return above, below, body[above:len(body) - below]

    body_b, body_a = before_tree.body, after_tree.body
    while True:
        *shared_b, mid_b = middle(body_b, len(b))
        *shared_a, mid_a = middle(body_a, len(a))
        if shared_b != shared_a:  # never expected; the whole modules then decide
            return ast.dump(before_tree) == ast.dump(after_tree)
        one_def = (len(mid_b) == len(mid_a) == 1 and type(mid_b[0]) is type(mid_a[0])
                   and isinstance(mid_b[0], _DEFS))
        if not one_def:
            return [ast.dump(s) for s in mid_b] == [ast.dump(s) for s in mid_a]
        if _header(mid_b[0]) != _header(mid_a[0]):
            return False
        body_b, body_a = mid_b[0].body, mid_a[0].body


def _first_line(node: ast.stmt) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _header(node: ast.stmt) -> str:
    """The AST of a def/class without its body."""
    return ast.dump(node.__class__(**{f: ([] if f == "body" else getattr(node, f, None)) for f in node._fields}))


def innermost(symbols: list[Symbol], start: int, end: int) -> list[Symbol]:
    """The symbols whose span holds [start, end), innermost first."""
    holding = [s for s in symbols if s.start <= start and end <= s.end]
    return sorted(holding, key=lambda s: s.end - s.start)


class SourceIndex:
    """Sources of one tree (read once) with edited texts laid over them, and their symbols (parsed once per text).

    ``texts`` maps a relative path to its current (edited) text; files not in it are read from disk."""

    def __init__(self, root: Path):
        self.root = root
        self._disk: dict[str, str | None] = {}
        self._parsed: dict[str, tuple[str, ast.Module, list[Symbol]]] = {}
        self._files: dict[str, list[str]] = {}

    def text(self, file: str, texts: dict[str, str] | None = None) -> str | None:
        if texts and file in texts:
            return texts[file]
        if file not in self._disk:
            path = self.root / file
            self._disk[file] = path.read_text() if path.is_file() else None
        return self._disk[file]

    def symbols(self, file: str, texts: dict[str, str] | None = None) -> list[Symbol]:
        return self._parse(file, texts)[2] if self.text(file, texts) is not None else []

    def tree(self, file: str, texts: dict[str, str] | None = None) -> ast.Module:
        """The AST of file (AnchorError if it does not parse or does not exist)."""
        return self._parse(file, texts)[1]

    def _parse(self, file: str, texts: dict[str, str] | None) -> tuple[str, ast.Module, list[Symbol]]:
        text = self.text(file, texts)
        if text is None:
            raise AnchorError(f"{file} does not exist")
        cached = self._parsed.get(file)
        if cached is None or cached[0] is not text and cached[0] != text:
            try:
                tree = ast.parse(text)
            except SyntaxError as e:
                raise AnchorError(f"{file} does not parse ({e.msg}, line {e.lineno})") from None
            cached = (text, tree, symbols_of(file, text, tree))
            self._parsed[file] = cached
        return cached

    def python_files(self, top: str) -> list[str]:
        if top not in self._files:
            base = self.root / top
            self._files[top] = sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*.py")
                                      if "__pycache__" not in p.parts) if base.is_dir() else []
        return self._files[top]

    def file_of(self, module: str, texts: dict[str, str] | None = None) -> str | None:
        """The file of a dotted module name (src/ first, then the repository root), or None."""
        path = module.replace(".", "/")
        for cand in (f"src/{path}.py", f"src/{path}/__init__.py", f"{path}.py", f"{path}/__init__.py"):
            if self.text(cand, texts) is not None:
                return cand
        return None

    def resolve(self, spec: str, texts: dict[str, str] | None = None) -> Symbol:
        """The one symbol a ``symbol:`` value names (see the module docstring); AnchorError otherwise."""
        module, _, qualname = spec.rpartition(":")
        if not qualname or any(not part.isidentifier() for part in qualname.split(".")):
            raise AnchorError(f"symbol {spec!r} is not [module:]Name[.Name...]")
        hint = self.file_of(module, texts) if module else None
        if hint is not None:
            here = [s for s in self.symbols(hint, texts) if s.qualname == qualname]
            if len(here) == 1:
                return here[0]
            if len(here) > 1:
                raise AnchorError(f"symbol {spec}: defined {len(here)} times in {hint} (lines "
                                  f"{', '.join(str(s.line) for s in here)}); anchor an enclosing symbol or a file")
        tops = search_roots(hint)
        everything = [s for top in tops for f in self.python_files(top) for s in self._symbols_or_none(f, texts)]
        leaf = qualname.rsplit(".", 1)[-1]
        for how, match in (("", lambda s: s.qualname == qualname),
                           (f" (by its last part {leaf!r})", lambda s: s.qualname.rsplit(".", 1)[-1] == leaf)):
            found = [s for s in everything if match(s)]
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                where = f"not in {module}, and " if module else ""
                raise AnchorError(f"symbol {spec}: {where}ambiguous{how}, {len(found)} candidates: "
                                  + ", ".join(s.where() for s in found))
        where = f"module {module} " + ("has no such symbol" if hint else "does not exist") + ", and " if module else ""
        raise AnchorError(f"symbol {spec}: {where}no such symbol under {', '.join(t + '/' for t in tops)}")

    def _symbols_or_none(self, file: str, texts: dict[str, str] | None) -> list[Symbol]:
        try:
            return self.symbols(file, texts)
        except AnchorError:
            return []  # a file that does not parse holds no candidates (the lint of its own edits says why)


def locate(index: SourceIndex, spec: str, find: str, texts: dict[str, str] | None = None) -> tuple[Symbol, int]:
    """(symbol, offset in its file) of the one occurrence of find inside the symbol's source."""
    sym = index.resolve(spec, texts)
    text = index.text(sym.file, texts)
    assert text is not None  # resolve() only returns symbols of files that exist
    count = text.count(find, sym.start, sym.end)
    if count != 1:
        where = "is not in" if count == 0 else f"occurs {count} times in"
        raise AnchorError(f"find {_short(find)!r} {where} symbol {sym.where()} (must be exactly once)")
    return sym, text.index(find, sym.start, sym.end)


def _short(s: str, n: int = 70) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."
