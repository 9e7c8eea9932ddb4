"""bench/panel_pick.py: GRPO starts from the A/B variant whose BFCL irrelevance held best, then the most
simple_python passes; a variant without its after-eval is not a candidate."""

from __future__ import annotations

import json

from bench.panel_pick import pick


def _write(path, irrelevance: int, simple: int) -> None:
    path.mkdir(parents=True)
    rows = ([{"category": "irrelevance", "passed": i < irrelevance} for i in range(10)]
            + [{"category": "simple_python", "passed": i < simple} for i in range(10)])
    (path / "after_bfcl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_irrelevance_first_then_simple_python_then_the_order_given(tmp_path):
    _write(tmp_path / "a", irrelevance=8, simple=9)
    _write(tmp_path / "b", irrelevance=9, simple=2)
    _write(tmp_path / "c", irrelevance=9, simple=5)
    _write(tmp_path / "d", irrelevance=9, simple=5)
    assert pick(tmp_path, ["a", "b", "c", "d", "missing"]) == "c"
    assert pick(tmp_path, ["d", "c"]) == "d"
    assert pick(tmp_path, ["missing"]) is None
