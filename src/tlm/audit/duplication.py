"""How often a window's text occurs in the training split (Kandpal et al. 2022; Lee et al.
2022): text seen many times is memorized first, which is why `tlm prepare --dedup` matters.

Each window of n tokens is reduced to a 64-bit polynomial hash, h = Σ_j t_j B^(n-1-j) mod
2^64, and every window of the stream is hashed the same way, a block of tokens at a time,
so memory stays a few hundred MB whatever the corpus. Two different windows share a hash
with probability about 2^-64 per pair: a count is exact in practice, and never too low.
"""

from __future__ import annotations

import numpy as np

BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so that each token shifts the whole hash
BLOCK = 1 << 22  # stream tokens hashed at once
BUCKETS = ((1, 1, "1"), (2, 4, "2-4"), (5, 16, "5-16"), (17, None, "17+"))


def window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """The hash of every window of n tokens of `tokens` [T]: [T - n + 1] uint64."""
    t = np.asarray(tokens).astype(np.uint64)
    windows = len(t) - n + 1
    if windows < 1:
        return np.zeros(0, dtype=np.uint64)
    h = np.zeros(windows, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic mod 2^64 is the point
        for j in range(n):
            h = h * BASE + t[j : j + windows]
    return h


def occurrences(stream: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """How many times each row of windows [N,n] occurs in the token stream [T] (at any
    offset, overlapping occurrences counted): [N] int64."""
    n = windows.shape[1]
    wanted = np.zeros(len(windows), dtype=np.uint64)
    with np.errstate(over="ignore"):  # each row hashed as window_hashes hashes a window
        for column in np.asarray(windows).astype(np.uint64).T:
            wanted = wanted * BASE + column
    keys, inverse = np.unique(wanted, return_inverse=True)
    counts = np.zeros(len(keys), dtype=np.int64)
    for lo in range(0, max(len(stream) - n + 1, 0), BLOCK):
        block = window_hashes(stream[lo : lo + BLOCK + n - 1], n)
        at = np.searchsorted(keys, block)
        found = at < len(keys)
        found[found] = keys[at[found]] == block[found]
        counts += np.bincount(at[found], minlength=len(keys))
    return counts[inverse]


def bucket_of(count: int) -> str:
    """The duplication bucket of a count of 1 or more: 1, 2-4, 5-16 or 17+."""
    for low, high, name in BUCKETS:
        if count >= low and (high is None or count <= high):
            return name
    raise ValueError(f"a window of the training split occurs there at least once, not {count}")


def by_bucket(counts: np.ndarray, exact: np.ndarray) -> list[dict[str, float | int | str]]:
    """Extraction per duplication bucket: [{"bucket", "windows", "rate"}] in bucket order,
    empty buckets included (rate 0)."""
    names = np.array([bucket_of(int(c)) for c in counts])
    rows = []
    for _, _, name in BUCKETS:
        mine = exact[names == name] if len(names) else exact[:0]
        rate = float(mine.mean()) if len(mine) else 0.0
        rows.append({"bucket": name, "windows": len(mine), "rate": rate})
    return rows
