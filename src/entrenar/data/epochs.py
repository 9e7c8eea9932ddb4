"""The one epoch/state mechanism of the training loaders (PretrainLoader, SFTLoader).

A loader draws items from an endless sequence of epochs; epoch e visits all n items once in
the order ``numpy.random.default_rng([seed, e]).permutation(n)``. The whole state is
(seed, epoch, position), so resuming from a checkpoint continues with exactly the item that
would have come next, and any process can recompute any epoch's order without history.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError

RNG_RECIPE = "numpy.random.default_rng([seed, epoch]).permutation"


class EpochCursor:
    """Position in the endless epoch sequence over ``n`` items."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = int(n), int(seed)
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of epoch ``epoch`` (cached for the current one)."""
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._order_epoch = epoch
        return self._order

    def peek(self) -> int:
        """The index of the next item, without consuming it."""
        return int(self.order(self.epoch)[self.position])

    def advance(self) -> None:
        self.position += 1
        if self.position == self.n:
            self.epoch, self.position = self.epoch + 1, 0

    def take(self) -> int:
        item = self.peek()
        self.advance()
        return item

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rng": RNG_RECIPE}

    def load_state_dict(self, sd: dict[str, Any], what: str) -> None:
        """Restore (seed, epoch, position); InputError naming ``what`` when they do not fit n items."""
        try:
            epoch, position, seed = int(sd["epoch"]), int(sd["position"]), int(sd["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"cannot resume the {what} loader: its saved state lacks {e}") from None
        if not 0 <= position < self.n or epoch < 0:
            raise InputError(f"cannot resume the {what} loader: position {position} / epoch {epoch} out of "
                             f"range for {self.n} items")
        self.seed, self.epoch, self.position = seed, epoch, position
        self._order_epoch = -1
