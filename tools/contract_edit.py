#!/usr/bin/env python3
"""Add ``cost:`` + ``mutate:`` to invariants of contracts/*.yaml with targeted insertions.

    tools/contract_edit.py SPEC.yaml [--check]

SPEC.yaml maps invariant ids to ``{cost: fast|slow, mutate: [{symbol or file, find, replace}, ...]}``. For each id
the block is inserted right after that invariant's last line in whichever contracts file holds it; the
rest of the file is left byte for byte as it was (other people edit these files concurrently, so a
whole-file rewrite through a YAML dumper is never done). An invariant that already has ``mutate:`` is
left alone (edit it by hand). Every edit is checked to apply exactly once first; ``--check`` stops there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import CONTRACTS, ROOT, Edit, apply_edits

_ID_LINE = re.compile(r"^  - id: (\S+)\s*$")


def render(spec: dict) -> str:
    """The YAML lines for one invariant's cost and mutate (JSON strings are valid YAML scalars)."""
    lines = [f"    cost: {spec.get('cost', 'fast')}"]
    if "timeout" in spec:
        lines.append(f"    timeout: {spec['timeout']}")
    lines.append("    mutate:")
    for item in spec["mutate"]:
        anchor = "symbol" if item.get("symbol") else "file"
        lines.append(f"      - {anchor}: {item[anchor]}")
        lines.append(f"        find: {json.dumps(item['find'], ensure_ascii=False)}")
        lines.append(f"        replace: {json.dumps(item['replace'], ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def insert(path: Path, inv_id: str, block: str) -> bool:
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if (m := _ID_LINE.match(ln)) and m.group(1) == inv_id), None)
    if start is None:
        return False
    end = next((i for i in range(start + 1, len(lines)) if _ID_LINE.match(lines[i])), len(lines))
    body = "".join(lines[start:end])
    if re.search(r"^    mutate:", body, re.MULTILINE):
        print(f"{inv_id}: already has mutate:, left alone")
        return True
    last = end
    while last > start + 1 and not lines[last - 1].strip():
        last -= 1
    if not lines[last - 1].endswith("\n"):
        lines[last - 1] += "\n"
    lines[last:last] = [block]
    path.write_text("".join(lines))
    return True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("spec", type=Path)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    spec = yaml.safe_load(args.spec.read_text())
    bad = 0
    for inv_id, entry in spec.items():
        try:
            apply_edits(ROOT, [Edit(**item) for item in entry["mutate"]])
        except ValueError as e:
            print(f"{inv_id}: {e}")
            bad += 1
    if bad or args.check:
        return 1 if bad else 0
    for inv_id, entry in spec.items():
        if not any(insert(path, inv_id, render(entry)) for path in sorted(CONTRACTS.glob("*.yaml"))):
            print(f"{inv_id}: no such invariant in contracts/*.yaml")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
