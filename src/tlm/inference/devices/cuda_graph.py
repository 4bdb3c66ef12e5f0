"""A decoding step replayed as one CUDA graph, over a KV cache that never moves.

On a GPU a batch-1 step of a small model is bound by kernel launches, not arithmetic: GPT-2
124M launches ~400 kernels a token, each a few microseconds of work and as much of launch.
A CUDA graph records the kernels of one step once and replays them with one launch. A graph
replays the same kernels on the same addresses, so everything a step reads or writes must
stay where it was when it was recorded, and nothing in it may depend on a Python value that
changes between steps:

- `StaticCache` holds K and V for every position of a fixed window ([L,B,H,capacity,d_head],
  allocated once) and the column the next token goes to as a tensor on the device; a step
  writes its k, v there in place and attends over the whole window, with a mask that hides
  the columns not yet written (and each row's left padding).
- `GraphedDecoder` runs the prompt eagerly (its length varies), then records one
  single-token step on its first call and replays it for every token after.

The cache keeps the model's `Cache` interface, so the same `TransformerLM.forward` runs
eagerly on it (any device: the tests hold it equal to the uncached model on a CPU) and
inside the graph.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from tlm.config import ModelConfig
from tlm.model.kv_cache import Attend
from tlm.model.transformer import TransformerLM


class StaticCache:
    """K, V [L,B,H,capacity,d_head] filled in place; `length` (a device scalar) is the next
    column, `offset` [B] each row's left padding. `filled` mirrors `length` on the host, for
    the context check, which must not wait for the device."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (config.n_layers, batch_size, config.n_heads, capacity, config.d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # zeros: a hidden column
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # is never NaN (0 × NaN)
        self.capacity = capacity
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.offset = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, device=device)  # [S]
        self.filled = 0
        self.visible: Tensor | None = None  # [B,1,T,S], made once a pass in `positions`

    def start(self, attention_mask: Tensor | None, T: int) -> None:
        """A new batch of prompts [B,T]; `attention_mask` is 0 on left padding."""
        self.length.zero_()
        self.filled = 0
        if attention_mask is None:
            self.offset.zero_()
        else:
            self.offset.copy_(T - attention_mask.sum(dim=1))

    def positions(self, T: int, device: torch.device) -> Tensor:
        """The T new tokens' positions [B,T] (tokens counted, padding not), and the keys each
        may see: columns from the row's first token up to its own (a padding query: itself)."""
        at = self.length + torch.arange(T, device=device)  # [T] the columns they go to
        keys = self.columns[None, None, :]  # [1,1,S]
        seen = (keys <= at[None, :, None]) & (keys >= self.offset[:, None, None])  # [B,T,S]
        self.visible = (seen | (keys == at[None, :, None]))[:, None]  # [B,1,T,S]
        return (at[None, :] - self.offset[:, None]).clamp(min=0)

    def end(self, T: int) -> int:
        return self.filled + T

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, attend: Attend
    ) -> Tensor:
        at = self.length + torch.arange(k.shape[2], device=k.device)
        self.k[layer].index_copy_(2, at, k)  # [B,H,S,dh] <- [B,H,T,dh] at columns `at`
        self.v[layer].index_copy_(2, at, v)
        return attend(q, self.k[layer], self.v[layer], self.visible)

    def advance(self, T: int) -> None:
        self.length += T
        self.filled += T

    def last(self, x: Tensor) -> Tensor:
        return x[:, -1:]


class GraphedDecoder:
    """Prefill eagerly, then every single-token step as one replay of a recorded CUDA graph
    (`graph=False`: the same steps launched one by one, on any device)."""

    def __init__(self, model: TransformerLM, batch_size: int, capacity: int, graph: bool) -> None:
        weight = next(model.parameters())
        self.model, self.use_graph = model, graph
        self.cache = StaticCache(model.config, batch_size, capacity, weight.dtype, weight.device)
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=weight.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # the graph's output [B,1,V], overwritten per replay

    def prefill(self, ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The prompts [B,T] (left-padded where attention_mask is 0) -> next logits [B,V]."""
        self.cache.start(attention_mask, ids.shape[1])
        with torch.no_grad():
            return self.model(ids, self.cache, last_only=True)[:, -1]

    def step(self, tokens: Tensor) -> Tensor:
        """One new token per row [B] -> next logits [B,V] (a fresh tensor)."""
        self.token.copy_(tokens[:, None])
        if not self.use_graph:
            with torch.no_grad():
                return self.model(self.token, self.cache, last_only=True)[:, -1]
        if self.graph is None:
            self.use_graph = self._record()
            if not self.use_graph:
                return self.step(tokens)
        self.model.check_context(self.cache.end(1))
        self.graph.replay()
        self.cache.filled += 1
        return self.logits[:, -1].clone()

    def _record(self) -> bool:
        """Record one step as a graph; False (and one line on stderr) where it cannot be."""
        cache, length = self.cache, self.cache.length.clone()
        filled = cache.filled
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():  # warm-up: kernels chosen, memory
                for _ in range(2):  # allocated, outside the graph
                    self.model(self.token, cache, last_only=True)
                    cache.length.copy_(length)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad():
                self.logits = self.model(self.token, cache, last_only=True)
        except RuntimeError as error:  # a kernel that cannot be captured: decode without
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            print(f"CUDA graph not recorded ({first}); decoding step by step", file=sys.stderr)
            return False
        finally:
            cache.length.copy_(length)  # the warm-up steps moved it; recording did not
            cache.filled = filled
        self.graph = graph
        return True
