"""A KV cache with a length per row, for continuous batching.

`KVCache` gives the whole batch one length: every row starts together and moves on
together. A server's rows (slots) do not: a request joins while others are half done, and
leaves when it ends. `SlotCache` holds K and V [L, slots, H, capacity + 1, d_head] and one
length per slot. A forward pass over slots lo..hi-1 takes `cache.rows(lo, hi, active)` as
its cache, and for each active row:

- its new keys and values are written after its own filled positions;
- its queries sit at its own positions (so a row's positions count its own tokens only);
- it attends to its own filled positions and nothing else (a mask per row).

Rows of the range that are not active this pass (a free slot, or a row prefilled on its
own this step) run along as dummies: at position 0, writing to the spare position at
`capacity` once full, and their outputs are ignored. When every row is active at the same
length the pass needs no mask, and the writes are one slice, as with `KVCache`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tlm.config import ModelConfig


class SlotCache:
    """K and V for `slots` rows, each with its own length (kept on the host: no device sync)."""

    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        capacity: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.capacity = capacity or config.context_length
        shape = (config.n_layers, slots, config.n_heads, self.capacity + 1, config.d_head)
        # zeros, not empty: a row's mask hides the positions past its length, but a weight
        # of 0 times a NaN left in never-written memory would still be NaN
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [.., capacity]: the spare
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * slots

    def rows(self, lo: int, hi: int, active: list[bool] | None = None) -> Rows:
        """The cache of slots lo..hi-1 for one forward pass (all active unless told)."""
        return Rows(self, lo, hi, active or [True] * (hi - lo))

    def clear(self, slot: int) -> None:
        self.lengths[slot] = 0


class Rows:
    """What a forward pass over slots lo..hi-1 uses as its cache (KVCache's interface, plus
    the positions and mask of each row)."""

    def __init__(self, cache: SlotCache, lo: int, hi: int, active: list[bool]) -> None:
        self.cache, self.lo, self.hi, self.active = cache, lo, hi, active
        lengths = cache.lengths[lo:hi]
        self.starts = [n if on else 0 for n, on in zip(lengths, active, strict=True)]
        self.writes = [  # an inactive row writes after its own positions, or to the spare
            n if on else min(n, cache.capacity) for n, on in zip(lengths, active, strict=True)
        ]
        self.uniform = all(active) and len(set(lengths)) == 1  # one slice, no mask
        self.length = max(n for n, on in zip(lengths, active, strict=True) if on)

    def positions(self, T: int) -> Tensor:
        """Absolute positions of the new tokens: [T] when uniform, else [B,T]."""
        device = self.cache.k.device
        steps = torch.arange(T, device=device)
        if self.uniform:
            return steps + self.starts[0]
        return torch.tensor(self.starts, device=device)[:, None] + steps  # [B,T]

    def mask(self, T: int) -> Tensor | None:
        """Bool [B,1,T,S], True where a new query may attend: its row's positions up to its
        own. None when uniform (the attention's own causal rule is the same thing)."""
        if self.uniform:
            return None
        S = self.length + T
        queries = self.positions(T)  # [B,T]
        keys = torch.arange(S, device=queries.device)
        return (keys[None, None, :] <= queries[:, :, None])[:, None]  # [B,1,T,S]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new k, v [B,H,T,d_head] of `layer` at each row's own place; return the
        keys and values [B,H,S,d_head] the queries may look at (views, no copy)."""
        B, H, T, d_head = k.shape
        end = self.length + T
        if end > self.cache.capacity:
            raise ValueError(
                f"KV cache holds {self.cache.capacity} positions; {end} were asked for"
            )
        keys = self.cache.k[layer, self.lo : self.hi]  # [B,H,capacity+1,d_head], a view
        values = self.cache.v[layer, self.lo : self.hi]
        if self.uniform:
            start = self.starts[0]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
        else:
            at = torch.tensor(self.writes, device=k.device)[:, None] + torch.arange(
                T, device=k.device
            )
            index = at.clamp(max=self.cache.capacity).view(B, 1, T, 1).expand(B, H, T, d_head)
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, T: int) -> None:
        for i, on in enumerate(self.active):
            if on:
                self.cache.lengths[self.lo + i] += T
