"""Scoring continuations (§10.7): how likely is a continuation after a context?

Every task of §10.7 is word prediction: the answer is the continuation the model finds most
probable. `score` returns, per continuation, the log-probability of each of its tokens given
the context and the tokens before it, their sum, whether it is what greedy decoding would
produce, and its size in tokens and UTF-8 bytes.

The boundary between context and continuation (the rule lm-evaluation-harness uses): a
context's trailing whitespace belongs to the continuation ("...is:" + " positive"). The whole
text is encoded at once and split at the context's own tokens, so a BPE merge across the
boundary is scored as part of the continuation. Every context starts after <|endoftext|>,
as documents do in training. The context is run once into a KV cache, which all its
continuations then share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tlm.device import placement
from tlm.errors import UserError
from tlm.model import TransformerLM
from tlm.model.kv_cache import KVCache
from tlm.tokenizer import Tokenizer, within


class TaskError(UserError):
    """Input a task cannot use; the message says which and why."""


@dataclass
class Scored:
    continuation: str
    tokens: list[int]
    logprobs: list[float]  # log P(token | context, the continuation's tokens before it)
    greedy: bool  # every token is the argmax at its position
    bytes: int  # UTF-8 bytes of the continuation

    @property
    def logprob(self) -> float:
        return sum(self.logprobs)


def split_at_context(context: str, continuation: str) -> tuple[str, str]:
    """Move the context's trailing whitespace to the front of the continuation."""
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + continuation


def encode_pair(
    tokenizer: Tokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """(<|endoftext|> + the context's tokens, the continuation's tokens), split as above."""
    context, continuation = split_at_context(context, continuation)
    whole, alone = tokenizer.encode(context + continuation), tokenizer.encode(context)
    n = len(alone)  # a merge across the boundary (rare): split where the two first differ
    n = next((i for i, (a, b) in enumerate(zip(whole, alone, strict=False)) if a != b), n)
    if len(whole) == n:
        raise TaskError(f"continuation {continuation!r} tokenizes to nothing")
    return [tokenizer.eot_id, *whole[:n]], whole[n:]


@torch.no_grad()
def score(
    model: TransformerLM, tokenizer: Tokenizer, context: str, continuations: list[str]
) -> list[Scored]:
    """Score every continuation after `context` (one prefill, then all continuations at once)."""
    if not continuations:
        raise TaskError("no continuations to score")
    pairs = [encode_pair(tokenizer, context, c) for c in continuations]
    for ctx, cont in pairs:  # the last token is predicted, never read
        within(ctx + cont[:-1], model.config.context_length, "the context with a continuation")
    device = placement(model)[0]
    groups: dict[tuple[int, ...], list[int]] = {}  # the contexts differ only if the split did
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx), []).append(i)
    out: list[Scored | None] = [None] * len(pairs)
    for ctx, rows in groups.items():
        ctx = list(ctx)
        conts = [pairs[i][1] for i in rows]
        for i, scored in zip(rows, _score_one_context(model, ctx, conts, device), strict=True):
            out[i] = Scored(continuations[i], *scored, len(tokenizer.decode(pairs[i][1]).encode()))
    return out


def score_tokens(
    model: TransformerLM, pairs: list[tuple[list[int], list[int]]]
) -> list[tuple[list[float], bool]]:
    """(log P of each continuation token given the context and the tokens before it, whether
    each was the model's argmax) for every (context ids, continuation ids), the context read
    as given; pairs that share a context share its prefill."""
    device = placement(model)[0]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx), []).append(i)
    out: list[tuple[list[float], bool] | None] = [None] * len(pairs)
    for ctx, rows in groups.items():
        conts = [pairs[i][1] for i in rows]
        for i, (_, logprobs, greedy) in zip(
            rows, _score_one_context(model, list(ctx), conts, device), strict=True
        ):
            out[i] = (logprobs, greedy)
    return out


def _score_one_context(
    model: TransformerLM, ctx: list[int], conts: list[list[int]], device: torch.device
) -> list[tuple[list[int], list[float], bool]]:
    n, width = len(conts), max(len(c) for c in conts)
    cache = KVCache(model.config, 1, len(ctx) + width, next(model.parameters()).dtype, device)
    first = model(torch.tensor([ctx], device=device), cache, last_only=True)[:, -1]  # [1,V]
    cache.reorder(torch.zeros(n, dtype=torch.long, device=device))  # one copy per continuation
    batch = torch.tensor([c + [0] * (width - len(c)) for c in conts], device=device)  # right pad
    logits = first.expand(n, -1)[:, None]  # [n,1,V]: the first token given the context
    if width > 1:  # the rest, each given the context and the continuation's tokens before it
        logits = torch.cat([logits, model(batch[:, :-1], cache)], dim=1)
    logprobs = logits.float().log_softmax(dim=-1)  # [n, width, V]: position j predicts token j
    chosen = logprobs.gather(2, batch[:, :, None])[..., 0]  # [n, width]
    greedy = logprobs.argmax(dim=-1) == batch
    return [
        (c, chosen[r, : len(c)].tolist(), bool(greedy[r, : len(c)].all()))
        for r, c in enumerate(conts)
    ]


def score_reference(model: TransformerLM, ids: Tensor, n_context: int) -> Tensor:
    """The plain way, for tests: one forward pass of context + continuation [1, S]; the
    log-probs of tokens n_context.. given everything before them."""
    with torch.no_grad():
        logprobs = model(ids).float().log_softmax(dim=-1)[0]  # [S, V]
    return logprobs[n_context - 1 : -1].gather(1, ids[0, n_context:, None])[:, 0]
