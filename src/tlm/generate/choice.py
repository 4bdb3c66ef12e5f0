"""Choosing each row's next token: the one chooser of every decoding loop.

A row's choice keeps, from step to step, its settings, its random generator, the tokens
it has seen (the repetition penalty), the output's counts (frequency and presence) and
where its output stands in its grammar (`RowChoice`). `choose_rows` is the step: every
loop — the slots of continuous batching and the server, the graphed GPU loop, the
uncached reference — hands it the rows' logits [R,V] and gets each row's token and
log-probability, all rows' read back from the device at once (one wait per step on a
GPU, never one per row). The steps themselves are the pure functions of `sampling.py`.

Randomness: sample j of a prompt draws from a generator of (seed, j) on the model's
device (`row_generator`), whichever loop decodes it and whatever shares its batch.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from tlm.generate.errors import GenerationError
from tlm.generate.sampling import choose, distribution, draw_rows, greedy_logprob

if TYPE_CHECKING:
    from tlm.generate.constrain import Matcher

Chosen = tuple[int, float, list[tuple[int, float]]]  # token, log P, the top (id, log P)


def row_generator(seed: int, sample: int, device: torch.device | str) -> torch.Generator:
    """Sample j of a prompt draws from a generator of (seed, j), whatever else is running.
    Any integer is a seed: a negative one is read as its 64-bit two's complement."""
    state = np.random.SeedSequence([seed % 2**64, sample]).generate_state(1, np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state))


def random_seed() -> int:
    """A seed when none is given; follows torch.manual_seed, like the rest of PyTorch."""
    return int(torch.randint(0, 2**62, (), device="cpu").item())


class RowChoice:
    """What choosing one sequence's tokens keeps from step to step: its settings, its
    random generator, the tokens seen so far (the repetition penalty, over the prompt and
    the output), the output's count of each token (the frequency and presence penalties)
    and where the output stands in its grammar; `top_logprobs` likeliest tokens are
    reported with each choice. Its tensors live on `device`, the model's."""

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
        self.device = device
        self.seen = self.counts = None
        if config.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        if config.counts_output:
            self.counts = torch.zeros(vocab_size, device=device)
        self.matcher: Matcher | None = None if config.grammar is None else config.grammar.start()
        # the likeliest token as is, with no top list to report: a step that made greedy's
        # choice itself (the whole step in C) hands it over as `pick`
        self.plain_greedy = config.greedy and not config.adjusts_logits and not top_logprobs
        # a draw whose distribution depends on the settings alone (no penalties' state, no
        # grammar): rows of one config are brought to their distributions together
        stateless = all(x is None for x in (self.seen, self.counts, self.matcher))
        self.plain_draw = not config.greedy and stateless

    @classmethod
    def of_row(
        cls,
        prompt: list[int],
        config,
        vocab_size: int,
        device: torch.device,
        sample: int = 0,
        seed: int | None = None,
        top_logprobs: int = 0,
    ) -> RowChoice:
        """The choice of sample `sample` of a prompt: a sampled row draws from the
        generator of (seed, sample) (a random seed when None), a greedy one from none."""
        generator = None
        if not config.greedy:
            generator = row_generator(random_seed() if seed is None else seed, sample, device)
        return cls(prompt, config, generator, vocab_size, device, top_logprobs)

    def choose(self, logits: Tensor, pick: tuple[int, float] | None = None) -> Chosen:
        """The token after logits [V], as `choose_rows` chooses it for one row."""
        return choose_rows([self], logits[None], [pick])[0]

    def token_of(self, logits: Tensor) -> Tensor:
        """The row's next token after logits [V] as a 0-d tensor on their device (nothing
        read back, nothing recorded): steps 0-6 of `sampling.py`, then argmax or a draw."""
        seen = None if self.seen is None else self.seen[None]
        counts = None if self.counts is None else self.counts[None]
        allowed = self._allowed(logits)
        return choose(logits[None], self.config, [self.generator], seen, counts, allowed)[0]

    def probabilities(self, logits: Tensor) -> Tensor:
        """What the next token is drawn from, after logits [V], as the row stands -> [V]."""
        seen = None if self.seen is None else self.seen[None]
        counts = None if self.counts is None else self.counts[None]
        allowed = self._allowed(logits)
        return distribution(logits[None], self.config, seen, counts, allowed)[0]

    def take(self, logits: Tensor, token: int) -> Chosen:
        """`token`, chosen after logits [V] by any rule (the acceptance rule of speculative
        sampling): recorded, and reported as `choose_rows` reports its own."""
        logprobs = logits.float().log_softmax(dim=-1)  # the model's, before any filter
        top = _top(logprobs, self.top_logprobs)
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


def choose_rows(
    choices: list[RowChoice], logits: Tensor, picks: list[tuple[int, float] | None] | None = None
) -> list[Chosen]:
    """Row r's next token after logits[r] ([R,V]) as choices[r] decides it: (token, log
    P(token) under the model before any processing, the `top_logprobs` likeliest (id, log
    P)), each recorded in its row. `picks[r]` is the step's own greedy choice (ŵ, log P(ŵ))
    where it made one (token -1: logits not all finite). A plain greedy row on the CPU takes
    `greedy_logprob` (one C pass); every other row's token stays on the device until all
    rows' tokens and log-probabilities are read back together."""
    picks = picks or [None] * len(choices)
    known: dict[int, tuple[int, float]] = {}
    tops: dict[int, list[tuple[int, float]]] = {}
    rows, tokens = [], []  # the rows chosen on the device, and their 0-d tokens
    drawn: dict[int, list[int]] = {}  # config -> its plain draws' rows
    for r, (choice, pick) in enumerate(zip(choices, picks, strict=True)):
        if choice.plain_greedy and pick is not None and pick[0] >= 0:
            known[r] = pick
        elif choice.plain_greedy and logits.device.type == "cpu":
            known[r] = greedy_logprob(logits[r].float())  # no [V] log-softmax written
        elif choice.plain_draw:
            drawn.setdefault(id(choice.config), []).append(r)
        else:
            rows.append(r)
            tokens.append(choice.token_of(logits[r]))
    for group in drawn.values():  # one distribution [k,V] a config, each row its own draw
        index = torch.tensor(group, dtype=torch.long, device=logits.device)
        probs = distribution(logits.index_select(0, index), choices[group[0]].config)
        rows += group
        tokens += draw_rows(probs, [choices[r].generator for r in group]).unbind()
    if rows:
        chosen = torch.stack(tokens)  # [k]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)  # [k,V]
        picked = logprobs.gather(1, chosen[:, None])[:, 0]
        values = torch.stack([chosen.double(), picked.double()]).tolist()  # one wait
        for i, (r, token, logprob) in enumerate(zip(rows, *values, strict=True)):
            known[r] = (int(token), logprob)
            tops[r] = _top(logprobs[i], choices[r].top_logprobs)
    out = []
    for r, choice in enumerate(choices):
        token, logprob = known[r]
        choice.record(token)
        out.append((token, logprob, tops.get(r, [])))
    return out


def _top(logprobs: Tensor, count: int) -> list[tuple[int, float]]:
    """The `count` likeliest (id, log P) of logprobs [V] ([] for 0)."""
    if not count:
        return []
    values, ids = logprobs.topk(min(count, len(logprobs)))
    return list(zip(ids.tolist(), values.tolist(), strict=True))
