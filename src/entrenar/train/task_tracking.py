"""The task panel of a run (`--eval-task` targets, `--retain-task` retained tasks): when it is measured, what
is kept of each measurement, the per-unit paired comparison with step 0 that GUARD-TASK-REGRESSION judges, and
`--keep-best task`.

The Trainer owns one `TaskTracker` when the command built a task panel (evaluate/panel.py). Each measurement runs
every task of the panel on every rank's share of its problems, gathers the records on every rank (so every rank
takes the same decision), and rank 0 writes RUN/task_eval/step-NNNNNNN.jsonl (one line per problem, with its
`task`, `unit` and `role`) and one row per unit `{"step", "task": UNIT, "role", "metric", <metric>, "passed",
"problems", "truncated", "seconds"}` in metrics.jsonl. A unit is a task, or one category of a BFCL task: each is
tested on its own problems (exact McNemar against step 0), Holm-adjusted over the panel's units.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..evaluate.paired import describe_change, panel_changes
from ..evaluate.panel import TaskPanel, units
from ..fileio import atomic_write
from . import guards
from .checkpoint import complete_checkpoints, step_dir_name
from .distributed import DistContext

TASK_DIR = "task_eval"


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own values on this rank (a DTensor's local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


class TaskTracker:
    def __init__(self, evaluator: Any, ctx: DistContext, run_dir: Path, every: int, steps: int, policy: str,
                 keep_best: bool, write_row: Callable[[dict], None], message: Callable[[str], None]):
        self.panel = TaskPanel.of(evaluator)
        self.ctx, self.run_dir = ctx, Path(run_dir)
        self.every, self.steps, self.policy, self.keep_best = every, steps, policy, keep_best
        self.write_row, self.message = write_row, message
        self.results: dict[int, dict[str, dict[str, bool]]] = {}  # step -> {unit: {task id: passed}}
        self.scores: dict[int, dict[str, Any]] = {}  # step -> {unit: its score}
        self.roles: dict[str, str] = {}  # unit -> "target" | "retain"
        self.tasks: dict[str, tuple[str, str]] = {}  # unit -> (its task's name, the task's metric)
        self.warnings: list[dict[str, Any]] = []
        self.best_step: int | None = None
        self._best_weights: list[torch.Tensor] | None = None  # --keep-best task: CPU copies of the best step's
        self._fallback: tuple[int, list[torch.Tensor] | None] | None = None  # the least bad step, none eligible
        self._fallback_key: tuple[int, int, int] = (0, 0, 0)
        self._trained_step_kept_all = False  # a trained step (> 0) with no retained drop: no fallback then

    def due(self, step: int) -> bool:
        return step == 0 or step == self.steps or bool(self.every and step % self.every == 0)

    # ---- one measurement --------------------------------------------------------------------------
    def _measure(self, member: Any, model: torch.nn.Module, step: int) -> tuple[list[dict], float]:
        ev = member.evaluator
        t0 = time.perf_counter()
        records = self._run(step, model, ev)
        if self.ctx.active:  # every rank gets every record: the guard's decision is the same everywhere
            records = [r for part in self.ctx.all_gather_object(records) for r in part]
        order = {tid: i for i, tid in enumerate(ev.task_ids)}
        records.sort(key=lambda r: order[r["task_id"]])
        return records, round(time.perf_counter() - t0, 3)

    def evaluate(self, step: int, model: torch.nn.Module, params: list[torch.nn.Parameter],
                 find_checkpoint: Callable[[int], Path | None]) -> dict[str, Any]:
        step_results: dict[str, dict[str, bool]] = {}
        step_scores: dict[str, Any] = {}
        lines: list[str] = []
        if self.ctx.is_main and self._partial(step).exists():
            self._partial(step).unlink()  # an interrupted attempt's: this eval starts again
        for member in self.panel.members:
            ev = member.evaluator
            records, seconds = self._measure(member, model, step)
            for unit, verdicts in units(ev, records).items():
                unit_records = [r for r in records if r["task_id"] in verdicts]
                score = {**ev.summarize(unit_records), "seconds": seconds}
                score.pop("categories", None)  # a BFCL unit is one category already
                step_results[unit], step_scores[unit] = verdicts, score
                self.roles[unit], self.tasks[unit] = member.role, (ev.name, ev.metric)
                self.write_row({"step": step, "task": unit, "role": member.role, "metric": ev.metric, **score})
                self.message(f"step {step}: {unit} ({member.role}) {ev.metric} {score[ev.metric]:.4f} "
                             f"({score['passed']}/{score['problems']}, {seconds:.0f} s)")
                note = ev.truncation_note(score)
                if note:
                    self.message(f"step {step}: {unit}: {note}")
                for r in unit_records:
                    lines.append(json.dumps({**r, "task": ev.name, "unit": unit, "role": member.role}, default=str))
        self.results[step], self.scores[step] = step_results, step_scores
        if self.ctx.is_main:
            (self.run_dir / TASK_DIR).mkdir(exist_ok=True)
            atomic_write(self.run_dir / TASK_DIR / f"{step_dir_name(step)}.jsonl", "".join(x + "\n" for x in lines))
            self._partial(step).unlink(missing_ok=True)  # the whole eval is written (step-N.jsonl)
        changes = self.changes(step)
        for unit, change in changes.items():
            self.message(describe_change(change, unit, 0, step))
        self._note_best(step, params, changes)
        regressions = [(u, c) for u, c in changes.items() if c["verdict"] == "regressed"]
        if regressions:
            best_ckpt = find_checkpoint(self.best_step) if self.best_step else None
            hint = f"entrenar export gguf {best_ckpt} OUT.gguf (or --resume {best_ckpt})" if best_ckpt else ""
            warning = guards.task_regression(regressions, step, self.policy,
                                             (self.best_step or 0, self._targets_text(self.best_step or 0), best_ckpt),
                                             hint)
            self.message(warning)
            for unit, change in regressions:
                self.warnings.append({"guard": "GUARD-TASK-REGRESSION", "step": step, "task": unit,
                                      "role": self.roles[unit], "p_value": change["p_value"],
                                      "p_holm": change["p_holm"], "lost": change["lost"]})
        return step_scores

    def changes(self, step: int) -> dict[str, dict[str, Any]]:
        """Each unit's paired change from step 0 to `step` (Holm over the panel); {} before step 0 is known."""
        if step == 0 or 0 not in self.results or step not in self.results:
            return {}
        return panel_changes(self.results[0], self.results[step])

    # ---- which step is best -----------------------------------------------------------------------
    def _targets(self, step: int) -> tuple[int, int]:
        """(problems passed, problems) over the target units at `step` (every unit when no target measured)."""
        sc = self.scores[step]
        chosen = [u for u in sc if self.roles.get(u) == "target"] or list(sc)
        return sum(sc[u]["passed"] for u in chosen), sum(sc[u]["problems"] for u in chosen)

    def _targets_text(self, step: int) -> str:
        passed, n = self._targets(step)
        return f"targets {passed}/{n}"

    def _retained_drops(self, changes: dict[str, dict[str, Any]]) -> list[str]:
        return [u for u, c in changes.items() if self.roles.get(u) == "retain" and c["verdict"] == "regressed"]

    def _retained_lost(self, changes: dict[str, dict[str, Any]]) -> int:
        return sum(len(c["lost"]) - len(c["gained"]) for u, c in changes.items() if self.roles.get(u) == "retain")

    def _run(self, step: int, model: torch.nn.Module, evaluator: Any) -> list[dict[str, Any]]:
        """This rank's records of the task at `step`, with progress lines (and an ETA) as `eval --task` prints them;
        rank 0 appends each finished record to task_eval/step-N.partial.jsonl, so a Ctrl-C says what was kept."""
        name, partial = evaluator.name, self._partial(step)
        kept = [0]

        def log(line: str) -> None:
            self.message(f"step {step}: {name} {line}")

        if not self.ctx.is_main:
            return evaluator.run(model, self.ctx.rank, self.ctx.world, log=log)
        partial.parent.mkdir(exist_ok=True)
        with open(partial, "a", encoding="utf-8") as f:  # the panel's tasks one after another
            def keep(record: dict[str, Any]) -> None:
                f.write(json.dumps(record, default=str) + "\n")
                f.flush()
                kept[0] += 1
            try:
                records = evaluator.run(model, self.ctx.rank, self.ctx.world, log=log, on_record=keep)
            except KeyboardInterrupt:
                self.message(f"step {step}: {name} eval interrupted: the {kept[0]} problems it finished"
                             + (" (rank 0's share)" if self.ctx.active else "") + f" are in {partial}; the run "
                             f"resumed with --resume runs this eval again")
                raise
        return records

    def _partial(self, step: int) -> Path:
        return self.run_dir / TASK_DIR / f"{step_dir_name(step)}.partial.jsonl"

    def _note_best(self, step: int, params: list[torch.nn.Parameter], changes: dict[str, dict[str, Any]]) -> None:
        """The best step so far: the most target problems passed among the steps where no retained unit
        dropped significantly (the later step on ties: more training, same score). A step with a retained drop
        is never best; the least bad of those (fewest retained problems lost net, then the best targets) is
        kept aside in case no trained step qualifies."""
        if self._retained_drops(changes):
            key = (-self._retained_lost(changes), self._targets(step)[0], step)
            if self._fallback is None or key >= self._fallback_key:
                self._fallback_key = key
                self._fallback = (step, [_local(p).detach().to("cpu", copy=True) for p in params]
                                  if self.keep_best else None)
            return
        if step > 0:
            self._trained_step_kept_all = True
        if self.best_step is not None and self._targets(step)[0] < self._targets(self.best_step)[0]:
            return
        self.best_step = step
        if self.keep_best:
            self._best_weights = [_local(p).detach().to("cpu", copy=True) for p in params]

    # ---- the end of the run -----------------------------------------------------------------------
    def _no_step_qualified(self) -> bool:
        """No trained step kept every retained task (only the base qualified): --keep-best task falls back to the
        least bad trained step. When one did, the best qualifying step is kept, the base included."""
        return (self.best_step == 0 and max(self.results) > 0 and self._fallback is not None
                and not self._trained_step_kept_all)

    def restore_best(self, params: list[torch.nn.Parameter]) -> int | None:
        """--keep-best task: put the best step's weights back before final/ is written; returns that step
        (None when the last step is the best, or the best was measured before a resume: not in memory)."""
        if not self.keep_best or self.best_step is None:
            return None
        last = max(self.results)
        if self._no_step_qualified():
            step, weights = self._fallback  # no trained step kept every retained task: the least bad one
            self.message(f"--keep-best task: no trained step kept every retained task; final/ holds step {step}, "
                         f"the least bad (its retained drops: {', '.join(self._retained_drops(self.changes(step)))})")
            if step == last:
                return None
            return self._copy_back(params, weights, step)
        if self.best_step == last:
            return None
        return self._copy_back(params, self._best_weights, self.best_step)

    def _copy_back(self, params: list[torch.nn.Parameter], weights: list[torch.Tensor] | None, step: int) -> int | None:
        if weights is None:
            self.message(f"--keep-best task: the chosen step {step} was measured before this process resumed the "
                         f"run; its weights are not in memory, final/ holds the last step's")
            return None
        with torch.no_grad():
            for p, saved in zip(params, weights):
                _local(p).copy_(saved.to(_local(p).device))
        self.message(f"--keep-best task: final/ holds the weights of step {step} ({self._targets_text(step)}), "
                     f"not the last step's")
        return step

    def keep_best_choice(self) -> dict[str, Any]:
        """Which step --keep-best task chose and why (also reported with --keep-best last)."""
        if self._no_step_qualified():
            step = self._fallback[0]
            return {"step": step, "eligible": False,
                    "reason": f"no trained step kept every retained task; step {step} is the least bad "
                              f"(retained drops: {', '.join(self._retained_drops(self.changes(step)))})"}
        return {"step": self.best_step, "eligible": True,
                "reason": "the most target problems passed with no significant drop of a retained task"}

    def summary(self, final_step_kept: int | None) -> dict[str, Any]:
        """The run's task panel: per unit (a task or one BFCL category) step 0, the end and its change from
        step 0 (problems gained and lost, exact McNemar p, Holm over the panel), the best step, the guard's
        warnings, which step final/ holds."""
        if not self.results:
            return {"tasks": [m.evaluator.name for m in self.panel.members], "units": {}, "warnings": []}
        last = max(self.results)
        changes = self.changes(last)
        per_unit: dict[str, Any] = {}
        for unit in self.scores[last]:
            task, metric = self.tasks[unit]
            entry: dict[str, Any] = {"task": task, "role": self.roles[unit], "metric": metric,
                                     "start": self.scores.get(0, {}).get(unit), "end": self.scores[last][unit]}
            if unit in changes:
                entry["change"] = changes[unit]
                entry["line"] = describe_change(changes[unit], unit, 0, last)
            per_unit[unit] = entry
        best = self.best_step if self.best_step is not None else last
        passed, n = self._targets(best)
        return {"tasks": [m.evaluator.name for m in self.panel.members],
                "targets": [m.evaluator.name for m in self.panel.members if m.role == "target"],
                "retained": [m.evaluator.name for m in self.panel.members if m.role == "retain"],
                "units": per_unit, "steps": {str(s): self.scores[s] for s in sorted(self.scores)}, "end_step": last,
                "best": {"step": best, "targets_passed": passed, "targets_problems": n},
                "keep_best": self.keep_best_choice(),
                "final_holds_step": final_step_kept if final_step_kept is not None else last,
                "warnings": self.warnings}

    # ---- resume -------------------------------------------------------------------------------------
    def _base_answers_from_step0(self) -> None:
        """The chat task's drift is measured against the base's answers: a resumed process reads them back from
        step 0's per-problem file."""
        path = self.run_dir / TASK_DIR / f"{step_dir_name(0)}.jsonl"
        takers = [m.evaluator for m in self.panel.members if hasattr(m.evaluator, "set_base_answers")]
        if takers and path.is_file():
            records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            for ev in takers:
                ev.set_base_answers([r for r in records if r.get("task") == ev.name])

    def state_dict(self, step: int) -> dict[str, Any]:
        return {"results": {str(s): r for s, r in self.results.items() if s <= step},
                "scores": {str(s): v for s, v in self.scores.items() if s <= step},
                "roles": self.roles, "tasks": {u: list(t) for u, t in self.tasks.items()},
                "warnings": [w for w in self.warnings if w["step"] <= step]}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        first = self.panel.members[0].evaluator.name
        # a checkpoint written before panels kept one task's {task id: passed} per step: that task is its unit
        self.results = {int(s): ({first: dict(v)} if any(isinstance(x, bool) for x in v.values())
                                 else {u: dict(r) for u, r in v.items()}) for s, v in st.get("results", {}).items()}
        self.scores = {int(s): (v if "roles" in st else {first: v}) for s, v in st.get("scores", {}).items()}
        self.roles = dict(st.get("roles", {first: "target"}))
        self.tasks = {u: tuple(t) for u, t in st.get("tasks", {}).items()}
        self.warnings = list(st.get("warnings", []))
        self._base_answers_from_step0()
        self.best_step = None
        for s in sorted(self.scores):  # the best of the measurements so far (weights are not kept across a resume)
            changes = self.changes(s)
            if s > 0 and not self._retained_drops(changes):
                self._trained_step_kept_all = True
            if not self._retained_drops(changes) and (
                    self.best_step is None or self._targets(s)[0] >= self._targets(self.best_step)[0]):
                self.best_step = s


def checkpoint_of_step(root: Path, step: int) -> Path | None:
    """The complete checkpoint of `step` under `root`, if one is on disk."""
    return next((d for d in complete_checkpoints(root) if d.name == step_dir_name(step)), None)
