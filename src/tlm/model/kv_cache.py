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
    """K and V [L, B, H, capacity, d_head]; positions [0, length) are filled."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.capacity = capacity or config.context_length
        shape = (config.n_layers, batch_size, config.n_heads, self.capacity, config.d_head)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # only [0, length) is ever read
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0
        self.cross_kv: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> the source's K, V
        self.cross_projections = 0  # how many times a source's K, V were computed

    def positions(self, T: int, device: torch.device) -> Tensor:
        return torch.arange(self.length, self.length + T, device=device)  # [T]

    def end(self, T: int) -> int:
        return self.length + T

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, attend: Attend
    ) -> Tensor:
        k, v = self.update(layer, k, v)  # [B,H,S,dh]: the stored positions, then these
        return attend(q, k, v, mask)

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
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {end} were asked for")

    def advance(self, T: int) -> None:
        self.length += T

    def reorder(self, rows: Tensor) -> None:
        """Keep batch rows `rows` (with repeats), e.g. the surviving beams of beam search."""
        n = self.length  # the unfilled positions are never read: leave them behind
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
        self.length = length

    def reset(self) -> None:
        """Empty, for a new sequence (and a new source)."""
        self.length = 0
        self.cross_kv.clear()
