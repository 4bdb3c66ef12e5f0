"""Conversations packed into context windows: what chat training and chat evaluation read.

A `ChatData` split's conversations go whole into windows of T positions, best fit first,
largest first (`pack`): a conversation of n tokens takes n - 1 positions (its inputs; the
targets are the same tokens one ahead), and padding fills what is left. In a window, a
conversation attends only to itself and its positions count from 0
(`TransformerLM(documents=...)`), so it is learned exactly as if it were alone. One longer
than the window is cut after the last assistant turn that fits whole (a user turn after it
would teach nothing) or, when even the first assistant turn does not fit, dropped; both are
counted. Training (`train/chat.py`) and `tlm eval --task chat` (`tasks/chat.py`) both pack
here, and both score the packed windows with `model/loss.py: packed_nll`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from tlm.data.tokens import ChatData


@dataclass
class Packed:
    """A split's conversations in windows of T positions: each window's conversations as
    (first token in the split, tokens kept), the learned targets of each window, and the
    counts of what packing did. `batch` builds the tensors of some windows, when asked: a
    split of any size costs memory for its conversations' places, not for its windows."""

    tokens: np.ndarray  # the split's ids (memory-mapped)
    mask: np.ndarray  # and its loss mask
    windows: list[list[tuple[int, int]]]
    supervised: np.ndarray  # [W]: the learned targets of each window
    T: int
    pad_id: int
    conversations: int  # packed, whole or cut
    cut: int  # cut after their last whole assistant turn that fits
    dropped: int  # whose first assistant turn does not fit
    padding: float  # the share of window positions that are padding

    def __len__(self) -> int:
        return len(self.windows)

    def batch(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Windows `rows` as inputs [B,T], targets [B,T] (the inputs one ahead; pad_id on
        padding), learned [B,T] (bool: the target is learned, the chat mask's 1s; never on
        padding) and documents [B,T] (a conversation's number within its window; -1 on
        padding)."""
        B, T = len(rows), self.T
        inputs = torch.full((B, T), self.pad_id, dtype=torch.long)
        targets = torch.full((B, T), self.pad_id, dtype=torch.long)
        learned = torch.zeros((B, T), dtype=torch.bool)
        documents = torch.full((B, T), -1, dtype=torch.long)
        for r, w in enumerate(rows):
            at = 0
            for number, (first, n) in enumerate(self.windows[w]):
                ids = torch.from_numpy(self.tokens[first : first + n].astype(np.int64))
                span = slice(at, at + n - 1)  # n tokens: n - 1 inputs and targets
                inputs[r, span], targets[r, span] = ids[:-1], ids[1:]
                learned[r, span] = torch.from_numpy(self.mask[first + 1 : first + n].astype(bool))
                documents[r, span] = number
                at += n - 1
        return inputs, targets, learned, documents


def fitted(ids: np.ndarray, mask: np.ndarray, T: int, end_id: int) -> int:
    """How many tokens of a conversation go into a window of T positions: all n if
    n - 1 <= T, else up to the last assistant `<|end|>` (a learned one) within the first
    T + 1 tokens, else 0 (dropped)."""
    if len(ids) - 1 <= T:
        return len(ids)
    head_ids, head_mask = ids[: T + 1], mask[: T + 1]
    ends = np.flatnonzero((head_ids == end_id) & (head_mask == 1))
    return int(ends[-1]) + 1 if len(ends) else 0


def best_fit(lengths: list[int], T: int) -> list[list[int]]:
    """Indices of `lengths` in bins of total at most T: largest first, each into the bin it
    fills most tightly (best-fit decreasing), a new bin when none has room."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (space left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k == len(room):
            bins.append([i])
            bisect.insort(room, (T - lengths[i], len(bins) - 1))
        else:
            left, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (left - lengths[i], b))
    return bins


def pack(data: ChatData, split: str, T: int, end_id: int, pad_id: int) -> Packed:
    """The conversations of `split` packed into windows of T positions."""
    tokens, mask, offsets = data.split(split), data.mask(split), data.offsets(split)
    pieces, learned, cut, dropped = [], [], 0, 0  # (first token, tokens kept) of each kept
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        n = fitted(tokens[a:b], mask[a:b], T, end_id)
        cut, dropped = cut + (0 < n < b - a), dropped + (n == 0)
        if n > 1:
            pieces.append((a, n))
            learned.append(int(mask[a + 1 : a + n].sum(dtype=np.int64)))  # its targets' mask
    bins = best_fit([n - 1 for _, n in pieces], T)
    windows = [[pieces[i] for i in members] for members in bins]
    supervised = np.array([sum(learned[i] for i in members) for members in bins], dtype=np.int64)
    used = sum(n - 1 for _, n in pieces)
    padding = 1 - used / max(1, len(bins) * T)
    return Packed(tokens, mask, windows, supervised, T, pad_id, len(pieces), cut, dropped, padding)
