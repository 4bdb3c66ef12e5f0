"""A KV cache with a length per row, for continuous batching.

`tlm.model.KVCache` gives the whole batch one length: every row starts together and moves
on together. A server's rows (slots) do not: a request joins while others are half done,
and leaves when it ends. `SlotCache` holds K and V [L, slots, H, capacity, d_head] and one
length per slot.

One forward pass can serve any set of slots, each feeding its own number of new tokens: a
new request's whole prompt beside one token of every row that is decoding.
`cache.feed(slots, counts)` is the pass's cache (a `SlotPass`, which keeps the model's
`Cache` interface), and its input is every fed token in one sequence, [1, N] with
N = sum(counts), slot after slot. The products (Q, K, V, W^O, the FFN) run once over all N
tokens, so the weights are read once per pass. Attention runs per group of rows, each group
attending to its own keys:

- a `Band`: neighbouring slots at one length, each feeding one count (a prompt, or the
  decoding rows of `generate`, which move on together): the usual causal rule, no mask;
- `Ragged`: the rows feeding one token each otherwise, as a server's decoding rows are,
  each at its own length: one batched attention over their slot range with a mask per
  row. Slots of the range not in the group run along as dummies, whose output is dropped.

q, k, v reach a group as [1,H,N,d_head] and each group sees its rows as a batch
[rows,H,count,d_head]. For a model with an attention window each slot's store is a ring
(`model/window.py`): the lengths grow without bound, the memory does not.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tlm.config import ModelConfig
from tlm.model.kv_cache import Attend, cache_size
from tlm.model.window import RingPass, held, rollback_ok, window_mask


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
        self.window = config.attention_window
        self.capacity = capacity or cache_size(config)
        shape = (config.n_layers, slots, config.n_heads, self.capacity, config.d_head)
        # zeros, not empty: a `Ragged` row's mask hides the positions past its length, but a
        # weight of 0 times a NaN left in never-written memory would still be NaN
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * slots

    def feed(self, slots: list[int], counts: list[int]) -> SlotPass:
        """The cache of one pass in which slot slots[i] feeds counts[i] new tokens."""
        return SlotPass(self, slots, counts)

    def clear(self, slot: int) -> None:
        self.lengths[slot] = 0

    def truncate(self, slot: int, length: int) -> None:
        """Roll `slot` back to its first `length` positions (a draft's rejected tokens): the
        keys and values past it are never read again, and the next tokens overwrite them."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} positions, not {length}")
        if not self.can_truncate(slot, length):
            most = self.capacity - self.window
            raise ValueError(f"a windowed cache goes back at most {most} positions")
        self.lengths[slot] = length

    def can_truncate(self, slot: int, length: int) -> bool:
        """Whether `slot` can go back to its first `length` positions (a ring keeps the
        last W + SLACK)."""
        held = self.lengths[slot]
        ring = self.window is None or rollback_ok(held, length, self.capacity, self.window)
        return 0 <= length <= held and ring

    def room(self, slot: int) -> int:
        """The most tokens one pass may feed `slot` and still be rolled back: the positions
        left in its store, or for a ring, the pass that writes before it reads."""
        if self.window is None:
            return self.capacity - self.lengths[slot]
        return self.capacity - self.window + 1


class Band:
    """Slots lo..hi-1, all at one `length`, each feeding `count` tokens (tokens `offset`...
    of the pass's input, slot after slot)."""

    mask = None

    def __init__(self, cache: SlotCache, lo: int, start: int, count: int, offset: int) -> None:
        self.cache, self.lo, self.hi, self.length = cache, lo, lo + 1, start
        self.count, self.offset = count, offset
        self.ring = None  # a windowed model's pass into its rings, and its mask [count,S]
        if cache.window is not None:
            self.ring = RingPass(start, count, cache.capacity, cache.window, cache.k.device)
            self.mask = self.ring.mask

    def take(self, x: Tensor) -> Tensor:
        """This group's part of x [1,H,N,dh]: [hi-lo,H,count,dh] (a view)."""
        n, H = (self.hi - self.lo) * self.count, x.shape[1]
        part = x[0, :, self.offset : self.offset + n]  # [H,n,dh]
        return part.view(H, self.hi - self.lo, self.count, -1).transpose(0, 1)

    def put(self, out: Tensor, z: Tensor) -> None:
        """Write z [hi-lo,H,count,dh] into its place in out [1,H,N,dh]."""
        n = z.shape[0] * z.shape[2]
        out[0, :, self.offset : self.offset + n] = z.transpose(0, 1).flatten(1, 2)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [hi-lo,H,count,d_head] after the filled positions; return every key and
        value the new queries may see, [hi-lo,H,start+count,d_head] (views, no copy)."""
        end = self.length + self.count
        k_all = self.cache.k[layer, self.lo : self.hi]
        v_all = self.cache.v[layer, self.lo : self.hi]
        if self.ring is not None:
            return self.ring.store(k_all, v_all, k, v)
        k_all[:, :, self.length : end] = k
        v_all[:, :, self.length : end] = v
        return k_all[:, :, :end], v_all[:, :, :end]


class Ragged:
    """Slots feeding one token each, at their own lengths: one attention over the slot range
    lo..hi-1 with a mask per row (each row sees its own filled positions and its new one).
    A slot of the range outside the group is a dummy row: it repeats the group's first
    token, sees position 0 only, writes nothing, and its output is dropped."""

    def __init__(self, cache: SlotCache, slots: list[int], offsets: list[int]) -> None:
        device = cache.k.device
        self.cache, self.lo, self.hi = cache, slots[0], slots[-1] + 1
        at = [cache.lengths[s] for s in slots]
        self.full = len(slots) == self.hi - self.lo  # no dummies: the tokens are neighbours
        self.offset = offsets[0]
        source = [offsets[0]] * (self.hi - self.lo)  # each row's token in the input
        for slot, offset in zip(slots, offsets, strict=True):
            source[slot - self.lo] = offset
        self.source = torch.tensor(source, device=device)
        self.rows = torch.tensor([s - self.lo for s in slots], device=device)
        self.offsets = torch.tensor(offsets, device=device)
        # where each new key goes in cache.k[layer] viewed as [slots*H*capacity, d_head]
        H, capacity = cache.k.shape[2], cache.capacity
        heads = torch.arange(H, device=device)
        entries = at if cache.window is None else [n % capacity for n in at]  # a ring's
        starts = [s * H * capacity + n for s, n in zip(slots, entries, strict=True)]
        base = torch.tensor(starts, device=device)
        self.writes = (base[:, None] + heads * capacity).flatten()  # [rows*H]
        S = min(max(at) + 1, capacity)
        mask = torch.zeros(self.hi - self.lo, 1, 1, S, dtype=torch.bool, device=device)
        mask[:, :, :, 0] = True
        lengths = torch.tensor(at, device=device)[:, None]  # [rows,1]
        if cache.window is None:
            seen = torch.arange(S, device=device) <= lengths
        else:  # each row's window of the positions its ring holds
            keys = held(lengths + 1, capacity, device)[:, :S]  # [rows,S]
            seen = window_mask(lengths, keys, cache.window)
        mask[self.rows] = seen.reshape(len(at), 1, 1, S)
        self.mask = mask  # [hi-lo,1,1,S]

    def take(self, x: Tensor) -> Tensor:
        """This group's part of x [1,H,N,dh]: [hi-lo,H,1,dh]."""
        if self.full:
            part = x[0, :, self.offset : self.offset + self.hi - self.lo]  # [H,rows,dh]
        else:
            part = x[0].index_select(1, self.source)
        return part.transpose(0, 1).unsqueeze(2)

    def put(self, out: Tensor, z: Tensor) -> None:
        """Write the group's rows of z [hi-lo,H,1,dh] into their places in out [1,H,N,dh]."""
        rows = z[:, :, 0] if self.full else z[self.rows, :, 0]  # [rows,H,dh]
        out[0].index_copy_(1, self.offsets, rows.transpose(0, 1))

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store each slot's k, v (rows of [hi-lo,H,1,d_head]) at its own length; return the
        keys and values of the range, [hi-lo,H,S,d_head] (views, no copy)."""
        S, d_head = self.mask.shape[-1], k.shape[-1]
        for new, store in ((k, self.cache.k[layer]), (v, self.cache.v[layer])):
            new = new[:, :, 0] if self.full else new[self.rows, :, 0]  # [rows,H,d_head]
            store.view(-1, d_head).index_copy_(0, self.writes, new.reshape(-1, d_head))
        keys = self.cache.k[layer, self.lo : self.hi, :, :S]
        return keys, self.cache.v[layer, self.lo : self.hi, :, :S]


class SlotPass:
    """The cache of one ragged pass (the model's `Cache` interface): the attention groups
    of its rows, each row's positions, and which fed token is each row's last."""

    def __init__(self, cache: SlotCache, slots: list[int], counts: list[int]) -> None:
        if len(slots) != len(counts) or not slots or min(counts) < 1:
            raise ValueError("a pass feeds one or more tokens to each of one or more slots")
        if sorted(set(slots)) != list(slots):
            raise ValueError(f"slots must rise and not repeat: {slots}")
        self.cache, self.slots, self.counts = cache, list(slots), list(counts)
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        self.lasts = [o + c - 1 for o, c in zip(offsets, counts, strict=True)]  # each slot's last
        starts = [cache.lengths[s] for s in slots]
        self.longest = max(s + c for s, c in zip(starts, counts, strict=True))
        if self.longest > cache.capacity and cache.window is None:  # a ring holds the last
            raise ValueError(
                f"KV cache holds {cache.capacity} positions; {self.longest} were asked for"
            )
        bands: list[Band] = []
        for slot, start, count, offset in zip(slots, starts, counts, offsets, strict=True):
            band = bands[-1] if bands else None
            if band and band.hi == slot and (band.length, band.count) == (start, count):
                band.hi += 1
            else:
                bands.append(Band(cache, slot, start, count, offset))
        ones = [b for b in bands if b.count == 1]
        self.groups: list[Band | Ragged] = [b for b in bands if b.count > 1]
        if len(ones) == 1:  # neighbours at one length (or a single row): no mask needed
            self.groups += ones
        elif ones:
            one = [(s, o) for s, c, o in zip(slots, counts, offsets, strict=True) if c == 1]
            self.groups.append(Ragged(cache, *map(list, zip(*one, strict=True))))
        fed = [start + i for start, count in zip(starts, counts, strict=True) for i in range(count)]
        self.fed_positions = torch.tensor([fed], device=cache.k.device)  # [1,N]

    def positions(self, T: int, device: torch.device) -> Tensor:
        return self.fed_positions  # [1,N]: each fed token's position in its own row

    def end(self, T: int) -> int:
        return self.longest

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, attend: Attend
    ) -> Tensor:
        """q, k, v [1,H,N,dh] -> heads [1,H,N,dh], each group attending to its own keys."""
        if mask is not None:
            raise ValueError("rows of a SlotCache have no padding: give no attention_mask")
        out = torch.empty_like(q)
        for group in self.groups:
            keys, values = group.update(layer, group.take(k), group.take(v))
            group.put(out, attend(group.take(q), keys, values, group.mask))
        return out

    def advance(self, T: int) -> None:
        for slot, count in zip(self.slots, self.counts, strict=True):
            self.cache.lengths[slot] += count

    def last(self, x: Tensor) -> Tensor:
        return x[:, self.lasts]  # [1,rows,d]
