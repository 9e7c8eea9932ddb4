"""The tasks a run is judged by, as one panel: the targets (`--eval-task`, what the run should improve) and the
retained tasks (`--retain-task`, what must not get worse), each split into the units that are tested on their
own: a task, or one category of a BFCL task. Nothing is pooled across units: a gain in one BFCL category never
hides a loss in another (evaluate/paired.py's `panel_changes` tests each unit, Holm-adjusted over the panel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("target", "retain")


@dataclass
class PanelMember:
    evaluator: Any  # evaluate/in_loop.py's TaskEvaluator (or any object with its interface)
    role: str  # "target" | "retain"

    def __post_init__(self) -> None:
        assert self.role in ROLES, self.role


class TaskPanel:
    """The targets then the retained tasks, each measured by its own evaluator."""

    def __init__(self, members: list[PanelMember]):
        assert members, "a panel has at least one task"
        self.members = members

    @classmethod
    def of(cls, evaluator: Any) -> TaskPanel:
        """A panel of one target (a bare evaluator, as a Trainer was given before panels)."""
        return evaluator if isinstance(evaluator, TaskPanel) else cls([PanelMember(evaluator, "target")])

    @property
    def name(self) -> str:
        return " + ".join(m.evaluator.name for m in self.members)


def unit_of(evaluator: Any, record: dict[str, Any]) -> str:
    """The unit a problem's record is tested in: `bfcl:CATEGORY` for a BFCL question, else the task's name."""
    if getattr(evaluator, "kind", None) == "bfcl":
        return f"bfcl:{record['category']}"
    return evaluator.name


def units(evaluator: Any, records: list[dict[str, Any]]) -> dict[str, dict[str, bool]]:
    """{unit: {task id: passed}} of one task's records, in the records' order."""
    out: dict[str, dict[str, bool]] = {}
    for r in records:
        out.setdefault(unit_of(evaluator, r), {})[r["task_id"]] = bool(r["passed"])
    return out
