"""Early stopping on the eval loss (`--early-stop PATIENCE`).

After each scheduled eval the run stops when the last PATIENCE evals brought no new lowest eval loss: the
lowest is the first eval at the minimum (step 0's, the base, included), and every eval after it counts, so a
run whose eval loss only ties its best stops too. Decided from `Trainer.eval_losses` (restored on resume with
the trainer state), on the eval loss every rank holds reduced: every rank stops at the same step. The stop step
is then checkpointed and final/ written from its weights, as at the last step (or, with `--keep-best eval`,
from those of the lowest eval: `BestEvalWeights`); the summary's `early_stop` says why and where.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def early_stop(eval_losses: dict[int, float], patience: int) -> dict[str, Any] | None:
    """{"step", "patience", "best_step", "best_eval_loss", "evals_since_best", "reason"} when the run must stop
    after its last eval (the largest step of `eval_losses`), else None. patience 0: never."""
    if patience <= 0 or not eval_losses:
        return None
    steps = sorted(eval_losses)
    best = early_stop_best(eval_losses)  # the first step at the minimum
    if best is None:
        return None
    since = sum(1 for s in steps if s > best)
    if since < patience:
        return None
    last = steps[-1]
    return {"step": last, "patience": patience, "best_step": best, "best_eval_loss": eval_losses[best],
            "evals_since_best": since,
            "reason": f"--early-stop {patience}: {since} evals without a new lowest eval loss (lowest "
                      f"{eval_losses[best]:.4f} at step {best}); stopped after step {last}"}


class BestEvalWeights:
    """`--keep-best eval`: CPU copies of the trainable weights (this rank's shards under FSDP2) after the eval with
    the lowest eval loss (the first at the minimum, as --early-stop counts), put back before final/ is written."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.loss: float | None = None
        self._weights: list[torch.Tensor] | None = None

    def note(self, step: int, loss: float, params: list[torch.nn.Parameter]) -> None:
        """After the eval of `step`: a new lowest eval loss keeps these weights."""
        if not math.isfinite(loss) or (self.loss is not None and loss >= self.loss):
            return
        self.step, self.loss = step, loss
        self._weights = [local_tensor(p).detach().to("cpu", copy=True) for p in params]

    def restore(self, params: list[torch.nn.Parameter], last_step: int, eval_losses: dict[int, float],
                say: Callable[[str], None]) -> int | None:
        """Before final/: the best eval's weights put back; returns its step (None: the last step's weights stay,
        being the best, or the best was measured before this process resumed the run)."""
        best = early_stop_best(eval_losses)
        if best is None or best == last_step:
            return None
        if self._weights is None or self.step != best:
            say(f"--keep-best eval: the lowest eval loss (step {best}) was measured before this process resumed the "
                f"run; its weights are not in memory, final/ holds the last step's")
            return None
        with torch.no_grad():
            for p, saved in zip(params, self._weights, strict=True):
                local_tensor(p).copy_(saved.to(local_tensor(p).device))
        say(f"--keep-best eval: final/ holds the weights of step {best} (eval loss {self.loss:.4f}), not the last "
            f"step's")
        return best


def early_stop_best(eval_losses: dict[int, float]) -> int | None:
    """The step of the first lowest finite eval loss, or None."""
    finite = [s for s in sorted(eval_losses) if math.isfinite(eval_losses[s])]
    return min(finite, key=lambda s: (eval_losses[s], s)) if finite else None


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own values on this rank (a DTensor's local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p
