"""How many threads a decoding step runs on, chosen by timing the steps.

A decoding step of a GPT-2-sized model is about a hundred parallel regions (a product, a
layer's attention), microseconds apart. Between them OpenMP's workers spin, waiting for
the next: on a quiet machine that is what keeps a step fast. When other processes want the
cores, a spinning worker holds a core that another needs, and a worker that was swapped out
stalls the step at the next region's end until it runs again. Measured on a 2-core host
with two busy processes beside it (int8 GPT-2, batch 1, docs/benchmarks-history.md): 2.1-73
tokens/s on two threads, 80-131 on one; quiet, two threads are 1.5x one. Which is faster
depends on the load at the moment, which no setting knows, so `Threads` measures it.

It keeps the steps on `most` threads (torch's setting when decoding began) and now and
then tries a few steps on the other count (one, or back to `most`): after its first few
steps, then every `every` steps, and at once when a step takes three times the fastest recent
one (the load changed). The count whose steps were faster by more than `margin` is kept.
A probe that changes nothing makes the next one wait twice as long (to 16 times `every`),
so a quiet machine spends well under 1% of its steps on one thread. A `Decoder` keeps its
`Threads` for as long as it decodes (the server's, for its lifetime). Steps are compared
only with steps of the same kind (rows, and tokens fed), and only a few steps apart, so
that a growing context or a batch that changes size does not pass for a change of load.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import torch

RECENT = 5  # steps on the kept count that a probe is compared with


@contextmanager
def on_threads(count: int) -> Iterator[None]:
    """torch's pool at `count` threads for the block, then back to the caller's setting,
    whatever happens in it: the one place a decode changes torch's thread count."""
    before = torch.get_num_threads()
    if count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count != before:
            torch.set_num_threads(before)


class Threads:
    """The thread count for each decoding step (`count_for`), learnt from their times
    (`took`). With `most` 1 there is nothing to choose: every step runs on one. A probe
    runs `probes` steps on the other count, then as many on the kept one, and compares
    the two: both measured at the same moment, under the same load."""

    def __init__(
        self, most: int, every: int = 64, probes: int = 2, margin: float = 0.1, adapt: bool = True
    ) -> None:
        self.most, self.every, self.probes, self.margin = most, every, probes, margin
        self.adapt = adapt and most > 1  # False: every step on `most`
        self.count = most  # the kept count
        self.wait = RECENT  # steps until the next probe: the first comes early
        self.since = 0
        self.kind: object = None
        self.recent: list[float] = []  # seconds of the last steps of this kind on `count`
        self.trial: list[float] | None = None  # a probe's steps on `other`, then on `count`

    @property
    def other(self) -> int:
        return 1 if self.count == self.most else self.most

    def count_for(self, kind: object) -> int:
        """Threads for the next step, of `kind` (steps of one kind take the same time)."""
        if kind != self.kind:  # a step of another size: compare anew
            self.kind, self.recent, self.trial = kind, [], None
        if self.trial is not None and len(self.trial) < self.probes:
            return self.other
        return self.count

    def took(self, seconds: float) -> None:
        """The time of the step `count_for` was last asked for."""
        if self.trial is not None:
            self.trial.append(seconds)
            if len(self.trial) == 2 * self.probes:
                self._decide()
            return
        spike = len(self.recent) >= 3 and seconds > 3 * min(self.recent)  # min: no sort a step
        self.recent = [*self.recent, seconds][-RECENT:]
        self.since += 1
        if self.adapt and len(self.recent) >= 3 and (self.since >= self.wait or spike):
            self.trial = []  # the next steps run on the other count, then on this one

    def _decide(self) -> None:
        tried = statistics.median(self.trial[: self.probes])
        kept = statistics.median(self.trial[self.probes :])
        if tried < kept * (1 - self.margin):
            self.count, self.wait = self.other, self.every
            self.recent = self.trial[: self.probes]
        else:
            self.wait = min(max(2 * self.wait, self.every), 16 * self.every)
            self.recent = self.trial[self.probes :]
        self.trial, self.since = None, 0
