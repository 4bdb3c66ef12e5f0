"""The KV cache (the textbook slides' "KV cache"), and the small interface every cache keeps.

In autoregressive decoding the keys and values of positions 1..t never change once computed
(causal attention: they depend only on their own past). Keeping them turns each new token's
forward pass from O(t) positions of work into O(1): the prompt is run once ("prefill"), then
one token per step attends to the stored keys and values.

A cache is a small explicit object passed through `TransformerLM.forward`; the model holds
no hidden state. The model talks to any cache through `Cache` alone: `KVCache` here (one
length for the whole batch) and, for a server's rows that each keep their own length,
`tlm.inference.SlotCache`'s passes. Attention never asks which kind it has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from tlm.config import ModelConfig
from tlm.model.window import RingPass, ring_size, rollback_ok

# attend(q, k, v, mask) -> heads: `MultiHeadAttention.attend`, for the keys a query may see
Attend = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]


class Cache(Protocol):
    """What the model asks of a cache during one forward pass of T new tokens."""

    def positions(self, T: int, device: torch.device) -> Tensor:
        """The absolute positions of the T new tokens: [T], or [B,T] if rows differ."""
        ...

    def end(self, T: int) -> int:
        """The longest row's length once the T tokens are in (checked against the context)."""
        ...

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, attend: Attend
    ) -> Tensor:
        """Store k, v [B,H,T,d_head] of `layer` and return attend(q, keys, values, mask) over
        every key each query may see: heads [B,H,T,d_head]."""
        ...

    def advance(self, T: int) -> None:
        """Every layer has stored its part of the pass: the rows are T tokens longer."""
        ...

    def last(self, x: Tensor) -> Tensor:
        """Each row's last position of x [B,T,d]: the one that predicts its next token."""
        ...


class KVCache:
    """K and V [L, B, H, capacity, d_head]; positions [0, length) are filled. For a model
    with an attention window W the store is a ring (`model/window.py`): position p at
    entry p mod capacity, capacity W + SLACK at most, however long the text grows."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.window = config.attention_window
        self.capacity = capacity or cache_size(config)
        shape = (config.n_layers, batch_size, config.n_heads, self.capacity, config.d_head)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # only [0, length) is ever read
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0
        self.cross_kv: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> the source's K, V
        self.cross_projections = 0  # how many times a source's K, V were computed
        self._ring: tuple[tuple[int, int], RingPass] | None = None  # this pass's, if windowed

    def positions(self, T: int, device: torch.device) -> Tensor:
        return torch.arange(self.length, self.length + T, device=device)  # [T]

    def end(self, T: int) -> int:
        return self.length + T

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, attend: Attend
    ) -> Tensor:
        if self.window is not None:
            return self._attend_ring(layer, q, k, v, mask, attend)
        k, v = self.update(layer, k, v)  # [B,H,S,dh]: the stored positions, then these
        return attend(q, k, v, mask)

    def _attend_ring(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, attend: Attend
    ) -> Tensor:
        """A windowed model's pass: the ring's keys, each query seeing its window of them;
        a padding `mask` [B,1,T,length+T] (by position) is read at the keys' positions."""
        key = (self.length, k.shape[2])
        if self._ring is None or self._ring[0] != key:  # one per pass, for every layer
            self._ring = (key, RingPass(*key, self.capacity, self.window, k.device))
        ring = self._ring[1]
        keys, values = ring.store(self.k[layer], self.v[layer], k, v)
        seen = ring.mask  # [T,S]
        if mask is not None:
            seen = seen & mask.index_select(-1, ring.keys.clamp(min=0))  # [B,1,T,S]
        return attend(q, keys, values, seen)

    def last(self, x: Tensor) -> Tensor:
        return x[:, -1:]

    def cross(
        self, layer: int, project: Callable[[], tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor]:
        """The keys and values cross-attention reads from the encoder's output, [B,S,H*d_head]
        each: `project()` runs at the first step of a source, never again (they cannot
        change while the target grows)."""
        if layer not in self.cross_kv:
            self.cross_kv[layer] = project()
            self.cross_projections += 1
        return self.cross_kv[layer]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new k, v [B,H,T,d_head] of `layer` after the filled positions.

        Returns all keys and values so far, [B,H,length+T,d_head] (views, no copy). The length
        moves on only in `advance`, once every layer has stored its part of the step.
        """
        start, end = self.length, self.length + k.shape[2]
        self.check_capacity(end)
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def check_capacity(self, end: int) -> None:
        """Refuse to fill positions up to `end` when the cache holds fewer."""
        if end > self.capacity and self.window is None:  # a ring holds the last ones
            raise ValueError(f"KV cache holds {self.capacity} positions; {end} were asked for")

    def advance(self, T: int) -> None:
        self.length += T

    def reorder(self, rows: Tensor) -> None:
        """Keep batch rows `rows` (with repeats), e.g. the surviving beams of beam search."""
        n = min(self.length, self.capacity)  # the unfilled entries are never read
        kept = []
        for old in (self.k, self.v):
            new = old.new_empty((old.shape[0], len(rows), *old.shape[2:]))
            new[:, :, :, :n] = old[:, :, :, :n].index_select(1, rows)
            kept.append(new)
        self.k, self.v = kept
        for layer, (k, v) in self.cross_kv.items():
            self.cross_kv[layer] = (k.index_select(0, rows), v.index_select(0, rows))

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions (a draft's rejected tokens): the keys and
        values past it are never read again, and the next tokens overwrite them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KV cache holds {self.length} positions, not {length}")
        if self.window and not rollback_ok(self.length, length, self.capacity, self.window):
            most = self.capacity - self.window
            raise ValueError(f"a windowed cache goes back at most {most} positions")
        self.length = length

    def reset(self) -> None:
        """Empty, for a new sequence (and a new source)."""
        self.length = 0
        self.cross_kv.clear()


def cache_size(config: ModelConfig, longest: int | None = None) -> int:
    """The positions a cache keeps for texts of at most `longest` tokens (None: any): the
    context (the window slides past it), or for a model with an attention window its
    ring, which holds the window whatever the length."""
    if config.attention_window is not None:
        return ring_size(config.attention_window, longest)
    return config.context_length if longest is None else min(config.context_length, longest)
