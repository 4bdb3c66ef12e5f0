"""A split stored as several token files (shards), read as the one stream they make.

`tlm prepare --shard-tokens N` writes each split as `train-00000.bin`, `train-00001.bin`,
... of at most N tokens, listed in order in meta.json, so that no file need be larger than
a filesystem, a download or a memory map likes. `ShardedTokens` puts them back together
for the loader: it has a length and answers slices and integer-array indexing exactly as
the memory map of the single file would, so windows are drawn across shards (one may
straddle two) and a sharded folder gives the very batches of an unsharded one.
"""

from __future__ import annotations

import numpy as np


class ShardedTokens:
    """Memory-mapped shards read as one array of tokens (len, slices, integer indexing)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        # shard k holds tokens [starts[k], starts[k+1])
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return self[np.arange(start, stop, step)]
        index = np.asarray(index)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"token index out of range for {len(self)} tokens")
        shard = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty(index.shape, dtype=self.dtype)
        for k in np.unique(shard):
            where = shard == k
            out[where] = self.parts[k][index[where] - self.starts[k]]
        return out


def write_shards(stream, n_tokens: int, dtype: np.dtype, shard_tokens: int, name: str, folder):
    """Copy `n_tokens` tokens from the open file `stream` into `folder/name-00000.bin`, ...
    of at most `shard_tokens` each; returns the index entries [{"file", "tokens"}]."""
    shards, left, k = [], n_tokens, 0
    itemsize = np.dtype(dtype).itemsize
    while left > 0 or not shards:
        n = min(left, shard_tokens)
        path = folder / f"{name}-{k:05d}.bin"
        with open(path, "wb") as dst:
            todo = n * itemsize
            while todo:
                block = stream.read(min(todo, 1 << 24))
                dst.write(block)
                todo -= len(block)
        shards.append({"file": path.name, "tokens": n})
        left, k = left - n, k + 1
    return shards
