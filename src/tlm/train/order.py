"""Which items a step trains on, when a source's items are whole units (packed windows of
conversations, preference pairs): a new order each pass over them, drawn from (seed, pass),
so any step's items are found again after a resume, and the same on every process."""

from __future__ import annotations

import numpy as np


class PassOrder:
    """`count` items taken `per_step` a step, pass after pass, each pass its own order."""

    def __init__(self, count: int, per_step: int, seed: int) -> None:
        self.count, self.per_step, self.seed = count, per_step, seed
        self._order: tuple[int, np.ndarray] | None = None  # (pass, its order)

    def step(self, step: int) -> np.ndarray:
        """The item indices of step `step` (the whole batch, every process's share)."""
        first, picked = step * self.per_step, []
        for k in range(first, first + self.per_step):
            e = k // self.count
            if self._order is None or self._order[0] != e:
                generator = np.random.default_rng([self.seed, e])
                self._order = (e, generator.permutation(self.count))
            picked.append(self._order[1][k % self.count])
        return np.asarray(picked)
