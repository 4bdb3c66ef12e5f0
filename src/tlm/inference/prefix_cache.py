"""Keys and values of texts already read, kept for the requests that come after (a prefix cache).

A request's keys and values at position t depend only on its tokens up to t (causal
attention, eq. 9.33), so two prompts that begin alike have the same keys and values over
what they share: a conversation's next turn repeats all of the last, clients of one
application share a system prompt. `PrefixCache` keeps them in blocks of `block` tokens
after their request has ended, and a new request copies its longest cached prefix into its
row and prefills only the rest (`Slots` does both).

Blocks form a hash chain: a block's key is (its parent block's id, its own tokens), so a
block stands for its tokens *and everything before them*, and a lookup walks the prompt
one dict probe a block, from the first. Chosen over a radix tree (a node per shared run of
tokens, split as texts diverge) because the block, not the token, is what is copied and
evicted, a dict keeps no tree consistent, and the key is exact (the tokens themselves, not
a digest: two prefixes never collide). Only full blocks are kept: a prompt's last partial
block is prefilled again (at most block - 1 tokens).

The memory is bounded by `budget` bytes: when a new block would pass it, the least
recently used blocks with no cached child go first. A hit uses its chain from the last
block back to the first, so a block's parent is always used more recently than it, and
the ends of chains go before their beginnings, which other texts may still share.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

MOST = 4 << 30  # the host-sized default's ceiling: 4 GiB


@dataclass(eq=False)
class Block:
    """`block` tokens' keys and values in every layer, k and v [L,H,block,d_head]."""

    id: int
    key: tuple[int, tuple[int, ...]]  # (the parent's id, or -1 at the start; the tokens)
    parent: Block | None
    k: Tensor
    v: Tensor
    children: int = 0

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class Counts:
    """What the cache did since it was made (the server's `tlm_prefix_cache_*` series)."""

    lookups: int = 0  # prompts that looked for a prefix
    hits: int = 0  # ... and reused at least one block
    tokens_reused: int = 0  # prompt tokens not prefilled again
    stored: int = 0  # blocks kept
    evicted: int = 0  # blocks dropped for room


class PrefixCache:
    """Blocks of `block` tokens' keys and values, at most `budget` bytes of them."""

    def __init__(self, budget: int, block: int = 16) -> None:
        if block < 1 or budget < 0:
            raise ValueError(f"a prefix cache of {budget} bytes in blocks of {block} tokens")
        self.budget, self.block = budget, block
        self.blocks: OrderedDict[tuple, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.counts = Counts()
        self._ids = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, tokens: list[int], most: int) -> list[Block]:
        """The longest chain of cached blocks that spells a prefix of tokens[:most], first
        block first (nothing counted or moved: `use` does that)."""
        chain: list[Block] = []
        parent = -1
        for start in range(0, most - self.block + 1, self.block):
            found = self.blocks.get((parent, tuple(tokens[start : start + self.block])))
            if found is None:
                break
            chain.append(found)
            parent = found.id
        return chain

    def use(self, chain: list[Block], reused: int | None = None) -> None:
        """A prompt reuses `chain` (perhaps empty), or `reused` tokens in all (what its row
        still held, `Slots` decides): counted, and the chain's blocks made the most recently
        used, its first block last."""
        for found in reversed(chain):
            self.blocks.move_to_end(found.key)
        reused = len(chain) * self.block if reused is None else reused
        self.counts.lookups += 1
        self.counts.hits += reused > 0
        self.counts.tokens_reused += reused

    def store(self, tokens: list[int], length: int, read) -> int:
        """Keep the full blocks of tokens[:length] not kept yet; `read(start, end)` gives
        the keys and values of positions start..end-1 ([L,H,n,d_head] each, copies).
        Returns the blocks added (fewer when the budget cannot make room)."""
        parent, chain, added = None, [], 0
        for start in range(0, length - self.block + 1, self.block):
            key = (-1 if parent is None else parent.id, tuple(tokens[start : start + self.block]))
            found = self.blocks.get(key)
            if found is None:
                k, v = read(start, start + self.block)
                found = Block(self._ids, key, parent, k, v)
                if parent is not None:
                    parent.children += 1  # first: making room must not evict the parent
                if not self._room(found.bytes):
                    if parent is not None:
                        parent.children -= 1
                    break
                self._ids += 1
                self.blocks[key] = found
                self.bytes += found.bytes
                self.counts.stored += 1
                added += 1
            chain.append(found)
            parent = found
        for found in reversed(chain):
            self.blocks.move_to_end(found.key)
        return added

    def _room(self, size: int) -> bool:
        """Evict least recently used blocks with no cached child until `size` more bytes
        fit the budget; False when they cannot."""
        if size > self.budget:
            return False
        while self.bytes + size > self.budget:
            victim = next((b for b in self.blocks.values() if b.children == 0), None)
            if victim is None:
                return False
            del self.blocks[victim.key]
            self.bytes -= victim.bytes
            self.counts.evicted += 1
            if victim.parent is not None:
                victim.parent.children -= 1
        return True


def position_bytes(config, dtype: torch.dtype) -> int:
    """The bytes of one position's keys and values in every layer of a model of `config`."""
    return 2 * config.n_layers * config.n_heads * config.d_head * dtype.itemsize


def shared(held: list[int], text: list[int], most: int | None = None) -> int:
    """How many tokens `text` begins with that `held` begins with too (at most `most`)."""
    n = min(len(held), len(text), len(text) if most is None else most)
    same = 0
    while same < n and held[same] == text[same]:
        same += 1
    return same


def host_budget(device: torch.device) -> int:
    """The default budget: a quarter of the memory free on `device` now (the model loaded),
    at most `MOST`: on a GPU its free memory, on the CPU the host's MemAvailable."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available()
    return min(MOST, free // 4)


def _available() -> int:
    """The host's MemAvailable in bytes (its physical memory where /proc is not)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
