"""`entrenar plot RUN` -> RUN/curves.png: train and eval loss, learning rate, grad norm, tokens/s vs step; a GRPO
run's rewards and rollout signal, a DPO run's preference accuracy and margin (OBJECTIVE_PANELS); and the
--eval-task / --retain-task metrics when the run measured them (metrics.jsonl's rows with a "task" key), one line per
task or BFCL category in one panel.

Uses matplotlib when importable; otherwise draws the same panels (no text) with numpy and
zlib so the command never needs a plotting stack.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError
from .fileio import atomic_write, read_jsonl
from .outpaths import check_creatable, check_replaceable_file

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _read(path: Path) -> list[dict[str, Any]]:
    # fileio.read_jsonl: the one JSONL reader (a bad line is an InputError naming file:line)
    return [row for _, row in read_jsonl(path)] if path.exists() else []


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _task_lines(tasks: list[dict]) -> list[tuple[str, list[float], list[float]]]:
    """One line per --eval-task / --retain-task unit (a task, or a BFCL category), through its own rows' metric:
    units are judged one by one, so they are drawn one by one, never pooled into one line."""
    lines = []
    for unit in dict.fromkeys(r["task"] for r in tasks):
        rows = [r for r in tasks if r["task"] == unit]
        metric, role = rows[0]["metric"], rows[0].get("role")
        lines.append((f"{unit} {metric}" + (f" ({role})" if role else ""), *_series(rows, metric)))
    return lines


# the objective's own per-step figures (metrics.jsonl keys), a panel each where the run logged them: a GRPO run's
# rewards (the total, each --reward's, the spread within groups) and its rollouts' signal (train/grpo.py); DPO's
# preference accuracy and margin (train/objective.py)
OBJECTIVE_PANELS = (
    ("rewards (GRPO)", ("reward", "reward/*", "reward_std")),
    ("rollouts (GRPO): KL to the reference, entropy, shares",
     ("kl", "entropy", "frac_reward_zero_std", "frac_groups_dropped", "truncated_share")),
    ("preferences (DPO)", ("rewards/accuracies", "rewards/margins")),
)


def _objective_panels(metrics: list[dict]) -> list[tuple[str, list, bool]]:
    """OBJECTIVE_PANELS whose keys the step rows hold; "reward/*": every reward's own key, in the order logged."""
    logged = list(dict.fromkeys(k for r in metrics for k in r))
    panels = []
    for title, keys in OBJECTIVE_PANELS:
        names = [k for key in keys for k in
                 ([n for n in logged if n.startswith(key[:-1])] if key.endswith("*") else [key] if key in logged
                  else [])]
        lines = [(name, *_series(metrics, name)) for name in names]
        if any(xs for _, xs, _ in lines):
            panels.append((title, lines, False))
    return panels


def plot_run(run_dir: Path, out: Path | None = None) -> dict[str, Any]:
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise InputError(f"{run_dir}: no metrics.jsonl (not a training run directory, or no step finished yet)")
    rows, evals = _read(metrics_path), _read(run_dir / "eval.jsonl")
    metrics = [r for r in rows if "task" not in r]  # a step's row; a task row carries the --eval-task metric
    tasks = [r for r in rows if "task" in r]
    if not metrics:
        raise InputError(f"{metrics_path}: empty; no step has finished yet")
    out = out or run_dir / "curves.png"
    if out.exists():  # a previous plot is replaced, never another file given as --out (issue 28 item 1)
        check_replaceable_file(out, "a PNG image", lambda head: head.startswith(PNG_MAGIC))
    check_creatable(out.parent if out.is_file() else out, "--out")  # a file replaced: its folder  # under /proc or read-only: exit 2 naming it, not an OSError (issue 38 item 8)
    panels = [
        ("loss", [("train loss", *_series(metrics, "loss")), ("eval loss", *_series(evals, "loss"))], False),
        ("learning rate", [("lr", *_series(metrics, "lr"))], False),
        ("grad norm (global L2, before clipping)", [("grad norm", *_series(metrics, "grad_norm"))], True),
        ("tokens / s", [("tok/s", *_series(metrics, "tok_s"))], False),
    ]
    panels += _objective_panels(metrics)
    task_lines = _task_lines(tasks)
    if task_lines:
        title = "task metrics (step 0 = the start)" if len(task_lines) > 1 else task_lines[0][0]
        panels.append((title, task_lines, False))
    marked = {"eval loss", *(label for label, _, _ in task_lines)}  # evals: points, not a line through steps
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        backend = "numpy"
        _draw_png(panels, out)
    else:
        backend = "matplotlib"
        rows_of_panels = (len(panels) + 1) // 2
        fig, axes = plt.subplots(rows_of_panels, 2, figsize=(11, 3.5 * rows_of_panels))
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        for ax, (title, lines, logy) in zip(axes.flat, panels):
            for label, xs, ys in lines:
                if xs:
                    ax.plot(xs, ys, marker="o" if label in marked else None, ms=3, lw=1.2, label=label)
            ax.set_title(title)
            ax.set_xlabel("step")
            if logy and any(y > 0 for _, _, ys in lines for y in ys):
                ax.set_yscale("log")
            if len(lines) > 1:
                ax.legend()
            ax.grid(alpha=0.3)
        fig.suptitle(str(run_dir))
        fig.tight_layout()
        atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))  # never a half-written image
        plt.close(fig)
    last_eval = evals[-1]["loss"] if evals else None
    return {"out": str(out), "backend": backend, "steps": len(metrics), "evals": len(evals), "task_evals": len(tasks),
            "first_loss": metrics[0]["loss"], "last_loss": metrics[-1]["loss"], "last_eval_loss": last_eval}


def _draw_png(panels: list, out: Path, w: int = 400, h: int = 250) -> None:
    """The panels (two per row) of polylines on a white canvas, written as an RGB PNG."""
    rows = (len(panels) + 1) // 2
    img = np.full((rows * h, 2 * w, 3), 255, dtype=np.uint8)
    colors = [(31, 119, 180), (255, 127, 14)]
    for k, (_, lines, logy) in enumerate(panels):
        oy, ox = (k // 2) * h, (k % 2) * w
        img[oy + h - 20, ox + 20:ox + w - 10] = 0  # x axis
        img[oy + 10:oy + h - 20, ox + 20] = 0  # y axis
        pts = [(x, (math.log10(y) if logy and y > 0 else y)) for _, xs, ys in lines for x, y in zip(xs, ys)]
        if not pts:
            continue
        x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
        y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
        for c, (_, xs, ys) in enumerate(lines):
            prev = None
            for x, y in zip(xs, ys):
                y = math.log10(y) if logy and y > 0 else y
                px = ox + 22 + int((x - x0) / max(x1 - x0, 1e-12) * (w - 40))
                py = oy + h - 22 - int((y - y0) / max(y1 - y0, 1e-12) * (h - 40))
                if prev is not None:
                    n = max(abs(px - prev[0]), abs(py - prev[1]), 1)
                    for t in range(n + 1):
                        img[prev[1] + (py - prev[1]) * t // n, prev[0] + (px - prev[0]) * t // n] = colors[c % 2]
                prev = (px, py)
    raw = b"".join(b"\x00" + row.tobytes() for row in img)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (PNG_MAGIC + chunk(b"IHDR", struct.pack(">IIBBBBB", 2 * w, rows * h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    atomic_write(out, png)
