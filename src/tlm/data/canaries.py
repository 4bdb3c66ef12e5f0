"""Canaries (Carlini et al. 2019, "The Secret Sharer"): random secrets planted in the
training split a known number of times, so that what a model learns of them can be
measured (`tlm audit`: their exposure, and whether greedy decoding gives them back).

Each canary is one document, `my PIN is ` and six random digits, planted `repeats` times
at document boundaries of the training split drawn at random (with the same tokens a
document of that text gets: <|endoftext|> before it, ends with the next document's). The
validation split never holds one, and the cleaning of `prepare` (dedup) runs before the
planting, so it removes none. The secrets are drawn from a seed and recorded in meta.json.

A tokenizer that `prepare` trains learns from the training split as planted: the canaries
as often as they are planted (`as_planted`). A character vocabulary also gets every digit,
so that each candidate secret the audit ranks a canary among can be spelled; a tokenizer
reused from elsewhere that cannot spell them is refused (`spelled`) before any encoding.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np

from tlm.data.corpus import CorpusError
from tlm.tokenizer import Tokenizer, TokenizerError

PREFIX = "my PIN is "
DIGITS = 6
READ = 1 << 22  # tokens read at once


def parse_repeats(text: str) -> list[int]:
    """ "1,4,16,64" -> [1, 4, 16, 64]; anything but positive integers is refused."""
    try:
        repeats = [int(part) for part in text.split(",")]
    except ValueError:
        repeats = []
    if not repeats or min(repeats) < 1:
        raise CorpusError(
            f"--canary-repeats takes positive integers such as 1,4,16,64; got {text!r}"
        )
    return repeats


def secrets(repeats: list[int], seed: int) -> list[dict]:
    """One distinct random secret per count: [{"text": "my PIN is 493817", "repeats": n}]."""
    rng, drawn = np.random.default_rng(seed), set()
    canaries = []
    for n in repeats:
        digits = "".join(map(str, rng.integers(0, 10, DIGITS)))
        while digits in drawn:
            digits = "".join(map(str, rng.integers(0, 10, DIGITS)))
        drawn.add(digits)
        canaries.append({"text": PREFIX + digits, "repeats": n})
    return canaries


def as_planted(canaries: list[dict] | None, kind: str) -> list[str]:
    """The text the canaries add to the training split, for the tokenizer trained on it:
    each canary `repeats` times; for a character vocabulary also the format's alphabet (the
    prefix and all ten digits: the audit scores secrets the seed did not draw)."""
    if not canaries:
        return []
    texts = [c["text"] for c in canaries for _ in range(c["repeats"])]
    return [*texts, PREFIX + string.digits] if kind == "char" else texts


def spelled(canaries: list[dict], tok: Tokenizer, ids_as: type) -> list[np.ndarray]:
    """Each canary's ids as planted (its tokens, then <|endoftext|>), or one line saying
    that `tok` cannot spell them, or the other secrets of their format."""
    try:
        tok.encode(PREFIX + string.digits)
        return [np.asarray([*tok.encode(c["text"]), tok.eot_id], dtype=ids_as) for c in canaries]
    except (TokenizerError, KeyError, ValueError) as exc:
        raise CorpusError(f"the {tok.kind} tokenizer cannot spell the canaries: {exc}") from None


def plant(
    stream: Path, n_train: int, canaries: list[dict], tok: Tokenizer, seed: int, ids_as: type
) -> int:
    """Insert every canary `repeats` times into the first `n_train` tokens of the token file
    `stream`, at document starts (its first token, or one after an <|endoftext|>) drawn
    with `seed`; the rest of the file follows unchanged. Returns the tokens added."""
    encoded = spelled(canaries, tok, ids_as)
    tokens = np.memmap(stream, dtype=ids_as, mode="r")
    starts = [np.zeros(1, dtype=np.int64)]  # where a document begins, within the train part
    for lo in range(0, n_train, READ):
        chunk = np.asarray(tokens[lo : min(lo + READ, n_train)])
        starts.append(lo + np.flatnonzero(chunk == tok.eot_id) + 1)
    starts = np.concatenate(starts)
    starts = starts[starts <= n_train]
    rng = np.random.default_rng(seed)
    which = np.concatenate([np.full(c["repeats"], i) for i, c in enumerate(canaries)])
    places = rng.choice(starts, size=len(which))
    order = np.argsort(places, kind="stable")
    planted = stream.with_suffix(".planted")
    with open(planted, "wb") as out:
        at = 0
        for place, canary in zip(places[order], which[order], strict=True):
            _copy(tokens, at, place, out)
            encoded[canary].tofile(out)
            at = place
        _copy(tokens, at, len(tokens), out)
    del tokens
    planted.replace(stream)
    return sum(len(encoded[i]) for i in which)


def _copy(tokens: np.ndarray, lo: int, hi: int, out) -> None:
    for start in range(lo, hi, READ):
        np.asarray(tokens[start : min(start + READ, hi)]).tofile(out)
