"""The KV cache (the textbook slides' "KV cache"): keys and values of every past position.

In autoregressive decoding the keys and values of positions 1..t never change once computed
(causal attention: they depend only on their own past). Keeping them turns each new token's
forward pass from O(t) positions of work into O(1): the prompt is run once ("prefill"), then
one token per step attends to the stored keys and values.

The cache is a small explicit object passed through `TransformerLM.forward`; the model holds
no hidden state. Its buffers are allocated once, for `capacity` positions (at most the
context length; a generation that cannot grow longer needs no more).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tlm.config import ModelConfig


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
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {end} were asked for")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, T: int) -> None:
        self.length += T

    def reorder(self, rows: Tensor) -> None:
        """Keep batch rows `rows` (with repeats), e.g. the surviving beams of beam search."""
        n = self.length  # the unfilled positions are never read: leave them behind
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], len(rows), *old.shape[2:]))
            new[:, :, :, :n] = old[:, :, :, :n].index_select(1, rows)
            setattr(self, name, new)
        for layer, (k, v) in self.cross_kv.items():
            self.cross_kv[layer] = (k.index_select(0, rows), v.index_select(0, rows))

    def reset(self) -> None:
        """Empty, for a new sequence (and a new source)."""
        self.length = 0
        self.cross_kv.clear()
