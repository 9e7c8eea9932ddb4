"""General mutation operators for tools/mutants.py --operators (issue 16 item 5).

The contracts hold the mutations somebody thought of; these are the ones nobody picked: every
arithmetic operator, comparison, numeric constant, boolean, and dropped call inside the numerically
critical functions listed in tools/mutation_targets.yaml, one mutant each. A mutant is an exact
source edit (the node's text replaced by its mutated unparse), run against the target's tests in a
scratch copy like the contract mutations. Survivors are either missing tests or equivalent mutants
(the note says which).
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from pathlib import Path

import yaml

_SWAP_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div}
_SWAP_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq}
_SWAP_BOOL = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass
class OpMutant:
    file: str
    function: str
    line: int
    operator: str
    original: str  # the node's source text
    replacement: str
    start: int  # character offsets of the node in the file
    end: int

    @property
    def label(self) -> str:
        return f"{self.file}:{self.line} {self.function} {self.operator}: {self.original!r} -> {self.replacement!r}"

    def apply(self, text: str) -> str:
        assert text[self.start:self.end] == self.original, f"{self.label}: the source moved"
        return text[:self.start] + self.replacement + text[self.end:]


def _offsets(text: str) -> list[int]:
    """Character offset of the start of each line (1-based line numbers index it from 1)."""
    starts, pos = [0, 0], 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _char(text_lines: list[str], starts: list[int], line: int, col_bytes: int) -> int:
    # ast columns are UTF-8 byte offsets
    return starts[line] + len(text_lines[line - 1].encode("utf-8")[:col_bytes].decode("utf-8"))


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _mutated_constant(value):
    if isinstance(value, bool):
        return not value
    if value == 0:
        return type(value)(1)
    if value == 1:
        return type(value)(0)
    return value + 1 if isinstance(value, int) else value * 2


def _variants(node: ast.AST) -> list[tuple[str, ast.AST | None]]:
    """(operator name, mutated node or None for 'drop the statement') for one node."""
    out: list[tuple[str, ast.AST | None]] = []
    if isinstance(node, ast.BinOp) and type(node.op) in _SWAP_BIN and not (_is_text(node.left) or _is_text(node.right)):
        m = copy.deepcopy(node)
        m.op = _SWAP_BIN[type(node.op)]()
        out.append((f"{type(node.op).__name__}->{type(m.op).__name__}", m))
    elif isinstance(node, ast.AugAssign) and type(node.op) in _SWAP_BIN:
        m = copy.deepcopy(node)
        m.op = _SWAP_BIN[type(node.op)]()
        out.append((f"aug {type(node.op).__name__}->{type(m.op).__name__}", m))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _SWAP_CMP:
        m = copy.deepcopy(node)
        m.ops = [_SWAP_CMP[type(node.ops[0])]()]
        out.append((f"{type(node.ops[0]).__name__}->{type(m.ops[0]).__name__}", m))
    elif isinstance(node, ast.BoolOp):
        m = copy.deepcopy(node)
        m.op = _SWAP_BOOL[type(node.op)]()
        out.append((f"{type(node.op).__name__}->{type(m.op).__name__}", m))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append((f"drop {type(node.op).__name__}", copy.deepcopy(node.operand)))
    elif isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        out.append(("constant", ast.Constant(_mutated_constant(node.value))))
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        out.append(("drop call", None))
    return out


def _function_nodes(tree: ast.Module, qualname: str) -> ast.AST:
    parts, scope = qualname.split("."), tree
    for part in parts:
        found = next((n for n in ast.iter_child_nodes(scope)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if found is None:
            raise ValueError(f"no function {qualname!r}")
        scope = found
    return scope


# Constants that are shapes, not numbers: a mutant there only raises a shape error (noise, not signal).
_SHAPE_KEYWORDS = {"dim", "axis", "keepdim", "dtype", "device", "descending", "diagonal", "start_dim", "end_dim"}


def _shape_constants(node: ast.AST) -> set[int]:
    """ids of constants under node that index, slice or name a dimension, and negative literals."""
    skip: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Subscript):
            skip.update(id(c) for c in ast.walk(n.slice) if isinstance(c, (ast.Constant, ast.UnaryOp)))
        elif isinstance(n, ast.keyword) and n.arg in _SHAPE_KEYWORDS:
            skip.update(id(c) for c in ast.walk(n.value))
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and isinstance(n.operand, ast.Constant):
            skip.update((id(n), id(n.operand)))
    return skip


def _walk_mutable(fn: ast.AST):
    """Nodes of fn's body, skipping its docstring, f-strings, decorators, annotations and shape constants."""
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and _is_text(body[0].value):
        body = body[1:]
    skip = set().union(*(_shape_constants(n) for n in body)) if body else set()
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.JoinedStr) or id(node) in skip:
            continue
        yield node
        children = [c for c in ast.iter_child_nodes(node) if not isinstance(c, (ast.arg, ast.arguments))]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            children = list(node.body)
        if isinstance(node, ast.AnnAssign):
            children = [c for c in (node.target, node.value) if c is not None]
        stack.extend(reversed(children))


def mutants_of(root: Path, file: str, functions: list[str]) -> list[OpMutant]:
    text = (root / file).read_text()
    tree = ast.parse(text)
    lines, starts = text.splitlines(keepends=True), _offsets(text)
    out: list[OpMutant] = []
    seen: set[tuple[int, int, str]] = set()
    for qualname in functions:
        for node in _walk_mutable(_function_nodes(tree, qualname)):
            for name, mutated in _variants(node):
                start = _char(lines, starts, node.lineno, node.col_offset)
                end = _char(lines, starts, node.end_lineno, node.end_col_offset)
                original = text[start:end]
                replacement = "pass" if mutated is None else ast.unparse(mutated)
                if replacement != original and (start, end, replacement) not in seen:
                    seen.add((start, end, replacement))
                    out.append(OpMutant(file, qualname, node.lineno, name, original, replacement, start, end))
    return out


@dataclass
class Target:
    name: str
    file: str
    functions: list[str]
    tests: list[str]
    timeout: float = 300.0


def load_targets(path: Path) -> list[Target]:
    doc = yaml.safe_load(path.read_text())
    return [Target(t["name"], t["file"], list(t["functions"]), list(t["tests"]), float(t.get("timeout", 300)))
            for t in doc["targets"]]
