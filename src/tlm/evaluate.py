"""Evaluation: cross-entropy, perplexity and bits per byte of a model on tokens or text.

loss        mean negative log-likelihood per predicted token, in nats (eq. 10.51)
perplexity  exp(loss)
bits_per_byte  total nats / ln 2 / UTF-8 bytes of the predicted text; tokens that spell no
            bytes (<|endoftext|>) count in neither sum, so tokenizers can be compared
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from tlm.data import CorpusError, count_eval_chunks, eval_windows, strided_windows
from tlm.model.loss import window_nll
from tlm.tokenizer import Tokenizer, document_ids


def evaluate_tokens(
    model: nn.Module,
    tokens: np.ndarray,
    token_bytes: np.ndarray,
    batch_size: int = 32,
    max_tokens: int | None = None,
    progress: bool = False,
    stride: int | None = None,
) -> dict[str, float]:
    """Score every token of `tokens` after the first: in non-overlapping context windows, or
    with `stride` S in rolling windows that give each token at least T − S tokens of context
    (S is capped at the context length T; `data.strided_windows`)."""
    nll_sum, byte_nll_sum, n_tokens, n_bytes = 0.0, 0.0, 0, 0
    for nll, targets in _scored(model, tokens, batch_size, max_tokens, progress, stride):
        spelled = torch.from_numpy(token_bytes[targets])  # bytes of each target
        nll_sum += nll.sum().item()
        n_tokens += nll.numel()
        byte_nll_sum += nll[spelled > 0].sum().item()
        n_bytes += int(spelled.sum())
    loss = nll_sum / n_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": byte_nll_sum / math.log(2) / n_bytes if n_bytes else float("nan"),
        "tokens": n_tokens,
        "bytes": n_bytes,
    }


def _scored(model, tokens, batch_size, max_tokens, progress, stride) -> Iterator[tuple]:
    """(nll [n] float64, target ids [n]) for every scored token, chunk by chunk."""
    T = model.config.context_length
    if stride is not None and stride < T:
        yield from _strided(model, tokens, T, stride, batch_size, progress)
        return
    scored = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    chunks = tqdm(
        eval_windows(tokens, T, max_tokens),
        total=count_eval_chunks(scored, T),
        desc="evaluating",
        disable=not progress,
        leave=False,
    )
    for windows in chunks:
        nll = window_nll(model, windows, batch_size).double()  # [N, T]
        yield nll.flatten(), windows[:, 1:].flatten().numpy()


def _strided(model, tokens, T, stride, batch_size, progress) -> Iterator[tuple]:
    windows = strided_windows(len(tokens), T, stride)
    bar = tqdm(total=len(windows), desc="evaluating", disable=not progress, leave=False)
    for first in range(0, len(windows), batch_size):
        group = windows[first : first + batch_size]
        for length in sorted({w[1] for w in group}):  # the last window may be shorter
            same = [w for w in group if w[1] == length]
            batch = torch.from_numpy(np.stack([tokens[s : s + length] for s, _, _ in same]))
            nll = window_nll(model, batch.long(), batch_size).double()  # [n, length - 1]
            for row, (start, _, offset) in enumerate(same):
                targets = np.asarray(tokens[start + 1 + offset : start + length])
                yield nll[row, offset:], targets.astype(np.int64)
        bar.update(len(group))
    bar.close()


def evaluate_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    text: str | list[str],
    batch_size: int = 32,
    progress: bool = False,
    stride: int | None = None,
) -> dict[str, float]:
    """Score raw text, one document or several: each document follows <|endoftext|>, as
    `prepare` separates them, so every token of every document is predicted (and so is the
    end of each document but the last). Documents are encoded one by one, as `prepare` does."""
    documents = [text] if isinstance(text, str) else text
    ids = [i for doc in documents for i in document_ids(tokenizer, doc)]
    tokens = np.array(ids, dtype=np.int64)
    if len(tokens) - len(documents) < 2:
        n = len(tokens) - len(documents)
        raise CorpusError(f"the text has {n} token{'s' * (n != 1)}; at least 2 are needed")
    token_bytes = tokenizer.token_bytes()
    return evaluate_tokens(model, tokens, token_bytes, batch_size, None, progress, stride)
