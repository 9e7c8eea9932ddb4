"""Did the task metric change, on the same problems? The exact McNemar test on paired pass/fail results.

Two evaluations of the same problems (the base at step 0 and a later step) are paired: a problem either
keeps its verdict or flips. Only the flips carry information: b problems were lost (passed before, failed
after), c were gained. Under "no change" each flip is a fair coin, so b ~ Binomial(b + c, 1/2); the two-sided
p-value is the chance of a split at least as uneven as the one seen (McNemar 1947, exact form: no normal
approximation, right for the handful of flips a 164-problem eval gives).
"""

from __future__ import annotations

from collections.abc import Mapping
from math import comb
from typing import Any

# GUARD-TASK-REGRESSION fires when a drop is this significant (two-sided exact McNemar); design.md states it
SIGNIFICANCE = 0.05


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value for `lost` and `gained` discordant pairs (1.0 when there are none)."""
    assert lost >= 0 and gained >= 0, (lost, gained)
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(lost, gained) + 1)) / 2 ** n
    return min(1.0, 2.0 * tail)


def _verdict(p: float, lost: int, gained: int) -> str:
    if p < SIGNIFICANCE and lost != gained:
        return "regressed" if lost > gained else "improved"
    return "no significant change"


def paired_change(before: Mapping[str, bool], after: Mapping[str, bool]) -> dict[str, Any]:
    """The change from `before` to `after` ({problem id: passed}) on the problems both evaluated: passed
    counts, the problems gained and lost (ids in `before`'s order), the exact McNemar p-value and the verdict
    ("improved" / "regressed" when p < SIGNIFICANCE, else "no significant change")."""
    common = [k for k in before if k in after]
    lost = [k for k in common if before[k] and not after[k]]  # in the problems' order
    gained = [k for k in common if after[k] and not before[k]]
    p = mcnemar_exact(len(lost), len(gained))
    return {"problems": len(common), "passed_before": sum(bool(before[k]) for k in common),
            "passed_after": sum(bool(after[k]) for k in common), "gained": gained, "lost": lost,
            "p_value": p, "verdict": _verdict(p, len(lost), len(gained))}


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (Holm 1979): sorted ascending, the i-th smallest (from 0) times
    m - i, made monotone and capped at 1. Rejecting where the adjusted p < alpha keeps the chance of any
    false alarm over the whole panel at most alpha, whatever the dependence between the tests."""
    m = len(p_values)
    adjusted: dict[str, float] = {}
    running = 0.0
    for i, (name, p) in enumerate(sorted(p_values.items(), key=lambda kv: kv[1])):
        running = max(running, min(1.0, (m - i) * p))
        adjusted[name] = running
    return adjusted


def panel_changes(before: Mapping[str, Mapping[str, bool]],
                  after: Mapping[str, Mapping[str, bool]]) -> dict[str, dict[str, Any]]:
    """The paired change of every unit (a task, or one BFCL category) of a panel on its own problems,
    nothing pooled; each verdict judged at the Holm-adjusted p-value (`p_holm`) over the units both
    evaluations have, so a panel of many noise-level units does not call one of them significant by chance."""
    changes = {u: paired_change(before[u], after[u]) for u in before if u in after}
    adjusted = holm({u: c["p_value"] for u, c in changes.items()})
    for u, c in changes.items():
        c["p_holm"] = adjusted[u]
        c["verdict"] = _verdict(adjusted[u], len(c["lost"]), len(c["gained"]))
    return changes


def describe_change(change: dict[str, Any], name: str, step_before: int, step_after: int) -> str:
    """One line: the counts, the flips and the verdict; a drop is always called a drop, with its p-value."""
    n, b, a = change["problems"], change["passed_before"], change["passed_after"]
    head = (f"{name}: {b}/{n} at step {step_before} -> {a}/{n} at step {step_after}; gained "
            f"{len(change['gained'])}, lost {len(change['lost'])}; exact McNemar p = {change['p_value']:.3g}"
            + (f" (Holm over the panel {change['p_holm']:.3g})" if change.get("p_holm", change["p_value"])
               != change["p_value"] else ""))
    if change["verdict"] == "regressed":
        return head + f": a significant drop (p < {SIGNIFICANCE:g})"
    if change["verdict"] == "improved":
        return head + f": a significant gain (p < {SIGNIFICANCE:g})"
    if a < b:
        return head + ": a drop, not significant"
    if a > b:
        return head + ": a gain, not significant"
    return head + ": no change"
