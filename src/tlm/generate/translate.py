"""Decoding the encoder-decoder: greedy and beam search, then sentences in and out.

The source is encoded once; the decoder then runs one token per step on its KV cache,
whose cross-attention keys and values are projected from the encoder's output at the
first step and kept (`KVCache.cross`). The decoder starts from <|endoftext|> and stops at
the next <|endoftext|> (or `max_new_tokens`).

Beam search keeps `beams` hypotheses per source (Vaswani et al. §6.1: beam 4, length
penalty α = 0.6). Each step ranks the 2·beams best continuations of the live ones; an
<|endoftext|> among the first `beams` of them finishes a hypothesis, scored by its log
probability divided by Wu et al.'s length penalty ((5 + |Y|) / 6)^α; the others, best first,
become the next live beams. A source is done when it has `beams` finished hypotheses, and
its best one is the translation. With beams = 1 this is greedy decoding exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tlm.generate.sampling import GenerationError
from tlm.model.encoder_decoder import EncoderDecoder
from tlm.model.kv_cache import KVCache
from tlm.tokenizer import Tokenizer


def length_penalty(length: int, alpha: float) -> float:
    """((5 + |Y|) / 6)^α (Wu et al. 2016, eq. 14); 1 for α = 0."""
    return ((5 + length) / 6) ** alpha


def _limit(model: EncoderDecoder, src: Tensor, max_new_tokens: int | None) -> int:
    """Target tokens a step may reach: the source's length + 50 (or as given), within the
    context (the start token takes one position)."""
    wanted = src.shape[1] + 50 if max_new_tokens is None else max_new_tokens
    return min(wanted, model.config.context_length - 1)


@torch.no_grad()
def greedy_translate(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    eot: int,
    max_new_tokens: int | None = None,
) -> list[list[int]]:
    """Source ids [B,S] (right-padded, `src_mask` 1 for tokens) -> each row's target ids, the
    most probable token at every step, without the final <|endoftext|>."""
    B, limit = src.shape[0], _limit(model, src, max_new_tokens)
    memory = model.encode(src, src_mask)
    cache = KVCache(model.config, B, capacity=limit + 1, device=src.device)
    token = torch.full((B, 1), eot, dtype=torch.long, device=src.device)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for _ in range(limit):
        logits = model.decode(token, memory, src_mask, cache, last_only=True)  # [B,1,V]
        token = logits[:, -1].argmax(-1, keepdim=True)
        for b, t in enumerate(token[:, 0].tolist()):
            if not done[b]:
                done[b] = t == eot
                if not done[b]:
                    out[b].append(t)
        if all(done):
            break
    return out


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
    """Beam search (module docstring) -> each row's best target ids, without <|endoftext|>."""
    if beams < 1:
        raise GenerationError(f"beams must be at least 1, got {beams}")
    B, K, limit = src.shape[0], beams, _limit(model, src, max_new_tokens)
    memory = model.encode(src, src_mask).repeat_interleave(K, dim=0)  # [B*K,S,d]
    mask = None if src_mask is None else src_mask.repeat_interleave(K, dim=0)
    cache = KVCache(model.config, B * K, capacity=limit + 1, device=src.device)
    sequences: list[list[int]] = [[] for _ in range(B * K)]  # row b*K + k: beam k of source b
    scores = torch.full((B, K), float("-inf"), device=src.device)
    scores[:, 0] = 0.0  # one live beam at first: the others would repeat it
    token = torch.full((B * K, 1), eot, dtype=torch.long, device=src.device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    for _ in range(limit):
        logits = model.decode(token, memory, mask, cache, last_only=True)[:, -1].float()
        V = logits.shape[-1]
        total = scores.view(-1, 1) + torch.log_softmax(logits, dim=-1)  # [B*K,V]
        top, index = total.view(B, K * V).topk(2 * K, dim=1)  # the 2K best continuations
        rows, tokens, new_scores = [], [], []
        for b in range(B):
            live: list[tuple[int, int, float]] = []
            for rank, (score, i) in enumerate(zip(top[b].tolist(), index[b].tolist(), strict=True)):
                row, t = b * K + i // V, i % V
                if len(finished[b]) >= K or score == float("-inf"):
                    break
                if t == eot:
                    if rank < K:  # an end among the K best finishes a hypothesis
                        penalty = length_penalty(len(sequences[row]) + 1, alpha)  # with the end
                        finished[b].append((score / penalty, sequences[row]))
                elif len(live) < K:
                    live.append((row, t, score))
            live += [(b * K, eot, float("-inf"))] * (K - len(live))  # dead rows, never chosen
            for row, t, score in live:  # done sources keep dummies (-inf) until all are
                rows.append(row)
                tokens.append(t)
                new_scores.append(score if len(finished[b]) < K else float("-inf"))
        sequences = [[*sequences[r], t] for r, t in zip(rows, tokens, strict=True)]
        cache.reorder(torch.tensor(rows, device=src.device))
        token = torch.tensor(tokens, device=src.device).view(-1, 1)
        scores = torch.tensor(new_scores, device=src.device).view(B, K)
        if all(len(f) >= K for f in finished):
            break
    for b in range(B):  # the length limit: live beams end there
        if len(finished[b]) < K:
            for k in range(K):
                if scores[b, k] > float("-inf"):
                    penalty = length_penalty(len(sequences[b * K + k]), alpha)
                    finished[b].append((scores[b, k].item() / penalty, sequences[b * K + k]))
    return [max(f, key=lambda h: h[0])[1] for f in finished]


def encode_sources(
    tokenizer: Tokenizer, sentences: Sequence[str], context_length: int
) -> list[list[int]]:
    """Each sentence's ids and <|endoftext|>, as training saw them; one too long for the
    context is an error naming it."""
    out = []
    for n, sentence in enumerate(sentences, start=1):
        ids = [*tokenizer.encode(sentence.strip()), tokenizer.eot_id]
        if len(ids) > context_length:
            raise GenerationError(
                f"sentence {n} has {len(ids)} tokens; the model reads at most {context_length}"
            )
        out.append(ids)
    return out


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
    device = model.embedding.E.device
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
        eot = tokenizer.eot_id
        if beams == 1:
            targets = greedy_translate(model, src, mask, eot, max_new_tokens)
        else:
            targets = beam_translate(model, src, mask, eot, beams, alpha, max_new_tokens)
        for i, target in zip(chunk, targets, strict=True):
            out[i] = tokenizer.decode(target)
    return out
