"""README.md, docs/design.md and bench/RESULTS.md speak of the product: what it does, what was measured (with date,
commit, card and command), never of the numbered work periods that produced it ("session 17", "issue 35",
"call 3", "item 5"); that history is in git log. Paths and names in code spans (bench/results/session18-h200/,
`call-125ea85/`) are file names and do not count.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/design.md", "bench/RESULTS.md")
HISTORY = re.compile(r"(?<![-\w/])(sessions?|issues?|calls?|items?|goals?)[ -]\d", re.IGNORECASE)
PATH_SPAN = re.compile(r"`[^`\n]*(?:/|\.py|\.sh|\.jsonl?|\.md)[^`\n]*`")
RESULT_PATH = re.compile(r"bench/results/[A-Za-z0-9_.\-/]+")


def history_mentions(text: str) -> list[str]:
    """Each line (numbered) that tells history by a numbered work period, code-span paths left out."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        match = HISTORY.search(PATH_SPAN.sub("`PATH`", line))
        if match:
            found.append(f"{number}: ...{match.group(0)}... {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("name", DOCS)
def test_docs_do_not_tell_history_by_numbered_periods(name):
    found = history_mentions((ROOT / name).read_text(encoding="utf-8"))
    assert not found, f"{name} speaks of numbered sessions/issues/calls/items (say the date, commit, card):\n  " + \
        "\n  ".join(found)


@pytest.mark.parametrize("line, bad", [
    ("on one H200 (session 18): 1.34x", True),
    ('(bench/RESULTS.md, "Session 15")', True),
    ("the issue-15 profile", True),
    ("call 3: fp8 at batch 4", True),
    ("issue 38 item 4: a folder", True),
    ("files in `bench/results/session18-h200x4/fp32/` and `call-143ab54/`", False),
    ("python -m bench run issue36-ddp-graphs --repeat 3", False),
    ("2026-11-28 at 2fb962b, three rounds in one run", False),
    ("a call of the right function with a wrong value", False),
])
def test_the_check_fires_on_history_and_not_on_paths(line, bad):
    assert bool(history_mentions(line)) is bad


@pytest.mark.parametrize("name", DOCS)
def test_results_paths_named_in_the_docs_exist(name):
    missing = []
    for path in set(RESULT_PATH.findall((ROOT / name).read_text(encoding="utf-8"))):
        path = path.rstrip(".,)/")
        if "callN" in path or ".." in path or path.endswith("-"):  # a pattern (callN/, call1..4/, h200-8a08292-*)
            continue
        if not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"bench/results paths {name} names that do not exist:\n  " + "\n  ".join(sorted(missing))
