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

import copy
import ctypes
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tlm.generate.errors import GenerationError
from tlm.inference import native

if TYPE_CHECKING:
    from tlm.generate.constrain import Matcher


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
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def greedy(logits: Tensor) -> Tensor:
    """ŵ = argmax_w P(w | w<t) (eq. 10.46): [..., V] -> [...]. Both libraries return the
    first of equal maxima (and a NaN as the maximum); over a GPT-2 vocabulary on a CPU
    numpy's argmax takes a tenth of torch's time, so fp32 CPU logits go through it."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.as_tensor(logits.detach().numpy().argmax(axis=-1))
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
    return int(torch.multinomial(probs[None], 1, generator=generator)[0, 0])


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
    return torch.tensor([draw(row, g) for row, g in zip(probs, generators, strict=True)])


def _adjusted(logits: Tensor, config, seen, counts, allowed) -> Tensor:
    """Steps 0-3 on fp32 logits, with what float range cannot hold made safe."""
    logits = adjust_logits(logits.float(), config, seen, counts, allowed)
    # an extreme setting (repetition_penalty 1e-38) can push a logit past float range:
    # +inf becomes the largest float (still first), NaN can never be chosen, -inf stays
    top = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=top, neginf=float("-inf"))


class RowChoice:
    """What choosing one sequence's tokens keeps from step to step: its settings, its
    random generator, the tokens seen so far (the repetition penalty, over the prompt and
    the output), the output's count of each token (the frequency and presence penalties)
    and where the output stands in its grammar; `top_logprobs` likeliest tokens are
    reported with each choice. The decoding loops that choose a row at a time (`Slots`)
    hold one per sequence; `choose` is the step."""

    def __init__(
        self,
        prompt: list[int],
        config,
        generator: torch.Generator | None,
        vocab_size: int,
        device: torch.device,
        top_logprobs: int = 0,
    ) -> None:
        if config.logit_bias and max(t for t, _ in config.logit_bias) >= vocab_size:
            token = max(t for t, _ in config.logit_bias)
            raise GenerationError(
                f"logit_bias names token {token}; the vocabulary has {vocab_size}"
            )
        self.config, self.generator, self.top_logprobs = config, generator, top_logprobs
        self.seen = self.counts = None
        if config.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt, device=device)] = True
        if config.counts_output:
            self.counts = torch.zeros(vocab_size, device=device)
        self.matcher: Matcher | None = None if config.grammar is None else config.grammar.start()
        # the likeliest token as is, with no top list to report: a step that made greedy's
        # choice itself (the whole step in C) hands it over as `pick`
        self.plain_greedy = config.greedy and not config.adjusts_logits and not top_logprobs

    def choose(
        self, logits: Tensor, pick: tuple[int, float] | None = None
    ) -> tuple[int, float, list[tuple[int, float]]]:
        """The token after logits [V]: (token, log P(token) under the model before any
        processing, the `top_logprobs` likeliest (id, log P)); `pick` is the step's own
        greedy choice (ŵ, log P(ŵ)) where it made one (token -1: logits not all finite)."""
        if not self.plain_greedy:
            allowed = self._allowed(logits)
            seen = None if self.seen is None else self.seen[None]
            counts = None if self.counts is None else self.counts[None]
            chosen = choose(logits[None], self.config, [self.generator], seen, counts, allowed)
            return self.take(logits, int(chosen[0]))
        if pick is None or pick[0] < 0:
            pick = greedy_logprob(logits.float())  # no [V] log-softmax to write
        self.record(pick[0])
        return pick[0], pick[1], []

    def probabilities(self, logits: Tensor) -> Tensor:
        """What the next token is drawn from, after logits [V], as the row stands -> [V]."""
        seen = None if self.seen is None else self.seen[None]
        counts = None if self.counts is None else self.counts[None]
        allowed = self._allowed(logits)
        return distribution(logits[None], self.config, seen, counts, allowed)[0]

    def take(self, logits: Tensor, token: int) -> tuple[int, float, list[tuple[int, float]]]:
        """`token`, chosen after logits [V] by any rule: recorded, and reported as `choose`
        reports its own."""
        logprobs = logits.float().log_softmax(dim=-1)  # the model's, before any filter
        top = []
        if self.top_logprobs:
            values, ids = logprobs.topk(min(self.top_logprobs, len(logprobs)))
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        self.record(token)
        return token, float(logprobs[token]), top

    def record(self, token: int) -> None:
        """The row's text goes on with `token`: its grammar, penalties and counts move."""
        if self.matcher is not None:
            self.matcher.accept(token)
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1

    def fork(self) -> RowChoice:
        """A copy whose penalties move on their own (a draft's proposals), drawing from the
        same generator; without the grammar, whose matcher cannot be copied."""
        other = copy.copy(self)
        other.seen = None if self.seen is None else self.seen.clone()
        other.counts = None if self.counts is None else self.counts.clone()
        other.matcher = None
        return other

    def _allowed(self, logits: Tensor) -> Tensor | None:
        """What the grammar allows next, [1,V] on the logits' device (None: no grammar)."""
        if self.matcher is None:
            return None
        return self.matcher.allowed(len(logits)).to(logits.device)[None]
