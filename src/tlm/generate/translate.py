"""Decoding the encoder-decoder: greedy and beam search, then sentences in and out.

The source is encoded once; the decoder then runs one token per step on its KV cache,
whose cross-attention keys and values are projected from the encoder's output at the
first step and kept (`KVCache.cross`). The decoder starts from <|endoftext|> and stops at
the next <|endoftext|> (or `max_new_tokens`).

The search is the language model's (`beam.search`) with `beams` hypotheses per source
(Vaswani et al. §6.1: beam 4, length penalty α = 0.6) and Wu et al.'s length penalty
((5 + |Y|) / 6)^α. With beams = 1 this is greedy decoding exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tlm.device import placement
from tlm.generate.beam import search
from tlm.generate.errors import GenerationError
from tlm.model.encoder_decoder import EncoderDecoder
from tlm.model.kv_cache import KVCache
from tlm.tokenizer import Tokenizer, within


def length_penalty(length: int, alpha: float) -> float:
    """((5 + |Y|) / 6)^α (Wu et al. 2016, eq. 14); 1 for α = 0."""
    return ((5 + length) / 6) ** alpha


def _limit(model: EncoderDecoder, src: Tensor, max_new_tokens: int | None) -> int:
    """Target tokens a step may reach: the source's length + 50 (or as given), within the
    context (the start token takes one position)."""
    wanted = src.shape[1] + 50 if max_new_tokens is None else max_new_tokens
    return min(wanted, model.config.context_length - 1)


class TargetBeams:
    """The decoder's state for B sources, K rows each (`beam.Beams`): the encoder's output,
    read by every row of its source, the KV cache, and each row's last token."""

    def __init__(
        self,
        model: EncoderDecoder,
        src: Tensor,
        src_mask: Tensor | None,
        K: int,
        eot: int,
        limit: int,
    ) -> None:
        self.model = model
        self.memory = model.encode(src, src_mask).repeat_interleave(K, dim=0)  # [B*K,S,d]
        self.mask = None if src_mask is None else src_mask.repeat_interleave(K, dim=0)
        B = src.shape[0]
        self.cache = KVCache(model.config, B * K, capacity=limit + 1, device=src.device)
        self.token = torch.full((B * K, 1), eot, dtype=torch.long, device=src.device)

    def next_logprobs(self) -> Tensor:
        logits = self.model.decode(self.token, self.memory, self.mask, self.cache, last_only=True)
        return logits[:, -1].float().log_softmax(dim=-1)  # [B*K,V]

    def keep(self, rows: Tensor, tokens: Tensor) -> None:
        """Rows stay within their source's K, whose memory is the same: only the cache moves."""
        self.cache.reorder(rows.to(self.token.device))
        self.token = tokens.to(self.token.device).view(-1, 1)


@torch.no_grad()
def beam_translate(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    eot: int,
    beams: int = 4,
    alpha: float = 0.6,
    max_new_tokens: int | None = None,
) -> list[list[int]]:
    """Source ids [B,S] (right-padded, `src_mask` 1 for tokens) -> each row's best target
    ids, without the final <|endoftext|>."""
    if beams < 1:
        raise GenerationError(f"beams must be at least 1, got {beams}")
    limit = _limit(model, src, max_new_tokens)
    state = TargetBeams(model, src, src_mask, beams, eot, limit)
    best = search(state, src.shape[0], beams, limit, {eot}, lambda n: length_penalty(n, alpha))
    return [h.tokens[:-1] if h.tokens and h.tokens[-1] == eot else h.tokens for h in best]


def greedy_translate(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    eot: int,
    max_new_tokens: int | None = None,
) -> list[list[int]]:
    """The most probable token at every step: the search with one beam."""
    return beam_translate(model, src, src_mask, eot, 1, 0.0, max_new_tokens)


def encode_sources(
    tokenizer: Tokenizer, sentences: Sequence[str], context_length: int
) -> list[list[int]]:
    """Each sentence's ids and <|endoftext|>, as training saw them; one too long for the
    context is an error naming it."""
    return [
        within(
            [*tokenizer.encode(sentence.strip()), tokenizer.eot_id], context_length, f"sentence {n}"
        )
        for n, sentence in enumerate(sentences, start=1)
    ]


@torch.no_grad()
def translate(
    model: EncoderDecoder,
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    beams: int = 4,
    alpha: float = 0.6,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
) -> list[str]:
    """Translate sentences, `batch_size` at a time (sorted by length, so little padding),
    returned in the given order. beams = 1 is greedy."""
    model.eval()
    device = placement(model)[0]
    ids = encode_sources(tokenizer, sentences, model.config.context_length)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str] = [""] * len(ids)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        S = max(len(ids[i]) for i in chunk)
        src = torch.zeros(len(chunk), S, dtype=torch.long, device=device)
        mask = torch.zeros(len(chunk), S, dtype=torch.long, device=device)
        for row, i in enumerate(chunk):
            src[row, : len(ids[i])] = torch.tensor(ids[i])
            mask[row, : len(ids[i])] = 1
        targets = beam_translate(model, src, mask, tokenizer.eot_id, beams, alpha, max_new_tokens)
        for i, target in zip(chunk, targets, strict=True):
            out[i] = tokenizer.decode(target)
    return out
