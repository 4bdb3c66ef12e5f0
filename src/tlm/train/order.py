"""Which items a step trains on, when a source's items are whole units (packed windows of
conversations, preference pairs): a new order each pass over them, drawn from (seed, pass),
so any step's items are found again after a resume, and the same on every process.

Given the items' lengths, a pass is grouped by length (as transformers' Trainer does with
`group_by_length`): its random order is cut into runs of GROUP steps' items, each run
sorted by length and cut into the steps' batches, and the batches of the pass shuffled, so
the items of a step are of similar length (little padding) while which step comes when
stays random."""

from __future__ import annotations

import numpy as np

GROUP = 50  # steps whose items are sorted together by length


class PassOrder:
    """`count` items taken `per_step` a step, pass after pass, each pass its own order
    (grouped by `lengths`, the items' lengths, where given)."""

    def __init__(
        self, count: int, per_step: int, seed: int, lengths: list[int] | None = None
    ) -> None:
        self.count, self.per_step, self.seed = count, per_step, seed
        self.lengths = None if lengths is None else np.asarray(lengths)
        self._order: tuple[int, np.ndarray] | None = None  # (pass, its order)

    def step(self, step: int) -> np.ndarray:
        """The item indices of step `step` (the whole batch, every process's share)."""
        first, picked = step * self.per_step, []
        for k in range(first, first + self.per_step):
            e = k // self.count
            if self._order is None or self._order[0] != e:
                generator = np.random.default_rng([self.seed, e])
                order = generator.permutation(self.count)
                self._order = (e, self._grouped(order, e * self.count, generator))
            picked.append(self._order[1][k % self.count])
        return np.asarray(picked)

    def _grouped(self, order: np.ndarray, start: int, generator) -> np.ndarray:
        """A pass's `order` (its first item the `start`th of all) grouped by length: in
        batches at the steps' bounds, each of items of similar length, in random order."""
        head, B = (-start) % self.per_step, self.per_step  # head: the step begun before
        if self.lengths is None or head + B > len(order):
            return order
        for a in range(head, len(order), GROUP * B):
            part = order[a : a + GROUP * B]
            order[a : a + GROUP * B] = part[np.argsort(self.lengths[part], kind="stable")]
        full = (len(order) - head) // B
        batches = order[head : head + full * B].reshape(full, B)[generator.permutation(full)]
        return np.concatenate([order[:head], batches.ravel(), order[head + full * B :]])
