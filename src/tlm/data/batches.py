"""Batches of context windows cut from a token stream (J&M §10.9.1).

Training draws windows at random offsets of the packed stream (or, with
`--windows documents`, at the documents' first tokens); the offsets of step s come
from a generator seeded by (seed, step, micro-batch), so a resumed run sees exactly the
batches an uninterrupted one would. Evaluation walks the stream in non-overlapping windows
so that every token after the first is predicted exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from tlm.data.corpus import CorpusError


def batch_generator(seed: int, step: int, micro: int = 0) -> torch.Generator:
    """A generator that depends only on (seed, step, micro): the data order is resumable."""
    state = np.random.SeedSequence([seed, step, micro]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def random_windows(
    tokens: np.ndarray, batch_size: int, T: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Inputs x [B,T] and targets y [B,T] = x shifted left by one (teacher forcing), int64."""
    return windows_at(tokens, window_starts(len(tokens), batch_size, T, generator), T)


def window_starts(
    n_tokens: int,
    count: int,
    T: int,
    generator: torch.Generator,
    choices: np.ndarray | None = None,
) -> np.ndarray:
    """`count` random offsets of windows of T + 1 tokens in a stream of `n_tokens`, or
    drawn from the offsets `choices` (`document_starts`)."""
    if n_tokens < T + 1:
        raise CorpusError(f"{n_tokens} tokens are fewer than one window of {T} + 1")
    if choices is not None:
        return choices[torch.randint(0, len(choices), (count,), generator=generator).numpy()]
    return torch.randint(0, n_tokens - T, (count,), generator=generator).numpy()


def document_starts(tokens: np.ndarray, eot_id: int, T: int, chunk: int = 1 << 24) -> np.ndarray:
    """The offsets of the documents' first tokens (each document is <|endoftext|>, then its
    text, as `prepare` writes it) from which a window of T + 1 tokens fits in the stream."""
    found = [
        np.flatnonzero(np.asarray(tokens[at : at + chunk]) == eot_id) + at
        for at in range(0, len(tokens), chunk)
    ]
    starts = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    starts = starts[starts + T + 1 <= len(tokens)]
    if len(starts) == 0:
        raise CorpusError(f"no document starts a window of {T} + 1 tokens in the stream")
    return starts


def step_starts(
    n_tokens: int,
    T: int,
    seed: int,
    step: int,
    batch_size: int,
    micro: int,
    choices: np.ndarray | None = None,
):
    """The window offsets of one optimizer step's global batch: `micro` draws of
    `batch_size`, each from the generator of (seed, step, draw), at random offsets or among
    `choices`. However many processes share the batch, it is this one (each takes a
    slice)."""
    return np.concatenate(
        [
            window_starts(n_tokens, batch_size, T, batch_generator(seed, step, m), choices)
            for m in range(micro)
        ]
    )


def windows_at(tokens: np.ndarray, starts: np.ndarray, T: int) -> tuple[Tensor, Tensor]:
    """The windows of T + 1 tokens at `starts`, as inputs x [B,T] and targets y [B,T]."""
    window = torch.from_numpy(tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64))
    return window[:, :-1], window[:, 1:]  # [B,T+1] -> x [B,T], y [B,T]


def eval_windows(
    tokens: np.ndarray, T: int, max_tokens: int | None = None, chunk: int = 1024
) -> Iterator[Tensor]:
    """Windows [N, T+1] overlapping by one token, so each token after the first is a target once.

    Yields the full windows `chunk` at a time (memory stays bounded for any split), then the
    remainder as a window [1, r+1]; at most `max_tokens` targets in all.
    """
    n_targets = max(0, len(tokens) - 1)
    if max_tokens is not None:
        n_targets = min(n_targets, max_tokens)
    n_full, rest = divmod(n_targets, T)
    for first in range(0, n_full, chunk):
        starts = np.arange(first, min(first + chunk, n_full)) * T
        index = starts[:, None] + np.arange(T + 1)  # [N, T+1]
        yield torch.from_numpy(tokens[index].astype(np.int64))
    if rest:
        yield torch.from_numpy(tokens[n_full * T : n_full * T + rest + 1].astype(np.int64))[None]


def count_eval_chunks(n_tokens: int, T: int, chunk: int = 1024) -> int:
    """How many tensors `eval_windows` yields for `n_tokens` tokens (for progress bars)."""
    n_full, rest = divmod(max(0, n_tokens - 1), T)
    return -(-n_full // chunk) + (rest > 0)


def strided_windows(n_tokens: int, T: int, stride: int) -> list[tuple[int, int, int]]:
    """Rolling windows over a stream of `n_tokens`: (start, length, first scored position).

    Window k holds tokens [k·stride, k·stride + length) and predicts each of them after the
    first; only targets no earlier window scored count, so each window's first T − stride
    predictions are context only and every token after the first is scored exactly once,
    with at least T − stride tokens before it (all of them up to T with stride 1). Stride T
    gives the non-overlapping windows of `eval_windows`.
    """
    if not 1 <= stride <= T:
        raise CorpusError(f"stride must be in [1, {T}] (the context length), got {stride}")
    windows, scored = [], 0  # targets 1..scored are done
    for start in range(0, max(1, n_tokens - 1), stride):
        length = min(T + 1, n_tokens - start)  # T inputs and the token after them
        end = start + length - 1  # the last target of this window
        if end > scored:
            windows.append((start, length, scored - start))  # predictions from this index on
            scored = end
        if end == n_tokens - 1:
            break
    return windows
