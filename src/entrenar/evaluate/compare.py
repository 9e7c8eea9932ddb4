"""`eval --task ... --out AFTER.jsonl --compare BEFORE.jsonl`: two models judged on the same problems, one paired
test per unit (a task, or one BFCL category; evaluate/paired.py's panel_changes: exact McNemar on the unit's own
problems, Holm over the units), so a user can tell a base from its fine-tune without pooling categories.

Rows are read from per-problem files as `eval --task` and a run's RUN/task_eval/step-N.jsonl write them: a row's
unit is its `unit` when it has one, `bfcl:CATEGORY` when it has a `category`, else the task's name; with several
samples per problem only sample 0 is paired (the greedy answer when --temperature is 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InputError
from ..fileio import read_jsonl
from .paired import describe_change, panel_changes


def read_units(path: str | Path, task: str) -> dict[str, dict[str, bool]]:
    """{unit: {task id: passed}} of a per-problem results file; exit 2 naming FILE:LINE on a row that is not one."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--compare {path}: no such file (give the --out JSONL of an earlier `eval --task`)")
    out: dict[str, dict[str, bool]] = {}
    for n, row in read_jsonl(path):  # a line that is not JSON: exit 2 naming FILE:LINE
        if not isinstance(row, dict) or "task_id" not in row or not isinstance(row.get("passed"), bool):
            raise InputError(f"{path}:{n}: not a per-problem result (needs task_id and a boolean passed)")
        if row.get("sample", 0) != 0:
            continue
        unit = row.get("unit") or (f"bfcl:{row['category']}" if "category" in row else task)
        out.setdefault(unit, {})[str(row["task_id"])] = row["passed"]
    if not out:
        raise InputError(f"--compare {path}: no rows")
    return out


def compare_results(before_path: str | Path, after_path: str | Path, task: str) -> dict[str, Any]:
    """Per-unit paired changes from BEFORE to AFTER (problems both files hold); exit 2 when they share none."""
    before, after = read_units(before_path, task), read_units(after_path, task)
    changes = panel_changes(before, after)
    if not changes or not any(c["problems"] for c in changes.values()):
        raise InputError(f"--compare {before_path}: no problem in common with this eval's (units "
                         f"{', '.join(sorted(before))} vs {', '.join(sorted(after))})")
    return {"before": str(before_path), "units": changes,
            "lines": [describe_change(c, u, 0, 1).replace("at step 0", "before").replace("at step 1", "after")
                      for u, c in changes.items()]}


def format_comparison(comparison: dict[str, Any]) -> str:
    head = f"{'unit':<24} {'before':>7} {'after':>7} {'gained':>6} {'lost':>5} {'p':>9} {'p (Holm)':>9}  verdict"
    rows = [head]
    for unit, c in comparison["units"].items():
        rows.append(f"{unit:<24} {c['passed_before']:>7} {c['passed_after']:>7} {len(c['gained']):>6} "
                    f"{len(c['lost']):>5} {c['p_value']:>9.3g} {c['p_holm']:>9.3g}  {c['verdict']}")
    return "\n".join(rows)
