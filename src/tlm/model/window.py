"""Sliding-window attention (Beltagy et al. 2020; Child et al. 2019): each query sees at
most the W keys up to its own position, i - W < j <= i, instead of all j <= i (Fig. 9.9's
mask with a band). One layer reads W positions back, L layers L·W: information still
travels past the window, one layer at a time.

What it buys is a bounded cache. Decoding keeps the keys and values of the last W
positions only, in a ring: position p lives at entry p mod C, and a new token overwrites
the oldest. The ring holds C = W + SLACK entries, so that a pass of up to SLACK + 1
tokens (a draft's check) can write its keys before any of its queries reads, and a
rolled-back draft (`truncate`) finds the keys it needs still there. Memory stays flat
however long the text; positions keep counting (a rotary model's angles are computed past
its tables, `positions.Rotary`), and only distances < W reach a query.

The ring is exact: the keys a cached query sees are the ones the uncached model's
windowed mask lets it see, computed from the same past. The tests hold every cache (and
the C step, `step.c`, which indexes the ring the same way) equal to the forward pass over
the whole text.
"""

from __future__ import annotations

import torch
from torch import Tensor

SLACK = 64  # ring entries past the window: the longest pass that writes before it reads, - 1


def window_causal_mask(T: int, S: int, window: int, device: torch.device | None = None) -> Tensor:
    """Bool [T,S]: the last T of S positions query, and query i (at S - T + i) sees key j
    when i - W < j <= i (the causal mask of Fig. 9.9 cut to a band of width W)."""
    queries, keys = torch.arange(S - T, S, device=device), torch.arange(S, device=device)
    return window_mask(queries, keys, window)


def window_mask(queries: Tensor, keys: Tensor, window: int) -> Tensor:
    """Bool [..., T, S]: the query at position queries[t] may see the key at keys[s] when
    0 <= keys[s] <= queries[t] < keys[s] + W (an empty entry's position is -1)."""
    q, k = queries[..., :, None], keys[..., None, :]
    return (k >= 0) & (k <= q) & (q - k < window)


def ring_size(window: int, longest: int | None = None) -> int:
    """The entries of a windowed cache: W + SLACK, or fewer when no text grows past
    `longest` positions (the ring then never wraps)."""
    size = window + SLACK
    return size if longest is None else max(1, min(size, longest))


def held(end: int | Tensor, size: int, device: torch.device | None = None) -> Tensor:
    """[size]: the position each entry of a ring holds once positions [0, end) were
    written in order (p at entry p mod size), -1 for an entry not written yet; for ends
    [R,1] (rows at their own lengths), [R,size]."""
    entries = torch.arange(size, device=device)
    positions = (end - 1) - ((end - 1 - entries) % size)
    return positions.masked_fill(positions < 0, -1)


class RingPass:
    """One pass of `count` tokens at positions start.. into ring stores [B,H,size,d_head].

    When the pass is at most size - W + 1 tokens, its keys and values are written first
    and the queries read the ring itself (no copy: a decoding step, a draft's check);
    a longer pass (a prompt) reads the ring's written entries followed by its own keys,
    and then keeps the last `size` of them. No entry that was never written is read.
    `mask` [count, S] says which of the S keys each query sees."""

    def __init__(self, start: int, count: int, size: int, window: int, device) -> None:
        self.start, self.count, self.size = start, count, size
        end = start + count
        self.first = count <= size - window + 1 or end <= size  # write, then read the ring
        queries = torch.arange(start, end, device=device)
        if self.first:
            self.keys = held(end, size, device)[: min(end, size)]
        else:
            self.old = min(start, size)  # entries written before the pass
            self.keys = torch.cat((held(start, size, device)[: self.old], queries))
        self.mask = window_mask(queries, self.keys, window)  # [count, S]
        kept = min(count, size)  # the last `size` new positions stay
        self.kept = kept
        self.entries = torch.arange(end - kept, end, device=device) % size

    def store(self, K: Tensor, V: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B,H,count,d_head] into the stores K, V [B,H,size,d_head]; return the
        keys and values [B,H,S,d_head] the queries read (`mask` says which each may)."""
        if self.first:
            K.index_copy_(2, self.entries, k[:, :, -self.kept :])
            V.index_copy_(2, self.entries, v[:, :, -self.kept :])
            n = len(self.keys)
            return K[:, :, :n], V[:, :, :n]
        keys = torch.cat((K[:, :, : self.old], k), dim=2)  # never an entry not written
        values = torch.cat((V[:, :, : self.old], v), dim=2)
        K.index_copy_(2, self.entries, k[:, :, -self.kept :])
        V.index_copy_(2, self.entries, v[:, :, -self.kept :])
        return keys, values


def rollback_ok(length: int, to: int, size: int, window: int) -> bool:
    """Whether a ring that holds positions [0, length) can go back to the first `to` (or
    be emptied): the
    keys the next query needs (to - W + 1 ... to - 1) are still in it, and no entry left
    over from the dropped positions can pass for one the window sees."""
    return to == 0 or length <= size or length - to <= size - window
