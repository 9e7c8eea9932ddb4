"""The package's layers (docs/design.md, "Layout"): every module of src/entrenar belongs to one layer,
imports only from its own layer or lower ones, and no modules import each other in a circle.

Imports are read with `ast` from the source (module level AND inside functions: a lazy import is still
a dependency), relative imports resolved. `from X import y` depends on the module X.y when that is a
module, else on X (a package's __init__). A failure prints every offending edge.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import entrenar

SRC = Path(entrenar.__file__).resolve().parent

# Lowest first. A module belongs to the layer of the longest prefix naming it (a package or a module).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("entrenar.errors", "entrenar.tensors", "entrenar.stops")),
    ("utils", ("entrenar.fileio", "entrenar.devices", "entrenar.outpaths", "entrenar.chat_limits")),
    ("config", ("entrenar.families", "entrenar.config")),
    ("kernels", ("entrenar.kernels",)),
    ("model", ("entrenar.long_context", "entrenar.varlen", "entrenar.model")),
    # what the tokenizer needs (a model spec's path, the GGUF parser) is below it; formats/ (whose gguf_write.py
    # imports the tokenizer) above it. Outside formats/: importing formats.x runs formats/__init__ too.
    ("files", ("entrenar.model_spec", "entrenar.gguf_file")),
    ("tokenizer", ("entrenar.tokenizer",)),
    ("formats", ("entrenar.formats",)),
    ("data", ("entrenar.data", "entrenar.tokenizer_train")),
    ("peft", ("entrenar.peft",)),
    ("merge", ("entrenar.merge", "entrenar.export")),
    ("verify", ("entrenar.static_decode", "entrenar.generate", "entrenar.engine", "entrenar.verify")),
    # the data commands that generate or run programs (replay's answers pass the chat gates, tasks-from-code's
    # doctests run in the sandbox) sit with the evaluation they use
    ("evaluate", ("entrenar.evaluate", "entrenar.data.replay", "entrenar.data.tasks_from_code")),
    ("train", ("entrenar.train", "entrenar.plot")),
    ("cli", ("entrenar.cli", "entrenar.__main__", "entrenar.api")),
]
# the package's __init__: the version, the error types and the Python API (entrenar.api, loaded on first use), so
# above everything: no module of the package imports it
ROOT = "entrenar"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str] | dict[str, Path] = MODULES) -> set[str]:
    """The entrenar modules that `path` (module `name`) imports anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known and "." in target:  # `import entrenar.x.y as z`, a name in X
                target = target.rpartition(".")[0]
            if target in known and target != name:
                out.add(target)
    # importing a.b.c runs a/__init__ and a/b/__init__ first: those packages are dependencies too, except the
    # importer's own packages (already imported when it runs) and the root
    own = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
    for target in list(out):
        parts = target.split(".")
        out.update(p for p in (".".join(parts[:i]) for i in range(2, len(parts)))
                   if p in known and p not in own)
    return out


def layer_of(name: str) -> int | None:
    if name == ROOT:
        return len(LAYERS)
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def layer_name(index: int) -> str:
    return "root" if index == len(LAYERS) else LAYERS[index][0]


def graph() -> dict[str, set[str]]:
    return {name: imports_of(path, name) for name, path in MODULES.items()}


def upward_edges(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            ls, ld = layer_of(src), layer_of(dst)
            if ls is not None and ld is not None and ld > ls:
                bad.append(f"{src} ({layer_name(ls)}) -> {dst} ({layer_name(ld)})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each with its edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found



def test_every_module_has_a_layer():
    missing = sorted(name for name in MODULES if layer_of(name) is None)
    assert not missing, f"modules in no layer (add them to LAYERS here and to docs/design.md's Layout): {missing}"
    assert len(MODULES) > 60  # the walk really covered the package



def test_no_import_from_a_higher_layer():
    bad = upward_edges(graph())
    assert not bad, "imports from a higher layer:\n  " + "\n  ".join(bad)



def test_no_import_cycles():
    edges = graph()
    found = cycles(edges)
    lines = [" <-> ".join(c) + ": " + ", ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c)
             for c in found]
    assert not found, "modules importing each other in a circle:\n  " + "\n  ".join(lines)



def test_argparse_only_in_the_cli():
    users = sorted(name for name, path in MODULES.items() if layer_of(name) != len(LAYERS) - 1
                   and any(isinstance(n, (ast.Import, ast.ImportFrom))
                           and "argparse" in ([a.name for a in n.names] if isinstance(n, ast.Import)
                                              else [n.module or ""])
                           for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))))
    assert not users, f"argparse imported outside entrenar.cli: {users}"


@pytest.mark.parametrize("text, name, expected", [
    ("def f():\n    from ..model import CausalLM\n", "entrenar.train.probe", "entrenar.model"),
    ("from . import tokenizer\n", "entrenar.probe", "entrenar.tokenizer"),
    ("import entrenar.formats.gguf as g\n", "entrenar.probe", {"entrenar.formats.gguf", "entrenar.formats"}),
    ("from entrenar.formats import load_model\n", "entrenar.probe", "entrenar.formats"),
    ("from .formats.hf import save_hf\n", "entrenar.probe", {"entrenar.formats.hf", "entrenar.formats"}),
    ("from .hf import save_hf\n", "entrenar.formats.probe", "entrenar.formats.hf"),
    ("class A:\n    def m(self):\n        from .io import save_adapter\n", "entrenar.peft.probe", "entrenar.peft.io"),
])
def test_scanner_sees_every_spelling(text, name, expected, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(text)
    assert imports_of(probe, name) == (expected if isinstance(expected, set) else {expected})


def test_checks_fire_on_an_upward_edge_and_a_cycle():
    edges = {"entrenar.model": {"entrenar.train.loop"}, "entrenar.train.loop": {"entrenar.train.optim"},
             "entrenar.train.optim": {"entrenar.train.loop"}}
    assert upward_edges(edges) == ["entrenar.model (model) -> entrenar.train.loop (train)"]
    assert cycles(edges) == [["entrenar.train.loop", "entrenar.train.optim"]]


def test_the_tokenizer_runs_without_formats(tmp_path):
    """Reading a GGUF's tokenizer and resolving a MODEL spec load neither formats/ nor torch (the layers at run time,
    not only in the import statements)."""
    code = (
        "import sys\n"
        "from entrenar import tokenizer\n"
        "from entrenar.errors import InputError\n"
        "refused = []\n"
        "for call in (lambda: tokenizer.load_tokenizer('no-such-packaged-model'),\n"
        f"             lambda: tokenizer.read_gguf_tokenizer_fields({str(tmp_path / 'x.gguf')!r})):\n"
        "    try:\n"
        "        call()\n"
        "    except InputError as e:  # both are refused: what matters is what they imported on the way\n"
        "        refused.append(str(e)[:60])\n"
        "print(len(refused), sorted(m for m in sys.modules if m == 'torch' or m.startswith('entrenar.formats')))\n"
    )
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes(20))  # a truncated header: parsed, then refused
    env = dict(os.environ, PYTHONPATH=str(SRC.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2 []", f"the tokenizer loaded {out.stdout.strip()} (stderr: {out.stderr[-500:]})"
