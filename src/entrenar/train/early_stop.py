"""Early stopping on the eval loss (`--early-stop PATIENCE`).

After each scheduled eval the run stops when the last PATIENCE evals brought no new lowest eval loss: the
lowest is the first eval at the minimum (step 0's, the base, included), and every eval after it counts, so a
run whose eval loss only ties its best stops too. Decided from `Trainer.eval_losses` (restored on resume with
the trainer state), on the eval loss every rank holds reduced: every rank stops at the same step. The stop step
is then checkpointed and final/ written from its weights, as at the last step; the summary's `early_stop`
says why and where.
"""

from __future__ import annotations

import math
from typing import Any


def early_stop(eval_losses: dict[int, float], patience: int) -> dict[str, Any] | None:
    """{"step", "patience", "best_step", "best_eval_loss", "evals_since_best", "reason"} when the run must stop
    after its last eval (the largest step of `eval_losses`), else None. patience 0: never."""
    if patience <= 0 or not eval_losses:
        return None
    steps = sorted(eval_losses)
    finite = [s for s in steps if math.isfinite(eval_losses[s])]
    if not finite:
        return None
    best = min(finite, key=lambda s: (eval_losses[s], s))  # the first step at the minimum
    since = sum(1 for s in steps if s > best)
    if since < patience:
        return None
    last = steps[-1]
    return {"step": last, "patience": patience, "best_step": best, "best_eval_loss": eval_losses[best],
            "evals_since_best": since,
            "reason": f"--early-stop {patience}: {since} evals without a new lowest eval loss (lowest "
                      f"{eval_losses[best]:.4f} at step {best}); stopped after step {last}"}
