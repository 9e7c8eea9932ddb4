"""--save-every-minutes: a checkpoint by wall-clock time, so a long run always has a recent one to resume from
(`--save-every 0`, the default, checkpoints only at the end: an interrupted run kept nothing).

The clock starts when the Trainer is built and restarts at every checkpoint (whatever made it); a run shorter
than the period writes exactly the files it wrote without this. Under torchrun every rank must take the same
decision (a checkpoint is a collective): the ranks agree through one all-reduce (any rank past the period).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

DEFAULT_SAVE_EVERY_MINUTES = 30.0


class TimedSaves:
    """Whether --save-every-minutes asks for a checkpoint after this step."""

    def __init__(self, minutes: float, ctx: Any = None, clock: Callable[[], float] = time.monotonic):
        self.period_s = minutes * 60.0 if minutes and math.isfinite(minutes) else 0.0
        self.ctx, self.clock = ctx, clock
        self.last = clock()

    def due(self) -> bool:
        if self.period_s <= 0:
            return False
        late = self.clock() - self.last >= self.period_s
        if self.ctx is not None and self.ctx.active:
            late = self.ctx.any_true(late)  # the same answer on every rank
        return late

    def saved(self) -> None:
        """A checkpoint was just started: the next one is a whole period away."""
        self.last = self.clock()


__all__ = ["DEFAULT_SAVE_EVERY_MINUTES", "TimedSaves"]
