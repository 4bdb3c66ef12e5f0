"""Decoding steps as pure functions on logits (J&M §10.8). Filtered entries become -inf.

They compose in the order users of other toolkits expect, and `choose` is the one place
that composes them:

0. a grammar's mask (structured outputs, `constrain.py`: tokens that cannot continue a
   valid output get -inf),
1. logit bias (OpenAI's `logit_bias`: a token's bias added to its logit),
2. repetition penalty (CTRL's, over the prompt and the output),
3. frequency and presence penalties (OpenAI's, over the output),
4. temperature, 5. top-k, 6. top-p,

then argmax (greedy, or temperature 0) or a draw from the softmax. Steps 0-3 change the
logits greedy decoding sees too (a bias of 100 selects its token); 4-6 shape the
distribution a sample is drawn from. Randomness is explicit: every draw takes a
`torch.Generator`. The log-probability reported for a token is the model's, before any
of these.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import Tensor

from tlm.generate.errors import GenerationError
from tlm.inference import native


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """u / τ before the softmax (eq. 10.49): τ < 1 sharpens, τ > 1 flattens, τ = 0 is greedy."""
    if temperature < 0:
        raise GenerationError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:  # the limit τ -> 0: all mass on the argmax (eq. 10.46)
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(-1, top, 0.0)
    return logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row (ties at the k-th all stay); k = 1 is greedy."""
    if k < 1:
        raise GenerationError(f"top_k must be >= 1, got {k}")
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of tokens whose probability sums to at least p (eq. 10.47).

    The most probable token always stays, so p close to 0 is greedy and p = 1 keeps all.
    """
    if not 0 < p <= 1:
        raise GenerationError(f"top_p must be in (0, 1], got {p}")
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = before >= p  # the set reached p already without this token
    drop_sorted[..., 0] = False  # the likeliest stays, even for a p below float32's range
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Make tokens already in the text less likely (Keskar et al. 2019, "CTRL").

    `seen` [B,V] is True for tokens of the prompt or the output so far; their logit is
    divided by `penalty` where positive and multiplied where negative. 1.0 changes nothing.
    """
    if penalty <= 0:
        raise GenerationError(f"repetition_penalty must be > 0, got {penalty}")
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_logit_bias(logits: Tensor, bias: tuple[tuple[int, float], ...]) -> Tensor:
    """u_j + bias_j for each (token id j, bias) given (OpenAI's `logit_bias`): [..., V]."""
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], device=logits.device)
    if int(ids.max()) >= logits.shape[-1]:
        raise GenerationError(
            f"logit_bias names token {int(ids.max())}; the vocabulary has {logits.shape[-1]}"
        )
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], len(bias)))


def apply_frequency_presence(
    logits: Tensor, counts: Tensor, frequency: float, presence: float
) -> Tensor:
    """OpenAI's penalties: u_j - c_j·α_frequency - [c_j > 0]·α_presence, where `counts` c
    [..., V] holds how often each token was generated so far (the prompt does not count).
    Positive values make repeating less likely; 0 and 0 change nothing."""
    if not frequency and not presence:
        return logits
    counts = counts.to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def adjust_logits(
    logits: Tensor,
    config,
    seen: Tensor | None = None,
    counts: Tensor | None = None,
    allowed: Tensor | None = None,
) -> Tensor:
    """Steps 0-3 of the order above, as `config` (a `GenerationConfig`) says; `allowed`
    [B,V] marks the tokens each row's grammar allows, `seen` [B,V] each row's tokens
    (prompt and output) and `counts` [B,V] counts its output."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    logits = apply_logit_bias(logits, config.logit_bias)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, config.repetition_penalty)
    if counts is not None:
        logits = apply_frequency_presence(
            logits, counts, config.frequency_penalty, config.presence_penalty
        )
    return logits


def process_logits(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """Temperature, then top-k, then top-p: the distribution a sampler draws from."""
    logits = apply_temperature(logits.float(), temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, p=top_p)
    return logits


def sample(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row from softmax(logits) [..., V] -> token ids [...]."""
    probs = logits.float().softmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return draw_rows(flat, [generator] * len(flat)).view(probs.shape[:-1])


def draw_rows(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """One token for each row of probabilities [k,V] (not necessarily normalised), row i
    drawing from generators[i]: by the inverse of its cumulative distribution, the first
    token whose cumulative mass exceeds u_i · (the row's mass), u_i ~ U[0, 1) one number
    from its generator. Every draw of tlm's is this one: 64 rows of 1,028 tokens take 0.3 ms
    on the 2-core host, `torch.multinomial` a row with its generator 4 ms. A token of
    probability 0 is never drawn. The ids [k] stay on the rows' device."""
    u = torch.cat(
        [torch.rand(1, generator=g, device=probs.device, dtype=torch.float64) for g in generators]
    )
    cdf = probs.double().cumsum(dim=-1)  # [k,V]
    mass = cdf[:, -1]
    # refused as torch.multinomial refuses it (on a GPU the check would wait on the device)
    if probs.device.type == "cpu" and not bool(torch.isfinite(mass).all() & (mass > 0).all()):
        raise RuntimeError("probability tensor contains either inf, nan or no mass")
    chosen = torch.searchsorted(cdf, (u * mass)[:, None], right=True)[:, 0]
    return chosen.clamp_(max=probs.shape[-1] - 1)


def greedy(logits: Tensor) -> Tensor:
    """ŵ = argmax_w P(w | w<t) (eq. 10.46): [..., V] -> [...]. Both libraries return the
    first of equal maxima (and a NaN as the maximum); over a GPT-2 vocabulary on a CPU
    numpy's argmax takes a tenth of torch's time, so fp32 CPU logits go through it."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def greedy_logprob(logits: Tensor) -> tuple[int, float]:
    """(ŵ, log P(ŵ)) of one row of logits [V]: the argmax (eq. 10.46) and its log-softmax.
    fp32 CPU logits take one C pass (`step.c`'s greedy_pick: the maximum, then
    -log Σ exp(u_i - max), no [V] log-softmax written), held equal to torch's in a test;
    any other logits, or logits that are not all finite, take torch's."""
    lib = native.library() if logits.device.type == "cpu" else None
    if lib is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        logprob = ctypes.c_float()
        token = lib.greedy_pick(logits.data_ptr(), logits.numel(), ctypes.byref(logprob))
        if token >= 0:
            return token, logprob.value
    token = int(greedy(logits))
    return token, float(logits.log_softmax(dim=-1)[token])


def distribution(
    logits: Tensor,
    config,
    seen: Tensor | None = None,
    counts: Tensor | None = None,
    allowed: Tensor | None = None,
) -> Tensor:
    """What a sampled token of each row is drawn from: softmax of logits [B,V] after steps
    0-6 of the order above, as `config` says -> probabilities [B,V]."""
    logits = _adjusted(logits, config, seen, counts, allowed)
    return process_logits(logits, config.temperature, config.top_k, config.top_p).softmax(-1)


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from probabilities [V] with `generator`."""
    return int(draw_rows(probs[None], [generator])[0])


def choose(
    logits: Tensor,
    config,
    generators: list[torch.Generator | None] | None = None,
    seen: Tensor | None = None,
    counts: Tensor | None = None,
    allowed: Tensor | None = None,
) -> Tensor:
    """The next token of every row: logits [B,V] -> ids [B], as `config` (a
    `GenerationConfig`) says; row b draws from generators[b], `seen` [B,V] marks each
    row's tokens so far for the repetition penalty, `counts` [B,V] counts its output
    for the frequency and presence penalties and `allowed` [B,V] marks what its grammar
    allows."""
    if config.greedy:
        return greedy(_adjusted(logits, config, seen, counts, allowed))
    probs = distribution(logits, config, seen, counts, allowed)
    # each row its own draw, left on the logits' device: no wait on a GPU until read
    if len(generators) != len(probs):
        raise ValueError(f"{len(probs)} rows to draw, {len(generators)} generators")
    return draw_rows(probs, generators)


def _adjusted(logits: Tensor, config, seen, counts, allowed) -> Tensor:
    """Steps 0-3 on fp32 logits, with what float range cannot hold made safe."""
    logits = adjust_logits(logits.float(), config, seen, counts, allowed)
    # an extreme setting (repetition_penalty 1e-38) can push a logit past float range:
    # +inf becomes the largest float (still first), NaN can never be chosen, -inf stays
    top = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=top, neginf=float("-inf"))
