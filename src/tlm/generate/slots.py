"""Continuous batching: a decoding state per row, advanced one token at a time.

`Slots` holds up to `slots` sequences at once, each in its own row of a `SlotCache`, with
its own length and positions, stop rules and choosing (`choice.RowChoice`: its settings,
random generator and penalties); the loop itself only batches.
`step()` advances every row by one token:

1. sequences waiting for a row take the free ones (lowest first);
2. one forward pass runs, in which each row feeds its own tokens: a row new this step its
   prompt ("prefill"; after the prefix its row or the prefix cache still holds, and while
   other rows decode at most `prefill_chunk` tokens a step), a row whose text has outgrown
   its cache its last `capacity` tokens again (the window slides for that row only, as the
   uncached model sees it), and every other row its last token;
3. each row chooses its token from its own logits with its own settings (`choose_rows`,
   every row's read back at once), and a row that has ended gives its row back at once.

A new request's prompt thus rides in the pass that decodes the others: the weights are
read once for both, and its first token comes out with theirs.

A sequence joins at the next step and leaves when done, and nothing it does reaches
another row: the same seed gives the same tokens alone or in a busy batch. `generate`
(`decode.py`) and the server (`tlm.serve`) both run on this.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tlm.generate.choice import Chosen, RowChoice, choose_rows
from tlm.generate.config import GenerationConfig
from tlm.generate.draft_model import DraftModel, self_draft
from tlm.generate.drafts import NgramIndex
from tlm.generate.errors import GenerationError
from tlm.generate.pace import Pace
from tlm.generate.sampling import draw
from tlm.inference import Decoder, SlotCache
from tlm.inference.prefix_cache import PrefixCache, shared
from tlm.model.kv_cache import cache_size


@dataclass(eq=False)  # compared and hashed by identity
class Sequence:
    """One row's prompt, settings, how its tokens are chosen, and its output so far."""

    prompt: list[int]
    config: GenerationConfig
    choice: RowChoice
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "length" or "cancelled"
    slot: int | None = None
    fresh: bool = True  # its prompt is not in the cache yet
    cached: int = 0  # prompt tokens a prefix cache gave it (not prefilled)
    slid: bool = False  # its row holds a window of its text, not the text from its start
    unfed: list[int] = field(default_factory=list)  # a long prefill's tokens still to feed
    drafted: int = 0  # speculative decoding: tokens drafted, and how many were kept
    accepted: int = 0
    checks: int = 0  # the target's steps that checked a draft
    pace: Pace | None = None  # when and how long it drafts (`pace.py`); None: it does not
    ngrams: NgramIndex | None = None  # prompt lookup's index of its text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Emitted:
    """The token one sequence chose at a step."""

    sequence: Sequence
    token: int
    logprob: float  # log P(token | text) under the model, before any filtering
    top: list[tuple[int, float]]  # the `top_logprobs` likeliest tokens and their log P
    finished: bool


def window_start(length: int, capacity: int) -> int:
    """The first of `length` tokens a model that holds `capacity` positions reads: when the
    text outgrows the context, the window slides and the oldest tokens fall out (the one
    context-window policy of every decoding loop)."""
    return max(0, length - capacity)


class Slots:
    """Up to `slots` sequences decoded together, each at its own pace, by `decoder` (one
    made for `model` if not given: the loop's for as long as it lives)."""

    def __init__(
        self,
        model: nn.Module,
        slots: int,
        capacity: int | None = None,
        decoder: Decoder | None = None,
        prefix: PrefixCache | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        self.decoder = decoder or Decoder(model)
        self.prefix = prefix  # what earlier texts computed, reused by new rows' prompts
        self.held: list[list[int]] = [[] for _ in range(slots)]  # a free row's text, with one
        self.prefilled = 0  # tokens of prompts (and slid windows) fed by this loop's passes
        self.chunk = prefill_chunk  # while rows decode, a prefill feeds at most this a step
        self.model = self.decoder.model
        self.capacity = cache_size(model.config, capacity)  # a windowed model's ring, or N
        self.slides = model.config.attention_window is None  # past N; a windowed model reads on
        self.device = self.decoder.device  # every tensor of the loop's on the model's device
        self.cache = SlotCache(model.config, slots, self.capacity, self.decoder.dtype, self.device)
        self.rows: list[Sequence | None] = [None] * slots
        self.waiting: deque[Sequence] = deque()
        self.drafter: tuple[object, DraftModel] | None = None  # (config.draft, its model)
        self.drafted = self.accepted = self.checks = 0  # every row's, since the loop began

    def add(
        self,
        prompt: list[int],
        config: GenerationConfig,
        sample: int = 0,
        seed: int | None = None,
        top_logprobs: int = 0,
    ) -> Sequence:
        """Queue a sequence; it takes a row at the next step with one free. A prompt longer
        than the cache is seen through its last `capacity` tokens, as the window slides (a
        model with an attention window reads all of it, into its ring)."""
        if config.num_beams > 1:
            raise GenerationError("beam search keeps its beams together: use beam_search")
        if config.max_new_tokens < 1:
            raise GenerationError("a sequence in a row decodes at least one token")
        if not prompt:
            raise GenerationError("a prompt needs at least one token (<|endoftext|> will do)")
        V = self.model.config.vocab_size
        choice = RowChoice.of_row(prompt, config, V, self.device, sample, seed, top_logprobs)
        sequence = Sequence(list(prompt), config, choice)
        if config.prompt_lookup or config.draft is not None:
            sequence.pace = Pace(config.draft_tokens, timed=config.draft is not None)
        if config.prompt_lookup:
            sequence.ngrams = NgramIndex(config.prompt_lookup)
        self.waiting.append(sequence)
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence now (a client went away): its row is free for the next step."""
        if sequence.done:
            return
        sequence.finish_reason = "cancelled"
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        self._release(sequence)

    @property
    def busy(self) -> int:
        return sum(row is not None for row in self.rows)

    def idle(self) -> bool:
        return not self.waiting and self.busy == 0

    def step(self) -> list[Emitted]:
        """Advance every sequence in a row by one token, all in one forward pass."""
        self._admit()
        slots, feeds, prefilled = [], [], []
        pending: set[int] = set()  # the blocks this step's new rows compute
        decoding = any(r is not None and not (r.fresh or r.unfed) for r in self.rows)
        for slot, sequence in enumerate(self.rows):
            if sequence is None:
                continue
            full = self.slides and self.cache.lengths[slot] + 1 > self.capacity
            if sequence.unfed:  # a long prefill goes on
                feed = self._chunk(sequence, sequence.unfed, decoding)
                prefilled.append(sequence)
            elif sequence.fresh or full:
                feed = self._prefill(sequence, slot, pending)
                if feed is None:  # a row before it computes its next block: reused next step
                    continue
                feed = self._chunk(sequence, feed, decoding)
                prefilled.append(sequence)
            else:
                feed = sequence.tokens[-1:]
            slots.append(slot)
            feeds.append(feed)
        if not slots:
            return []
        alone = self.rows[slots[0]] if len(slots) == 1 and len(feeds[0]) == 1 else None
        pace = alone and alone.pace  # batch 1, drafting: a draft is almost free
        if pace:
            started = time.perf_counter()
            draft, drawn_from = self._draft(alone)
            if draft:
                return self._speculate(alone, feeds[0] + draft, drawn_from, started)
        tokens = [token for feed in feeds for token in feed]
        one_each = len(tokens) == len(feeds)  # every row feeds one token: a decoding step
        picks = None  # greedy's choices, where the step made them
        decoder = self.decoder
        with decoder.chosen_threads((len(slots), len(tokens))):
            if one_each and decoder.can_step(self.cache.k):
                greedy = all(self.rows[slot].choice.plain_greedy for slot in slots)
                logits, picks = decoder.slot_step(self.cache, slots, tokens, greedy)
            else:
                ids = torch.tensor(tokens, device=self.device)
                with torch.no_grad():
                    fed = self.cache.feed(slots, [len(feed) for feed in feeds])
                    logits = self.model(ids[None], fed, last_only=True)[0]  # [rows,V]
        for sequence in prefilled:
            self._keep(sequence)  # for the rows that come while this one decodes
        ready = [i for i, slot in enumerate(slots) if not self.rows[slot].unfed]
        if len(ready) < len(slots):  # a row between two chunks of its prefill chooses nothing
            logits, slots = logits[ready], [slots[i] for i in ready]
            picks = None if picks is None else [picks[i] for i in ready]
        sequences = [self.rows[slot] for slot in slots]
        chosen = choose_rows([sequence.choice for sequence in sequences], logits, picks)
        emitted = [self._emit(s, c) for s, c in zip(sequences, chosen, strict=True)]
        if pace:
            pace.plain(time.perf_counter() - started)
        return emitted

    def _prefill(self, sequence: Sequence, slot: int, pending: set[int]) -> list[int] | None:
        """What a row feeds to (re)fill its cache: its prompt after the longest prefix the
        prefix cache holds (copied into its row), or when its text has outgrown the cache the
        last `capacity` tokens. None: not this step, as a row before it in this step
        computes the same next block (to be reused at the next step)."""
        text = sequence.prompt + sequence.tokens  # the prompt, or the text to slide
        start = window_start(len(text), self.capacity) if self.slides else 0
        chain, prefix, cached = [], self.prefix, 0
        if prefix is not None and start == 0 and not sequence.slid:
            most, B = min(len(text) - 1, self.capacity), prefix.block  # one token fed at least
            chain = prefix.lookup(text, most)
            own = shared(self.held[slot], text, most)  # what its row still holds of it
            chain = [] if own >= len(chain) * B else chain  # no copy, to the token
            cached = max(own, len(chain) * B)
            ends = range(cached // B * B + B, most + 1, B)  # the blocks it would compute
            if ends and hash(tuple(text[: ends[0]])) in pending:
                return None
            pending.update(hash(tuple(text[:end])) for end in ends)
            prefix.use(chain, cached)
        self.held[slot] = []  # the row is in use: what it holds is decided when it ends
        B = len(chain) and prefix.block
        for i, block in enumerate(chain):
            self.cache.k[:, slot, :, i * B : (i + 1) * B] = block.k
            self.cache.v[:, slot, :, i * B : (i + 1) * B] = block.v
        self.cache.lengths[slot] = cached
        sequence.fresh, sequence.slid = False, sequence.slid or start > 0
        if not sequence.tokens:
            sequence.cached = cached
        self.prefilled += len(text) - start - cached
        return text[start + cached :]

    def _chunk(self, sequence: Sequence, feed: list[int], decoding: bool) -> list[int]:
        """What of a prefill this step feeds: all of it, or while other rows decode at most
        `prefill_chunk` tokens, the rest kept for the steps after (`unfed`), so that the
        decoding rows' steps keep their pace while a long prompt arrives."""
        if self.chunk and decoding and len(feed) > self.chunk:
            feed, sequence.unfed = feed[: self.chunk], feed[self.chunk :]
        else:
            sequence.unfed = []
        return feed

    def _holds(self, sequence: Sequence) -> list[int]:
        """The text whose keys and values the row's cache holds from its start ([] without
        a prefix cache, once the window has slid, or a ring has come round)."""
        slot = sequence.slot
        if self.prefix is None or slot is None or sequence.slid:
            return []
        length = self.cache.lengths[slot]
        if length > self.capacity:  # a windowed model's ring has overwritten its start
            return []
        return (sequence.prompt + sequence.tokens)[:length]

    def _keep(self, sequence: Sequence) -> None:
        """Give the prefix cache the full blocks of the text the row's cache holds."""
        text = self._holds(sequence)
        if text:
            k, v = self.cache.k[:, sequence.slot], self.cache.v[:, sequence.slot]
            read = lambda s, e: (k[:, :, s:e].clone(), v[:, :, s:e].clone())  # noqa: E731
            self.prefix.store(text, len(text), read)

    def _admit(self) -> None:
        """Waiting sequences take the free rows, first come first; with a prefix cache each
        the free row that still holds most of its prompt (a conversation's last turn), else
        the lowest."""
        free = [slot for slot, row in enumerate(self.rows) if row is None]
        while self.waiting and free:
            sequence = self.waiting.popleft()
            slot = max(free, key=lambda s: shared(self.held[s], sequence.prompt))
            free.remove(slot)
            sequence.slot, sequence.fresh = slot, True
            self.rows[slot] = sequence
            self.cache.clear(slot)

    def _draft(self, sequence: Sequence) -> tuple[list[int], list[Tensor] | None]:
        """The tokens proposed for the row's next step ([]: a plain step), as many as its
        settings ask, that the cache and `max_new_tokens` have room for, and the
        distributions they were drawn from (None: chosen, not drawn). Rows speculate only
        alone (batch 1), where a step's weights are read for one token anyway."""
        c = sequence.config
        if not sequence.pace.wants_draft():  # paused: plain steps for a while
            return [], None
        room = min(
            sequence.pace.length or c.draft_tokens,
            c.max_new_tokens - len(sequence.tokens) - 1,  # the step's own token comes too
            self.cache.room(sequence.slot) - 1,
        )
        if room < 1:
            return [], None
        text = sequence.prompt + sequence.tokens
        if c.prompt_lookup:
            return sequence.ngrams.propose(text, room), None
        # a sampled row draws its draft (the rule needs q); under a grammar, whose matcher
        # cannot be forked, and for greedy rows, the draft proposes its likeliest tokens
        choice = sequence.choice
        drawn = not c.greedy and choice.matcher is None
        return self._draft_model(c.draft).propose(text, room, choice.fork() if drawn else None)

    def _draft_model(self, draft) -> DraftModel:
        """The draft model of `draft` (a model, or "int8": the target's own weights packed
        once for this loop), with its own cache."""
        if self.drafter is None or self.drafter[0] is not draft:
            model = self_draft(self.model) if isinstance(draft, str) else draft
            V = self.model.config.vocab_size
            self.drafter = (draft, DraftModel(model, V, self.capacity, self.device))
        return self.drafter[1]

    def _speculate(
        self, sequence: Sequence, fed: list[int], drawn_from: list[Tensor] | None, started: float
    ) -> list[Emitted]:
        """One step of the target on the row's last token and a draft x_1…x_γ, the draft's
        tokens checked in order (Leviathan et al. 2023), the cache rolled back to the tokens
        kept. With p the target's distribution and q the draft's, after the row's processing:
        x_i is kept with probability min(1, p(x_i)/q(x_i)); the first one not kept is
        replaced by a draw from norm(max(0, p - q)); when all γ are kept, one more is drawn
        from p. A draft that was chosen, not drawn (prompt lookup, a greedy row, a grammar),
        has q one-hot at x_i: the rule is then to draw from p and keep x_i while the draw is
        x_i (kept with probability p(x_i), else a draw from p without x_i), which is what
        `choose_rows` does, with the generator's draws of plain decoding: the same tokens. The
        row's `Pace` then sets the next draft's length and pauses (`pace.py`); `started` is
        when this step's draft began."""
        slot, start = sequence.slot, self.cache.lengths[sequence.slot]
        with self.decoder.chosen_threads((1, len(fed))):
            greedy = sequence.choice.plain_greedy
            logits, picks = self.decoder.check(self.cache, slot, fed, greedy)  # [k+1, V]
        emitted = []
        for i in range(len(fed)):
            choice = sequence.choice
            if drawn_from is None or i + 1 == len(fed):
                chosen = choice.choose(logits[i], picks[i] if picks else None)
            else:
                token = self._accept(choice, logits[i], fed[i + 1], drawn_from[i])
                chosen = choice.take(logits[i], token)
            emitted.append(self._emit(sequence, chosen))
            if sequence.done or i + 1 == len(fed) or emitted[-1].token != fed[i + 1]:
                break
        drafted, kept = len(fed) - 1, len(emitted) - 1
        sequence.drafted, sequence.accepted = sequence.drafted + drafted, sequence.accepted + kept
        sequence.checks += 1
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + kept
        self.checks += 1
        caught_up = self.drafter[1].caught_up if sequence.config.draft is not None else 0.0
        sequence.pace.checked(drafted, kept, time.perf_counter() - started - caught_up)
        if not sequence.done:  # a finished row's slot is cleared already
            self.cache.truncate(slot, start + len(emitted))  # its last token is fed next
        return emitted

    @staticmethod
    def _accept(choice: RowChoice, logits: Tensor, drafted: int, q: Tensor) -> int:
        """The rule for a drawn draft token x: x with probability min(1, p(x)/q(x)), else a
        draw from norm(max(0, p - q)); p is the target's distribution after logits [V]."""
        p = choice.probabilities(logits)
        u = float(torch.rand((), generator=choice.generator, device=p.device))
        if u * float(q[drafted]) < float(p[drafted]):
            return drafted
        residual = (p - q.to(p.device)).clamp(min=0)
        return draw(residual / residual.sum() if residual.sum() > 0 else p, choice.generator)

    def _emit(self, sequence: Sequence, chosen: Chosen) -> Emitted:
        """The sequence goes on with its chosen (token, log P, top); it ends at an end token
        or at `max_new_tokens`, and gives its row back then."""
        token, logprob, top = chosen
        sequence.tokens.append(token)
        sequence.logprobs.append(logprob)
        if token in sequence.config.eos_ids:
            sequence.finish_reason = "eos"
        elif len(sequence.tokens) >= sequence.config.max_new_tokens:
            sequence.finish_reason = "length"
        if sequence.done:
            self._release(sequence)
        return Emitted(sequence, token, logprob, top, sequence.done)

    def _release(self, sequence: Sequence) -> None:
        if sequence.slot is not None and self.rows[sequence.slot] is sequence:
            self._keep(sequence)  # its prompt and reply, for a next turn
            self.held[sequence.slot] = self._holds(sequence)  # until another row writes it
            self.rows[sequence.slot] = None
            self.cache.clear(sequence.slot)
        sequence.slot = None
