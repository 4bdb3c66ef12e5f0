"""Evaluation: cross-entropy, perplexity and bits per byte of a model on tokens or text.

loss        mean negative log-likelihood per predicted token, in nats (eq. 10.51)
perplexity  exp(loss)
bits_per_byte  total nats / ln 2 / UTF-8 bytes of the predicted text; tokens that spell no
            bytes (<|endoftext|>) count in neither sum, so tokenizers can be compared
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from tlm.data import count_eval_chunks, eval_windows
from tlm.model.loss import window_nll
from tlm.tokenizer import Tokenizer


def evaluate_tokens(
    model: nn.Module,
    tokens: np.ndarray,
    token_bytes: np.ndarray,
    batch_size: int = 32,
    max_tokens: int | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Score every token of `tokens` after the first, in non-overlapping context windows."""
    T = model.config.context_length
    scored = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    chunks = tqdm(
        eval_windows(tokens, T, max_tokens),
        total=count_eval_chunks(scored, T),
        desc="evaluating",
        disable=not progress,
        leave=False,
    )
    nll_sum, byte_nll_sum, n_tokens, n_bytes = 0.0, 0.0, 0, 0
    for windows in chunks:
        nll = window_nll(model, windows, batch_size).double()  # [N, T]
        spelled = torch.from_numpy(token_bytes[windows[:, 1:].numpy()])  # bytes of each target
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


def evaluate_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    text: str | list[str],
    batch_size: int = 32,
    progress: bool = False,
) -> dict[str, float]:
    """Score raw text, one document or several: each document follows <|endoftext|>, as
    `prepare` separates them, so every token of every document is predicted (and so is the
    end of each document but the last). Documents are encoded one by one, as `prepare` does."""
    documents = [text] if isinstance(text, str) else text
    ids = [i for doc in documents for i in (tokenizer.eot_id, *tokenizer.encode(doc))]
    tokens = np.array(ids, dtype=np.int64)
    return evaluate_tokens(model, tokens, tokenizer.token_bytes(), batch_size, progress=progress)
