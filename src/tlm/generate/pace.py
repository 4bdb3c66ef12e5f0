"""How often, and how long, one row drafts (speculative decoding, `Slots._speculate`).

Two rules, each per sequence:

- **length, by acceptance**: a draft kept whole lets the next one be 2 tokens longer (up
  to `draft_tokens`), one cut short makes it 1 shorter (down to 1); a draft of one token
  that misses pauses drafting for 4 plain steps, then 8, … up to 64 (a kept draft sets
  the pause back to 4);
- **drafting, by time**: every plain step a drafting row takes alone (paused, with no
  draft to check, or the one after its first draft, taken to measure) is timed: the
  seconds a token costs without drafts. A step that checked
  a draft is timed from the draft's start to its last token, less the draft model's
  catching up on the tokens it missed while paused (that is the pause's cost, not the
  draft's), over the tokens it gave. When drafting costs more a token than plain steps
  (averages over the last few, each way), drafting pauses for 4 plain steps, then 8, …
  up to 256, however many tokens were kept; a draft that pays sets it back to 4.

The first keeps a free draft (prompt lookup) from wasting checks where the text does not
repeat: a miss costs only the check's extra rows. The second applies to draft models,
whose proposals cost steps of their own: it keeps one that agrees too seldom for its cost
(a draft whose step is nearly the target's, on a model too small for its weight reads to
dominate a step) from making decoding slower, at the cost of one trial step per pause.
(On prompt lookup it did harm: a single check that kept nothing paused drafts that went
on to be kept, 1.40 tokens a step against 1.70 on the demo's grounded task.)
"""

from __future__ import annotations

from dataclasses import dataclass

MOST_MISSED, MOST_SLOWER = 64, 256  # the longest pauses, after misses and after slow drafts


def average(before: float | None, now: float, weight: float = 0.5) -> float:
    """An exponential moving average (the first value as it is)."""
    return now if before is None else (1 - weight) * before + weight * now


@dataclass
class Pace:
    """One row's drafting rules' state; `most` is its `draft_tokens`, `timed` whether its
    drafts cost time of their own (a draft model: the time rule applies)."""

    most: int
    timed: bool = True
    length: int | None = None  # the next draft's most tokens (None: `most`)
    pause: int = 0  # plain steps left before the next draft
    next_pause: int = 4
    plain_cost: float | None = None  # seconds a token, plain steps and drafting steps
    draft_cost: float | None = None
    checks: int = 0

    def wants_draft(self) -> bool:
        """Whether this step drafts (a paused row counts one plain step down)."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def plain(self, seconds: float) -> None:
        """A plain step of the row alone took `seconds`."""
        if self.timed:
            self.plain_cost = average(self.plain_cost, seconds)

    def checked(self, drafted: int, kept: int, seconds: float) -> None:
        """A step checked `drafted` tokens, kept `kept`, and took `seconds` in all."""
        length, self.checks = self.length or self.most, self.checks + 1
        self.length = min(self.most, length + 2) if kept == drafted else max(1, length - 1)
        self.draft_cost = average(self.draft_cost, seconds / (kept + 1))
        if self.plain_cost is not None and self.draft_cost > self.plain_cost:
            self._pause(MOST_SLOWER)
            self.draft_cost = None  # the trial after the pause is judged on its own
        elif kept:
            self.next_pause = 4
        elif length == 1:  # the shortest draft, missed
            self._pause(MOST_MISSED)
        if self.timed and self.checks == 1 and self.plain_cost is None:
            self.pause = max(self.pause, 1)  # a plain step next, to know what drafts must beat

    def _pause(self, most: int) -> None:
        self.pause = self.next_pause
        self.next_pause = min(most, 2 * self.next_pause)
