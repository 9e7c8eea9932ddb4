"""Every invariant listed in contracts/*.yaml names a test that exists (and a mutation)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "contracts").glob("*.yaml"))


def _defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}::{item.name}")
    return names


def test_contract_files_exist():
    assert FILES, "contracts/ holds no *.yaml"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_contract_tests_exist(path):
    doc = yaml.safe_load(path.read_text())
    ids = set()
    for inv in doc["invariants"]:
        for key in ("id", "claim", "test", "mutation"):
            assert inv.get(key), f"{path.name}: invariant {inv.get('id')} lacks {key!r}"
        assert inv["id"] not in ids, f"duplicate invariant id {inv['id']}"
        ids.add(inv["id"])
        tests = inv["test"] if isinstance(inv["test"], list) else [inv["test"]]
        for node in tests:
            file, _, name = node.partition("::")
            name = name.split("[")[0]
            f = ROOT / file
            assert f.is_file(), f"{inv['id']}: {file} does not exist"
            assert name in _defined_tests(f), f"{inv['id']}: {node} is not defined"
