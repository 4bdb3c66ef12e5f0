"""Stop strings: a completion's text as its tokens arrive, ended at the first stop string.

Text that could still be the start of a stop string is held back until it is not, so a
client never sees text that a later token turns into a stop. `StopText` is the one place
that holds text back; `complete`, `stream_completion` and the server's engine use it.
"""

from __future__ import annotations

from collections.abc import Iterable

from tlm.tokenizer import TextStream, Tokenizer


def first_stop(text: str, stop: Iterable[str]) -> int | None:
    """Where the first stop string in `text` begins (None: none is there)."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


class StopText:
    """One completion's text: `push(token)` returns the text that became final; once a
    stop string appears, the text before it is the whole completion (`stopped`), and
    `finish()` returns what was held back at the end of the output."""

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = ()) -> None:
        self.stream, self.stop = TextStream(tokenizer), tuple(stop)
        self.hold = max((len(s) - 1 for s in self.stop), default=0)  # a stop's first part
        self.text, self.shown, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.text += self.stream.push([token])
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.stream.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = first_stop(self.text, self.stop)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
        end = len(self.text)
        if not (final or self.stopped):
            end = max(self.shown, end - self.hold)
        piece, self.shown = self.text[self.shown : end], end
        return piece
