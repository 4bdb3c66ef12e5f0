"""The decoding loop (J&M §10.8): prefill the prompt once, then one token per step.

`generate` yields a `Step` (the next token of every row, its log-probability, which rows
have ended) as soon as it is chosen; greedy decoding and sampling in the CLI and in
`TransformerLM.generate` consume this iterator. The cached path runs on `Slots` (each row
at its own length, as the server's rows); on a GPU, where the generation allows it, on a
`GraphedDecoder` (each step one replay of a CUDA graph, `inference/devices/cuda_graph.py`). With
`use_cache=False` every step runs the whole window again (`DecodeState`): the slow reference
that the tests hold the cached path equal to. All choose the next token with
`choice.choose_rows` (one `RowChoice` per row: the same tokens for the same seed on every
path) and slide the window by `window_start`.

Which path runs is decided in `generate` alone: the graphed one on a GPU when the whole
generation fits the context and no draft is asked for (its recorded step feeds one token;
a draft's check of k tokens runs on the slots), the slots otherwise; a setting a path
cannot honour is refused in one line, never dropped. The device and dtype come from the
model's `Decoder`: `generate` moves the ids there once, and every tensor it makes and
yields is there.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn

from tlm.device import placement
from tlm.generate.choice import RowChoice, choose_rows, random_seed
from tlm.generate.config import GenerationConfig
from tlm.generate.errors import GenerationError
from tlm.generate.slots import Slots, window_start
from tlm.inference import Decoder
from tlm.inference.devices.cuda_graph import GraphedDecoder
from tlm.model.kv_cache import KVCache, cache_size


class Step:
    """One new token for every row: `tokens` [B] (an ended row repeats its end token),
    `logprobs` [B] (log P(token | prefix) under the model, before any filtering) and
    `finished` [B] (bool: the row has produced an end-of-sequence token).

    Made from tensors, or (the slot loop) from lists, each list made a tensor when first
    read: a loop that keeps its steps and stacks them after decoding (`model.generate`)
    makes its tensors then, with torch's code in the caches, instead of between two steps,
    where one small tensor costs 30-45 µs on the CPU (docs/benchmarks-history.md)."""

    def __init__(
        self, tokens, logprobs, finished, device: torch.device | None = None, drafts=None
    ) -> None:
        self._values, self._device = [tokens, logprobs, finished], device
        # speculative decoding: each row's (tokens drafted, kept, target steps) so far
        self.drafts: list[tuple[int, int, int]] | None = drafts

    def _field(self, i: int, dtype: type) -> Tensor:
        value = self._values[i]
        if not isinstance(value, Tensor):
            value = self._values[i] = torch.from_numpy(np.array(value, dtype=dtype))
            if self._device is not None and self._device.type != "cpu":
                value = self._values[i] = value.to(self._device)
        return value

    tokens = property(lambda self: self._field(0, np.int64))
    logprobs = property(lambda self: self._field(1, np.float32))
    finished = property(lambda self: self._field(2, np.bool_))

    def lists(self) -> tuple[list[int], list[float], list[bool]]:
        """tokens, logprobs and finished as Python lists, without making a tensor where the
        step holds lists (a loop that streams text reads these between two steps)."""
        values = (v.tolist() if isinstance(v, Tensor) else list(v) for v in self._values)
        return tuple(values)

    def __repr__(self) -> str:
        return f"Step(tokens={self.tokens}, logprobs={self.logprobs}, finished={self.finished})"


class DecodeState:
    """The tokens of every row so far, their padding mask, and their KV cache (or none).

    The cache (or, without one, the window each step runs) covers ids[:, start:]. When the
    text outgrows the context window, the window slides (`window_start`): the cache is
    rebuilt from the last context_length tokens, which is exactly what the uncached model
    sees at that step. A model with an attention window reads on instead: its uncached
    steps run the whole text, and its cache is a ring that holds the window (`window.py`).
    The cached steps run on a `Decoder` of the model.
    """

    def __init__(
        self,
        model: nn.Module,
        ids: Tensor,
        mask: Tensor | None,
        use_cache: bool,
        max_new_tokens: int | None = None,
    ) -> None:
        self.decoder = Decoder(model) if use_cache else None
        self.model, self.ids = self.decoder.model if use_cache else model, ids
        self.mask = None if mask is None or bool(mask.all()) else mask  # no padding: no mask
        config = model.config
        self.N = config.context_length if config.attention_window is None else None  # or all
        self.cache, self.start = None, 0
        self.device, dtype = placement(self.model)
        if use_cache:
            longest = None if max_new_tokens is None else ids.shape[1] + max_new_tokens
            capacity = cache_size(config, longest)
            self.cache = KVCache(config, len(ids), capacity, dtype, self.device)

    def next_logits(self) -> Tensor:
        """Logits [B,V] for the token after the last one of every row."""
        S = self.ids.shape[1]
        if self.cache is None:  # the reference: the whole (last) window, every step
            lo = 0 if self.N is None else window_start(S, self.N)
            with torch.no_grad():
                logits = self.model(self.ids[:, lo:], attention_mask=self._mask(lo), last_only=True)
            return logits[:, -1]
        if self.N is not None and S - self.start > self.cache.capacity:  # full: the last N
            self.cache.reset()
            self.start = window_start(S, self.cache.capacity)
        new = self.ids[:, self.start + self.cache.length :]  # [B, prompt or 1]
        return self.decoder.logits(new, self.cache, self._mask(self.start))

    def next_logprobs(self) -> Tensor:
        return self.next_logits().float().log_softmax(dim=-1)

    def _mask(self, lo: int) -> Tensor | None:
        return None if self.mask is None else self.mask[:, lo:]

    def append(self, tokens: Tensor) -> None:
        self.ids = torch.cat([self.ids, tokens[:, None].to(self.ids.device)], dim=1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(self.ids[:, -1:])], dim=1)

    def keep(self, rows: Tensor, tokens: Tensor) -> None:
        """Row i becomes old row rows[i] followed by tokens[i] (beam search)."""
        rows = rows.to(self.ids.device)
        self.ids = self.ids[rows]
        self.mask = None if self.mask is None else self.mask[rows]
        if self.cache is not None:
            self.cache.reorder(rows)
        self.append(tokens)


class GraphedState:
    """The same state over a `GraphedDecoder` (a GPU): the prompt runs once, then each new
    token is one replay of the recorded step. `ids` stay the prompts: the cache on the
    device holds the rest, and `_decode` reads ids only before its first step."""

    def __init__(self, decoder: GraphedDecoder, ids: Tensor, mask: Tensor | None) -> None:
        self.model, self.decoder, self.ids, self.mask = decoder.model, decoder, ids, mask
        self.device = ids.device
        self.new: Tensor | None = None  # the tokens appended since the last step

    def next_logits(self) -> Tensor:
        if self.new is None:
            return self.decoder.prefill(self.ids, self.mask)
        return self.decoder.step(self.new)

    def append(self, tokens: Tensor) -> None:
        self.new = tokens


def generate(
    model: nn.Module,
    input_ids: Tensor,
    config: GenerationConfig | None = None,
    attention_mask: Tensor | None = None,
    decoder: Decoder | None = None,
    **settings,
) -> Iterator[Step]:
    """Yield one `Step` per new token for every row of input_ids [B,T] (left-padded if needed).

    With `num_return_sequences` n, each prompt becomes n consecutive rows. Sample j of a
    prompt draws from its own generator, seeded by (seed, j): a sample does not depend on
    which other prompts share the batch. Stops when every row has ended or after
    `max_new_tokens` steps. A row that has ended repeats its end token. The cached steps
    run on `decoder` (a `Decoder` of `model`; a new one if not given: a caller that
    generates again and again may keep one, with what it learnt and prepared). The ids may
    be on any device: they are moved to the model's once, and the steps' tensors are there.
    """
    config = config or GenerationConfig(**settings)
    if config.num_beams > 1:
        raise GenerationError("beam search returns whole sequences: use tlm.generate.beam_search")
    if (config.best_of or 1) > config.num_return_sequences:
        raise GenerationError(
            "best_of chooses among whole samples: use model.generate or tlm.generate.complete"
        )
    drafting = bool(config.prompt_lookup) or config.draft is not None
    if drafting and not config.use_cache:
        raise GenerationError(
            "prompt_lookup and draft speed up the cached loop: use_cache=False runs the whole "
            "window every step, without a draft"
        )
    if config.use_cache:
        decoder = decoder or Decoder(model)
        device = decoder.device
    else:
        device = placement(model)[0]
    n = config.num_return_sequences
    ids = input_ids.to(device).repeat_interleave(n, dim=0)
    mask = None if attention_mask is None else attention_mask.to(device)
    mask = None if mask is None else mask.repeat_interleave(n, dim=0)
    new = config.max_new_tokens
    if not config.use_cache:
        yield from _decode(DecodeState(model, ids, mask, use_cache=False), config)
    elif not drafting and config.cuda_graph and decoder.graphable(ids.shape[1], new):
        graphed = decoder.graphed(len(ids), ids.shape[1] + new)
        yield from _decode(GraphedState(graphed, ids, mask), config)
    else:
        yield from _decode_slots(decoder, ids, mask, config)


def _prompts(ids: Tensor, mask: Tensor | None) -> list[list[int]]:
    """Each row's tokens, its left padding dropped."""
    if mask is None:
        return ids.tolist()
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True)]


def _decode_slots(decoder: Decoder, ids: Tensor, mask: Tensor | None, c: GenerationConfig):
    """The rows of ids [B,T] (padding dropped) as sequences of one `Slots`, stepped together."""
    if c.max_new_tokens == 0:
        return
    B, n = ids.shape[0], c.num_return_sequences
    seed = random_seed() if c.seed is None else c.seed
    slots = Slots(decoder.model, B, ids.shape[1] + c.max_new_tokens, decoder, decoder.prefix)
    rows = {slots.add(prompt, c, r % n, seed): r for r, prompt in enumerate(_prompts(ids, mask))}
    tokens, finished = [0] * B, [False] * B  # an ended row keeps its last token
    drafts = [(0, 0, 0)] * B if c.prompt_lookup or c.draft is not None else None
    device = decoder.device  # a Step's tensors are made from these lists, when read
    while not slots.idle():
        logprobs, stepped = [0.0] * B, set()  # 0 for a row that has ended
        for emitted in slots.step():
            r = rows[emitted.sequence]
            if r in stepped:  # a row's second token of one step (a draft kept): a new Step
                yield Step(list(tokens), logprobs, list(finished), device, _copy(drafts))
                logprobs, stepped = [0.0] * B, set()
            tokens[r], logprobs[r] = emitted.token, emitted.logprob
            finished[r] = emitted.sequence.finish_reason == "eos"
            stepped.add(r)
            if drafts is not None:
                done = emitted.sequence
                drafts[r] = (done.drafted, done.accepted, len(done.tokens) - done.accepted)
        yield Step(list(tokens), logprobs, list(finished), device, _copy(drafts))


def _copy(values: list | None) -> list | None:
    return None if values is None else list(values)


def _decode(state: DecodeState | GraphedState, c: GenerationConfig) -> Iterator[Step]:
    """The reference loop (`DecodeState`), and the graphed one's (`GraphedState`): every
    row not ended chooses with its own `RowChoice`, as the slots' rows do. Grad mode is
    switched off inside each step only: between steps the caller's code runs in its own
    mode, never in one this generator left on."""
    B, V, n, device = (
        len(state.ids),
        state.model.config.vocab_size,
        c.num_return_sequences,
        state.device,
    )
    seed = random_seed() if c.seed is None else c.seed
    prompts = _prompts(state.ids, state.mask)  # read before the first step appends
    choices = [RowChoice.of_row(p, c, V, device, r % n, seed) for r, p in enumerate(prompts)]
    tokens, finished, ends = [0] * B, [False] * B, set(c.eos_ids)
    for _ in range(c.max_new_tokens):
        logits = state.next_logits()  # [B,V]
        going = [r for r in range(B) if not finished[r]]
        if len(going) < B:
            logits = logits.index_select(0, torch.tensor(going, device=logits.device))
        logprobs = [0.0] * B  # 0 for a row that has ended
        with torch.no_grad():
            chosen = choose_rows([choices[r] for r in going], logits)
        for r, (token, logprob, _) in zip(going, chosen, strict=True):
            tokens[r], logprobs[r], finished[r] = token, logprob, token in ends
        yield Step(list(tokens), logprobs, list(finished), device)
        if all(finished):
            return
        state.append(torch.tensor(tokens, dtype=torch.long, device=device))


def best_rows(totals: Tensor, candidates: int, keep: int) -> Tensor:
    """`best_of`: of each prompt's `candidates` consecutive rows, the `keep` whose total
    log-probability is highest, best first (ties: the earlier sample) -> row indices, on
    the totals' device."""
    per_prompt = totals.reshape(-1, candidates)
    order = per_prompt.argsort(dim=1, descending=True, stable=True)[:, :keep]
    first = torch.arange(len(per_prompt), device=totals.device)[:, None] * candidates
    return (order + first).flatten()
