"""A `PreferenceData` split read for training and evaluation: pairs of sequences as tensors.

Pair i is sequences 2i (the chosen answer after the prompt) and 2i + 1 (the rejected one).
A sequence of n tokens takes n - 1 positions (its inputs; the targets are the same tokens
one ahead); a pair either of whose sequences does not fit the context of T positions is
dropped and counted (an answer cut short would be preferred for what it lost). A batch of
pairs is one tensor of 2B rows, the B chosen sequences first, then their rejected ones,
right-padded: a causal model's positions never see the padding after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tlm.data.tokens import PreferenceData


@dataclass
class AnswerPairs:
    """A split's pairs that fit T positions: the (first token, length) of each one's chosen
    and rejected sequence, and how many were dropped."""

    tokens: np.ndarray  # the split's ids (memory-mapped)
    mask: np.ndarray  # and its loss mask: 1 on the answers' learned tokens
    spans: np.ndarray  # [P, 2, 2]: pair, (chosen, rejected), (first token, length)
    kept: np.ndarray  # [P]: each kept pair's number in the split
    pad_id: int
    dropped: int

    def __len__(self) -> int:
        return len(self.spans)

    def batch(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pairs `rows` as inputs [2B,L], targets [2B,L] and learned [2B,L] (bool), L the
        longest sequence's positions: rows 0..B-1 the chosen answers, B..2B-1 the rejected."""
        spans = [(int(a), int(n)) for side in (0, 1) for a, n in self.spans[rows, side]]
        L = max(n - 1 for _, n in spans)
        inputs = torch.full((len(spans), L), self.pad_id, dtype=torch.long)
        targets = torch.full((len(spans), L), self.pad_id, dtype=torch.long)
        learned = torch.zeros((len(spans), L), dtype=torch.bool)
        for r, (first, n) in enumerate(spans):
            ids = torch.from_numpy(self.tokens[first : first + n].astype(np.int64))
            inputs[r, : n - 1], targets[r, : n - 1] = ids[:-1], ids[1:]
            learned[r, : n - 1] = torch.from_numpy(self.mask[first + 1 : first + n].astype(bool))
        return inputs, targets, learned


def answer_pairs(data: PreferenceData, split: str, T: int, pad_id: int) -> AnswerPairs:
    """The pairs of `split` whose two sequences fit T positions."""
    tokens, mask, offsets = data.split(split), data.mask(split), data.offsets(split)
    starts, lengths = offsets[:-1], np.diff(offsets)
    spans = np.stack([starts, lengths], axis=-1).reshape(-1, 2, 2)  # [P, 2, 2]
    fits = (spans[:, :, 1] - 1 <= T).all(axis=1)
    kept = np.flatnonzero(fits)
    return AnswerPairs(tokens, mask, spans[kept], kept, pad_id, int((~fits).sum()))
