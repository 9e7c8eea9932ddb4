"""The task metric of a run (`--eval-task`): when it is measured, what is kept of each measurement, the
paired comparison with step 0 that GUARD-TASK-REGRESSION judges, and `--keep-best task`.

The Trainer owns one `TaskTracker` when the command built a task evaluator (evaluate/in_loop.py). Each
measurement runs every rank on its share of the problems, gathers the records on every rank (so every rank
takes the same decision), and rank 0 writes RUN/task_eval/step-NNNNNNN.jsonl (one line per problem) and a
row `{"step", "task", "metric", <metric>, "passed", "problems", "truncated", "seconds"}` in metrics.jsonl.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..evaluate.paired import describe_change, paired_change
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
        self.evaluator, self.ctx, self.run_dir = evaluator, ctx, Path(run_dir)
        self.every, self.steps, self.policy, self.keep_best = every, steps, policy, keep_best
        self.write_row, self.message = write_row, message
        self.results: dict[int, dict[str, bool]] = {}  # step -> {task id: passed}
        self.scores: dict[int, dict[str, Any]] = {}  # step -> the evaluator's summary
        self.warnings: list[dict[str, Any]] = []
        self.best_step: int | None = None
        self._best_weights: list[torch.Tensor] | None = None  # --keep-best task: CPU copies of the best step's

    def due(self, step: int) -> bool:
        return step == 0 or step == self.steps or bool(self.every and step % self.every == 0)

    # ---- one measurement --------------------------------------------------------------------------
    def evaluate(self, step: int, model: torch.nn.Module, params: list[torch.nn.Parameter],
                 find_checkpoint: Callable[[int], Path | None]) -> dict[str, Any]:
        t0 = time.perf_counter()
        records = self._run(step, model)
        if self.ctx.active:  # every rank gets every record: the guard's decision is the same everywhere
            records = [r for part in self.ctx.all_gather_object(records) for r in part]
        order = {tid: i for i, tid in enumerate(self.evaluator.task_ids)}
        records.sort(key=lambda r: order[r["task_id"]])
        score = {**self.evaluator.summarize(records), "seconds": round(time.perf_counter() - t0, 3)}
        self.results[step] = {r["task_id"]: bool(r["passed"]) for r in records}
        self.scores[step] = score
        if self.ctx.is_main:
            (self.run_dir / TASK_DIR).mkdir(exist_ok=True)
            atomic_write(self.run_dir / TASK_DIR / f"{step_dir_name(step)}.jsonl",
                         "".join(json.dumps(r, default=str) + "\n" for r in records))
        metric = self.evaluator.metric
        self.write_row({"step": step, "task": self.evaluator.name, "metric": metric, **score})
        self.message(f"step {step}: {self.evaluator.name} {metric} {score[metric]:.4f} ({score['passed']}/"
                     f"{score['problems']}, {score['seconds']:.0f} s)")
        note = self.evaluator.truncation_note(score)
        if note:
            self.message(f"step {step}: {note}")
        self._note_best(step, params)
        if step > 0 and 0 in self.results:
            change = paired_change(self.results[0], self.results[step])
            self.message(describe_change(change, self.evaluator.name, 0, step))
            best_ckpt = find_checkpoint(self.best_step) if self.best_step else None
            hint = f"entrenar export gguf {best_ckpt} OUT.gguf (or --resume {best_ckpt})" if best_ckpt else ""
            warning = guards.task_regression(change, self.evaluator.name, step, self.policy,
                                             (self.best_step, self.scores[self.best_step]["passed"], best_ckpt), hint)
            if warning is not None:
                self.message(warning)
                self.warnings.append({"guard": "GUARD-TASK-REGRESSION", "step": step,
                                      "p_value": change["p_value"], "lost": change["lost"]})
        return score

    def _run(self, step: int, model: torch.nn.Module) -> list[dict[str, Any]]:
        """This rank's records of the task at `step`, with progress lines (and an ETA) as `eval --task` prints them;
        rank 0 appends each finished record to task_eval/step-N.partial.jsonl, so a Ctrl-C says what was kept."""
        name, partial = self.evaluator.name, self.run_dir / TASK_DIR / f"{step_dir_name(step)}.partial.jsonl"
        kept = [0]

        def log(line: str) -> None:
            self.message(f"step {step}: {name} {line}")

        if not self.ctx.is_main:
            return self.evaluator.run(model, self.ctx.rank, self.ctx.world, log=log)
        partial.parent.mkdir(exist_ok=True)
        with open(partial, "w", encoding="utf-8") as f:
            def keep(record: dict[str, Any]) -> None:
                f.write(json.dumps(record, default=str) + "\n")
                f.flush()
                kept[0] += 1
            try:
                records = self.evaluator.run(model, self.ctx.rank, self.ctx.world, log=log, on_record=keep)
            except KeyboardInterrupt:
                self.message(f"step {step}: {name} eval interrupted: the {kept[0]} problems it finished"
                             + (" (rank 0's share)" if self.ctx.active else "") + f" are in {partial}; the run "
                             f"resumed with --resume runs this eval again")
                raise
        partial.unlink()  # the whole eval is written next (step-N.jsonl)
        return records

    def _note_best(self, step: int, params: list[torch.nn.Parameter]) -> None:
        """The best step so far: most problems passed, the later step on ties (more training, same score)."""
        passed = self.scores[step]["passed"]
        if self.best_step is not None and passed < self.scores[self.best_step]["passed"]:
            return
        self.best_step = step
        if self.keep_best:
            self._best_weights = [_local(p).detach().to("cpu", copy=True) for p in params]

    # ---- the end of the run -----------------------------------------------------------------------
    def restore_best(self, params: list[torch.nn.Parameter]) -> int | None:
        """--keep-best task: put the best step's weights back before final/ is written; returns that step
        (None when the last step is the best, or the best was measured before a resume: not in memory)."""
        if not self.keep_best or self.best_step is None or self.best_step == max(self.results):
            return None
        if self._best_weights is None:
            self.message(f"--keep-best task: the best task result (step {self.best_step}) was measured before "
                         f"this process resumed the run; its weights are not in memory, final/ holds the last "
                         f"step's")
            return None
        with torch.no_grad():
            for p, saved in zip(params, self._best_weights):
                _local(p).copy_(saved.to(_local(p).device))
        self.message(f"--keep-best task: final/ holds the weights of step {self.best_step} "
                     f"({self.scores[self.best_step]['passed']}/{self.scores[self.best_step]['problems']} passed), "
                     f"not the last step's")
        return self.best_step

    def summary(self, final_step_kept: int | None) -> dict[str, Any]:
        """The run's task result: step 0, the end and the best, the change from step 0 to the end (problems
        gained and lost, exact McNemar p), the guard's warnings, which step final/ holds."""
        if not self.results:
            return {"task": self.evaluator.name}
        last = max(self.results)
        out: dict[str, Any] = {"task": self.evaluator.name, "metric": self.evaluator.metric,
                               "steps": {str(s): self.scores[s] for s in sorted(self.scores)},
                               "start": self.scores.get(0), "end": self.scores[last], "end_step": last,
                               "best": {"step": self.best_step, **self.scores[self.best_step]},
                               "final_holds_step": final_step_kept if final_step_kept is not None else last,
                               "warnings": self.warnings}
        if 0 in self.results and last > 0:
            out["change"] = paired_change(self.results[0], self.results[last])
            out["line"] = describe_change(out["change"], self.evaluator.name, 0, last)
        return out

    # ---- resume -------------------------------------------------------------------------------------
    def state_dict(self, step: int) -> dict[str, Any]:
        return {"results": {str(s): r for s, r in self.results.items() if s <= step},
                "scores": {str(s): v for s, v in self.scores.items() if s <= step},
                "warnings": [w for w in self.warnings if w["step"] <= step]}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.results = {int(s): dict(r) for s, r in st.get("results", {}).items()}
        self.scores = {int(s): v for s, v in st.get("scores", {}).items()}
        self.warnings = list(st.get("warnings", []))
        if self.scores:  # the best of the measurements so far (its weights are not kept across a resume)
            self.best_step = max(sorted(self.scores), key=lambda s: (self.scores[s]["passed"], s))


def checkpoint_of_step(root: Path, step: int) -> Path | None:
    """The complete checkpoint of `step` under `root`, if one is on disk."""
    return next((d for d in complete_checkpoints(root) if d.name == step_dir_name(step)), None)
