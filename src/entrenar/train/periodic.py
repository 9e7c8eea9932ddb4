"""--save-every-minutes: a checkpoint by wall-clock time, so a long run always has a recent one to resume from
(`--save-every 0`, the default, checkpoints only at the end: an interrupted run kept nothing).

The clock starts when the Trainer is built and restarts at every checkpoint (whatever made it); a run shorter
than the period writes exactly the files it wrote without this. Under torchrun every rank must take the same
decision (a checkpoint is a collective): the ranks agree through one all-reduce (any rank past the period), made
every DIST_CHECK_EVERY steps only, so the step keeps its throughput (a save comes at most that many steps late).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

DEFAULT_SAVE_EVERY_MINUTES = 30.0
DIST_CHECK_EVERY = 16  # steps between the ranks' agreements under torchrun


class TimedSaves:
    """Whether --save-every-minutes asks for a checkpoint after this step."""

    def __init__(self, minutes: float, ctx: Any = None, clock: Callable[[], float] = time.monotonic):
        self.period_s = minutes * 60.0 if minutes and math.isfinite(minutes) else 0.0
        self.ctx, self.clock = ctx, clock
        self.last = clock()
        self.asked = 0  # every rank asks after the same steps: the same count everywhere

    def due(self) -> bool:
        if self.period_s <= 0:
            return False
        self.asked += 1
        distributed = self.ctx is not None and self.ctx.active
        if distributed and self.asked % DIST_CHECK_EVERY:
            return False
        late = self.clock() - self.last >= self.period_s
        if distributed:
            late = self.ctx.any_true(late)  # the same answer on every rank
        return late

    def saved(self) -> None:
        """A checkpoint was just started: the next one is a whole period away."""
        self.last = self.clock()


__all__ = ["DEFAULT_SAVE_EVERY_MINUTES", "TimedSaves"]
