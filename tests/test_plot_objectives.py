"""`entrenar plot`: a GRPO run's curves.png shows its rewards and rollout signal, a DPO run's its preference accuracy
and margin (plot.OBJECTIVE_PANELS), each line through its own metrics.jsonl values; an SFT run gets none of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.axes
import pytest

from entrenar import plot
from entrenar.plot import PNG_MAGIC, plot_run

BASE = {"lr": 1e-4, "grad_norm": 0.5, "tok_s": 100.0}


def _grpo_row(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 0.01 * step, **BASE, "reward": 0.5 + step / 10, "reward/bfcl": step / 10,
            "reward/bfcl-graded": 0.5, "reward_std": 0.3, "kl": 0.001 * step, "entropy": 0.4 - step / 100,
            "frac_reward_zero_std": 0.25, "frac_groups_dropped": 0.5, "truncated_share": 0.0}


def _write(run: Path, rows: list[dict[str, Any]]) -> None:
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _drawn(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, list, list]], list[str]]:
    lines: list[tuple[str, list, list]] = []
    titles: list[str] = []
    plot_line, set_title = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.set_title

    def record_line(self, xs, ys, *args, **kwargs):
        lines.append((kwargs.get("label"), list(xs), list(ys)))
        return plot_line(self, xs, ys, *args, **kwargs)

    def record_title(self, title, *args, **kwargs):
        titles.append(title)
        return set_title(self, title, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record_line)
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", record_title)
    return lines, titles


def test_grpo_run_draws_each_reward_and_the_rollout_signal(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _write(run, [_grpo_row(s) for s in (1, 2, 3)])
    lines, titles = _drawn(monkeypatch)
    plot_run(run)
    by_label = {label: (xs, ys) for label, xs, ys in lines}
    assert by_label["reward"] == ([1, 2, 3], [0.6, 0.7, 0.8])
    assert by_label["reward/bfcl"] == ([1, 2, 3], [0.1, 0.2, 0.3])  # every --reward's own line
    assert by_label["reward/bfcl-graded"][1] == [0.5, 0.5, 0.5]
    assert by_label["reward_std"][1] == [0.3] * 3
    assert by_label["kl"][1] == pytest.approx([0.001, 0.002, 0.003])
    assert by_label["entropy"][1] == pytest.approx([0.39, 0.38, 0.37])
    for share in ("frac_reward_zero_std", "frac_groups_dropped", "truncated_share"):
        assert share in by_label
    assert "rewards (GRPO)" in titles and any(t.startswith("rollouts (GRPO)") for t in titles)
    assert "preferences (DPO)" not in titles


def test_dpo_run_draws_accuracy_and_margin(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _write(run, [{"step": s, "loss": 0.7, **BASE, "rewards/accuracies": s / 4, "rewards/margins": 0.1 * s}
                 for s in (1, 2)])
    lines, titles = _drawn(monkeypatch)
    plot_run(run)
    by_label = {label: ys for label, _, ys in lines}
    assert by_label["rewards/accuracies"] == [0.25, 0.5]
    assert by_label["rewards/margins"] == pytest.approx([0.1, 0.2])
    assert "preferences (DPO)" in titles and "rewards (GRPO)" not in titles


def test_sft_run_gets_no_objective_panel(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _write(run, [{"step": s, "loss": 1.0 / s, **BASE} for s in (1, 2)])
    _, titles = _drawn(monkeypatch)
    plot_run(run)
    assert titles == ["loss", "learning rate", "grad norm (global L2, before clipping)", "tokens / s"]


def test_numpy_fallback_draws_the_objective_panels(tmp_path, monkeypatch):
    """Without matplotlib the PNG has a row of panels more for the two GRPO panels (3 rows of 2)."""
    run = tmp_path / "run"
    _write(run, [_grpo_row(s) for s in (1, 2, 3)])
    seen: list[int] = []
    real = plot._draw_png
    monkeypatch.setattr(plot, "_draw_png", lambda panels, out: (seen.append(len(panels)), real(panels, out)))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    result = plot_run(run)
    assert result["backend"] == "numpy" and seen == [6]
    assert (run / "curves.png").read_bytes().startswith(PNG_MAGIC)
