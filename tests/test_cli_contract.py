"""The command line's structure: library modules never import the CLI (issue 11: generate.py and
merge.py imported `cli.add_command`, a cycle), the registration module is a leaf, and every
command's --device goes through the one validator."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import entrenar
from entrenar import cli

SRC = Path(entrenar.__file__).resolve().parent
CLI_MODULES = {"entrenar.cli", "entrenar.cli_registry", "entrenar.__main__"}  # the CLI and its entry point


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path, name: str | None = None) -> set[str]:
    """Every module an import statement anywhere in the file (also inside functions) names,
    relative imports resolved; `from X import y` counts as both X and X.y."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def library_files() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if _module_name(p) not in CLI_MODULES]


@pytest.mark.parametrize("text", ["def f():\n    from .cli import add_command\n", "from . import cli\n",
                                  "import entrenar.cli as c\n", "from entrenar import cli\n",
                                  "def g():\n    from ..cli import main\n"])
def test_import_scanner_sees_every_spelling(text, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(text)
    name = "entrenar.train.probe" if "..cli" in text else "entrenar.probe"
    assert "entrenar.cli" in imported_modules(probe, name)


def test_no_library_module_imports_the_cli():
    offenders = {str(p.relative_to(SRC)): sorted(m for m in imported_modules(p) if m == "entrenar.cli")
                 for p in library_files()}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"library modules import entrenar.cli: {offenders}"
    assert len(library_files()) > 20  # the walk really covered the package


def test_registration_module_is_a_leaf():
    own = sorted(m for m in imported_modules(SRC / "cli_registry.py") if m.split(".")[0] == "entrenar")
    assert own == [], own


def test_generate_and_merge_are_library_code():
    for name in ("generate.py", "merge.py"):
        mods = imported_modules(SRC / name)
        assert not any(m.startswith("entrenar.cli") or m == "argparse" for m in mods), (name, mods)


def _device_actions(parser) -> dict[str, str]:
    """{command path: --device default} for every (sub)command that has --device."""
    out: dict[str, str] = {}

    def walk(p, path: str) -> None:
        for action in p._actions:
            if "--device" in action.option_strings:
                out[path] = action.default
            if action.__class__.__name__ == "_SubParsersAction":
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}".strip())

    walk(parser, "")
    return out


def test_every_device_option_comes_from_the_shared_helper():
    devices = _device_actions(cli.build_parser())
    assert {"pretrain", "finetune", "eval", "verify", "qa", "generate"} <= set(devices)
    for path, default in devices.items():
        assert default in ("cpu", "auto"), (path, default)
    text = "\n".join(p.read_text(encoding="utf-8") for p in library_files())
    assert text.count('"--device"') == 0, "a command declares --device itself instead of add_device_option"


@pytest.mark.parametrize("argv", [
    ["eval", "--model", "m", "--data", "d", "--device", "tpu"],
    ["generate", "--model", "m", "--prompt", "hi", "--device", "cuda:x"],
    ["verify", "--model", "m", "--device", "gpu"],
    ["finetune", "--model", "m", "--data", "d", "--out", "o", "--device", "bogus"],
])
def test_bad_device_is_one_message_everywhere(argv, capsys):
    assert cli.main(argv) == 2
    assert "not a device; use cpu, cuda, cuda:N or auto" in capsys.readouterr().err


def test_resolve_device_rules(monkeypatch):
    import torch

    from entrenar.devices import resolve_device
    from entrenar.errors import InputError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("CPU") == "cpu"
    with pytest.raises(InputError, match="no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(InputError, match="2 CUDA device"):
        resolve_device("cuda:2")
