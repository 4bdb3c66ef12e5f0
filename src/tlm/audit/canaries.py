"""The exposure of a canary (Carlini et al. 2019, "The Secret Sharer"): how much more likely
a model finds a planted secret than the other secrets of its format.

A canary `my PIN is 493817` has a space R of candidates, the same text with every string of
six digits (|R| = 10^6). Ranking the candidates by the model's log-likelihood of the whole
text (as a document: after <|endoftext|>), the canary's rank r gives its exposure

    exposure = log2 |R| - log2 r,

0 for the least likely candidate's rank |R|, and log2 |R| (about 19.9 bits here) when the
canary is the model's first choice. Where R is small enough it is scored whole and the rank
is exact; otherwise `samples` candidates drawn uniformly estimate the share of R the model
prefers to the canary, and r = 1 + that share · (|R| - 1). Where none of them is preferred
the share is below 1/samples, and it is taken from a normal distribution fitted to the
samples' log-likelihoods (the paper fits a skew-normal). A model that never saw the canary
ranks it anywhere: its exposure is about 1 bit on average.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tlm.audit.extraction import AuditError
from tlm.device import placement
from tlm.generate import GenerationConfig, generate
from tlm.tokenizer import Tokenizer, document_ids


@dataclass
class Exposure:
    exposure: float  # bits
    max_exposure: float  # log2 |R|
    rank: float  # the canary's rank among the candidates (estimated where sampled)
    enumerated: bool  # every candidate scored: the rank is exact


def secret_of(canary: str) -> tuple[str, str]:
    """(the text before the secret, the secret): the digits that end the canary."""
    found = re.fullmatch(r"(.*?)(\d+)", canary, re.S)
    if found is None or not found.group(1):
        raise AuditError(
            f"a canary is a text that ends in digits, such as 'my PIN is 493817'; got {canary!r}"
        )
    return found.group(1), found.group(2)


def text_logprobs(
    model: nn.Module, tokenizer: Tokenizer, texts: list[str], batch_size: int = 256
) -> np.ndarray:
    """log P(text) of each text as a document, Σ_i log P(w_i | <|endoftext|> w_<i): [n]."""
    device = placement(model)[0]
    out = []
    for lo in range(0, len(texts), batch_size):
        rows = [document_ids(tokenizer, text) for text in texts[lo : lo + batch_size]]
        longest = max(map(len, rows))
        if longest > model.config.context_length:
            raise AuditError(
                f"a text of {longest} tokens is longer than the model's context "
                f"({model.config.context_length})"
            )
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row)
        lengths = torch.tensor([len(row) for row in rows])
        ids = ids.to(device)
        with torch.no_grad():  # right padding: no real token sees it
            logprobs = F.log_softmax(model(ids)[:, :-1].float(), dim=-1)
        picked = logprobs.gather(2, ids[:, 1:, None])[..., 0].cpu()  # [B,T-1]
        real = torch.arange(longest - 1)[None] < (lengths[:, None] - 1)
        out.append((picked * real).sum(dim=1).double().numpy())
    return np.concatenate(out)


def exposure(
    model: nn.Module,
    tokenizer: Tokenizer,
    canary: str,
    samples: int = 2000,
    enumerate_up_to: int = 10_000,
    seed: int = 0,
    batch_size: int = 256,
) -> Exposure:
    """The canary's exposure under `model` (see the module): exact where the candidate space
    has at most `enumerate_up_to` members, else estimated from `samples` candidates."""
    prefix, secret = secret_of(canary)
    space, n = 10 ** len(secret), len(secret)
    mine = text_logprobs(model, tokenizer, [canary], batch_size)[0]
    if space <= enumerate_up_to:
        others = [prefix + f"{i:0{n}d}" for i in range(space) if f"{i:0{n}d}" != secret]
        better = int((text_logprobs(model, tokenizer, others, batch_size) > mine).sum())
        rank, enumerated = 1.0 + better, True
    else:
        rng = np.random.default_rng(seed)
        drawn = rng.integers(0, space, samples)
        others = [prefix + f"{i:0{n}d}" for i in drawn if f"{i:0{n}d}" != secret]
        scores = text_logprobs(model, tokenizer, others, batch_size)
        share = float((scores > mine).mean()) or _normal_tail(scores, mine)
        rank, enumerated = 1.0 + share * (space - 1), False
    most = math.log2(space)
    return Exposure(most - math.log2(rank), most, rank, enumerated)


def _normal_tail(scores: np.ndarray, mine: float) -> float:
    """P(score > mine) under a normal fitted to the sampled scores: where no sampled
    candidate beats the canary, the share is below 1/samples, and the paper extrapolates it
    from a fitted distribution in the same way (it fits a skew-normal)."""
    spread = float(scores.std())
    if spread == 0.0:
        return 0.0
    z = torch.tensor((mine - float(scores.mean())) / spread, dtype=torch.float64)
    return float(torch.special.log_ndtr(-z).exp())


def extracted(model: nn.Module, tokenizer: Tokenizer, canary: str) -> bool:
    """Whether greedy decoding after the canary's text before its secret (as a document,
    without the space that begins the secret's token) gives the secret back."""
    prefix, secret = secret_of(canary)
    start = prefix.rstrip()
    ids = torch.tensor([document_ids(tokenizer, start)], device=placement(model)[0])
    wanted = prefix[len(start) :] + secret
    config = GenerationConfig(max_new_tokens=len(wanted) + 1, eos_token_id=())
    tokens = [step.lists()[0][0] for step in generate(model, ids, config)]
    return tokenizer.decode(tokens).startswith(wanted)
