#!/usr/bin/env python3
"""Anchor the ``mutate:`` edits of contracts/*.yaml by symbol instead of by file, in place.

    tools/anchor_contracts.py            # rewrite contracts/*.yaml
    tools/anchor_contracts.py --check    # exit 1 if a rewrite would change something (nothing written)
    tools/anchor_contracts.py contracts/train.yaml ...   # only these files

Each ``file:`` + ``find:`` edit of a Python file whose find lies inside a def, class or module/class-level
assignment becomes ``symbol: module:Qual.name`` (the innermost such symbol whose name is unique in its
file), so the edit survives the code moving around its file or to another one (tools/symbol_anchors.py).
Each ``symbol:`` edit whose symbol has moved since gets its current module:qualname. An edit that no
longer applies where it points (its find left its symbol or file) is re-anchored where the find now is,
if it occurs exactly once in all of src/. Everything else (text between symbols, e.g. imports; a find
that spans two symbols; a find that is nowhere or repeated) keeps its anchor and is counted with the reason.

Only the ``file: ...`` (or ``symbol: ...``) key and value of a converted edit are replaced: comments,
order, quoting and layout of the rest stay byte for byte (a text edit at the positions the YAML parser
reports, never a re-dump). Before writing, every invariant of a rewritten file must produce exactly the
same mutated sources as before. Running it twice changes nothing the second time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import ROOT, Edit, apply_edits
from symbol_anchors import AnchorError, SourceIndex, gc_paused, innermost, locate, search_roots


@dataclass
class Change:
    start: int  # offsets in the YAML text: the key's first character ...
    end: int  # ... and just past the value
    text: str  # what replaces them
    label: str  # invariant id and item number, for the report


def _scalar(node) -> str | None:
    return node.value if isinstance(node, yaml.ScalarNode) else None


def _mapping(node) -> dict[str, tuple]:
    """key -> (key node, value node) of a YAML mapping node ({} for anything else)."""
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}


def _line(key: str, value: str) -> str:
    """``key: value``, quoted only if YAML would not read the plain value back as this string."""
    plain = f"{key}: {value}"
    try:
        if yaml.safe_load(plain) == {key: value}:
            return plain
    except yaml.YAMLError:
        pass  # not valid plain: quoted below
    return f"{key}: {json.dumps(value)}"


def anchor_for(index: SourceIndex, file: str, find: str, texts: dict[str, str]) -> tuple[str | None, str]:
    """(symbol spec, '') for a file edit's find, or (None, why it stays file-anchored)."""
    if not file.endswith(".py"):
        return None, "not a Python file"
    text = index.text(file, texts)
    if text is None:
        return None, "its file does not exist"
    if text.count(find) != 1:
        return None, "its find is not exactly once in its file"
    return _innermost_spec(index, file, find, text.index(find), texts)


def _innermost_spec(index: SourceIndex, file: str, find: str, at: int,
                    texts: dict[str, str]) -> tuple[str | None, str]:
    try:
        symbols = index.symbols(file, texts)
    except AnchorError:
        return None, "its file does not parse at that point"
    holding = innermost(symbols, at, at + len(find))
    if not holding:
        return None, "module-level text outside any def/class/assignment"
    names = Counter(s.qualname for s in symbols)
    for sym in holding:
        if names[sym.qualname] != 1:
            continue  # e.g. a property setter or a conditional def: the name alone does not say which
        try:
            found, where = locate(index, sym.spec, find, texts)
        except AnchorError:
            continue  # its module name does not lead back to this file: try the enclosing symbol
        if found.file == file and where == at:
            return sym.spec, ""
    return None, "every enclosing symbol's name occurs more than once in its file"


def relocate(index: SourceIndex, edit: Edit, texts: dict[str, str]) -> Edit | None:
    """The edit re-anchored where its find now is, when it no longer applies where it points: the find
    must occur exactly once in all of src/ (and the edit's own top folder), then it gets the innermost
    symbol there, or that file when it is module-level text. None when the find is absent or repeated."""
    module = edit.symbol.rpartition(":")[0]
    hint = edit.file or (index.file_of(module, texts) if module else None)
    hits = []
    for top in search_roots(hint):
        for file in index.python_files(top):
            n = (index.text(file, texts) or "").count(edit.find)
            if n > 1:
                return None  # twice in one file: the place is a guess
            if n == 1:
                hits.append(file)
    if len(hits) != 1:
        return None
    file = hits[0]
    spec, _ = _innermost_spec(index, file, edit.find, (index.text(file, texts) or "").index(edit.find), texts)
    return Edit("" if spec else file, edit.find, edit.replace, spec or "")


def plan(path: Path, index: SourceIndex, counts: Counter, left: list[str]) -> tuple[str, list[Change]]:
    """The YAML text of path and the changes that anchor its edits (counts: one reason per edit;
    left: a line per edit that keeps its file anchor or does not resolve)."""
    text = path.read_text()
    doc = _mapping(yaml.compose(text, Loader=yaml.SafeLoader))
    changes: list[Change] = []
    invariants = doc.get("invariants", (None, None))[1]
    for inv in invariants.value if isinstance(invariants, yaml.SequenceNode) else []:
        fields = _mapping(inv)
        inv_id = _scalar(fields.get("id", (None, None))[1]) or "?"
        mutate = fields.get("mutate", (None, None))[1]
        texts: dict[str, str] = {}  # the sources as the invariant's earlier edits left them
        for n, item in enumerate(mutate.value if isinstance(mutate, yaml.SequenceNode) else [], 1):
            keys = _mapping(item)
            get = {k: _scalar(v) for k, (_, v) in keys.items()}
            edit = Edit(get.get("file") or "", get.get("find"), get.get("replace"), get.get("symbol") or "")
            label = f"{path.name}: {inv_id} item {n}"
            why, change, edit = _anchor_item(index, edit, keys, texts, label)
            counts[why] += 1
            if why.startswith("left"):
                left.append(f"{label}: {why}")
            if change:
                changes.append(change)
            try:
                texts = apply_edits(index.root, [edit], index, texts)
            except ValueError:
                break  # the later edits of an invariant that does not apply now stay as they are (lint says why)
    return text, changes


def _anchor_item(index: SourceIndex, edit: Edit, keys: dict, texts: dict[str, str],
                 label: str) -> tuple[str, Change | None, Edit]:
    """(what happens to one edit, the change to its YAML or None, the edit as it will read)."""
    if not isinstance(edit.find, str) or bool(edit.file) == bool(edit.symbol):
        return "left: malformed (the lint reports it)", None, edit
    anchor = "symbol" if edit.symbol else "file"
    key, value = keys[anchor]

    def change(why: str, new: Edit, note: str) -> tuple[str, Change, Edit]:
        line = _line("symbol", new.symbol) if new.symbol else _line("file", new.file)
        return why, Change(key.start_mark.index, value.end_mark.index, line, f"{label}: {note}"), new

    if edit.symbol:
        try:
            sym, _ = locate(index, edit.symbol, edit.find, texts)
        except AnchorError:
            moved = relocate(index, edit, texts)
            if moved is None:
                return "left: its symbol or find does not resolve now (the lint reports it)", None, edit
            return change("re-anchored (its find moved out of its symbol)", moved,
                          f"find moved: {edit.symbol} -> {moved.symbol or moved.file}")
        if sym.spec == edit.symbol or ":" not in edit.symbol:
            return "symbol already", None, edit
        return change("symbol refreshed (the code moved)", replace(edit, symbol=sym.spec),
                      f"moved: {edit.symbol} -> {sym.spec}")
    spec, why = anchor_for(index, edit.file, edit.find, texts)
    if spec is not None:
        return change("converted", replace(edit, file="", symbol=spec), f"{edit.file} -> {spec}")
    if why in ("its file does not exist", "its find is not exactly once in its file"):
        moved = relocate(index, edit, texts)
        if moved is not None and (moved.symbol or moved.file != edit.file):
            return change("re-anchored (its find moved to another file)", moved,
                          f"find moved: {edit.file} -> {moved.symbol or moved.file}")
        why += " (the lint reports it)"
    return f"left file-anchored: {why}", None, edit


def rewrite(text: str, changes: list[Change]) -> str:
    for c in sorted(changes, key=lambda c: c.start, reverse=True):
        text = text[:c.start] + c.text + text[c.end:]
    return text


def _mutated(yaml_text: str, index: SourceIndex) -> dict[str, object]:
    """invariant id -> its mutated sources (or the error) for one contracts file's text."""
    out: dict[str, object] = {}
    for inv in (yaml.safe_load(yaml_text) or {}).get("invariants") or []:
        edits = [Edit(str(i.get("file") or ""), i.get("find"), i.get("replace"), str(i.get("symbol") or ""))
                 for i in inv.get("mutate") or [] if isinstance(i, dict)]
        try:
            out[str(inv.get("id"))] = apply_edits(index.root, edits, index)
        except ValueError as e:
            out[str(inv.get("id"))] = f"error: {e}"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="contracts files (default: contracts/*.yaml)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file would change")
    p.add_argument("--verbose", "-v", action="store_true", help="print every change")
    p.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = p.parse_args(argv)
    index = SourceIndex(args.root)
    counts: Counter = Counter()
    left: list[str] = []
    pending, failed = [], 0
    for path in args.files or sorted((args.root / "contracts").glob("*.yaml")):
        text, changes = plan(path, index, counts, left)
        if not changes:
            continue
        new = rewrite(text, changes)
        before, after = _mutated(text, index), _mutated(new, index)
        # an invariant that applied must mutate exactly as before (a bug here, never expected: refuse to
        # write); one that did not apply (its find moved) may now, and must not newly fail
        bad = [k for k in before if not isinstance(before[k], str) and before[k] != after.get(k)]
        if bad:
            print(f"{path.name}: the anchored edits would mutate differently ({', '.join(bad)}); not written")
            failed += 1
            continue
        pending.append((path, new, changes))
    for path, new, changes in pending:
        if args.verbose or args.check:
            for c in changes:
                print(c.label)
        if not args.check:
            path.write_text(new)
    if args.verbose:
        print("\n".join(left))
    summary = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
    n_changes = sum(len(c) for _, _, c in pending)
    verb = "would change" if args.check else "changed"
    print(f"anchor_contracts: {verb} {n_changes} edit(s) in {len(pending)} file(s); {summary}")
    return 1 if failed or (args.check and pending) else 0


if __name__ == "__main__":
    with gc_paused():
        sys.exit(main())
