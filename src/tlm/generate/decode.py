"""The decoding loop (J&M §10.8): prefill the prompt once, then one token per step.

`generate` yields a `Step` (the next token of every row, its log-probability, which rows
have ended) as soon as it is chosen; greedy decoding and sampling in the CLI and in
`TransformerLM.generate` consume this iterator (beam search drives `Context` itself).
With `use_cache=False` every step runs the whole window again: the slow reference that
the tests hold the cached path equal to.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tlm.generate.sampling import (
    GenerationError,
    apply_repetition_penalty,
    greedy,
    process_logits,
    sample,
)
from tlm.generate.slots import Slots, random_seed, row_generator
from tlm.inference import decoding_step, for_decoding
from tlm.model.kv_cache import KVCache


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode; the names are the ones the Hugging Face ecosystem uses."""

    max_new_tokens: int = 100
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    num_return_sequences: int = 1
    eos_token_id: int | tuple[int, ...] | None = None
    seed: int | None = None
    use_cache: bool = True

    def __post_init__(self) -> None:
        rules = {
            "max_new_tokens": (self.max_new_tokens >= 0, ">= 0"),
            "temperature": (self.temperature >= 0, ">= 0"),
            "top_k": (self.top_k is None or self.top_k >= 1, ">= 1"),
            "top_p": (self.top_p is None or 0 < self.top_p <= 1, "in (0, 1]"),
            "repetition_penalty": (self.repetition_penalty > 0, "> 0"),
            "num_beams": (self.num_beams >= 1, ">= 1"),
            "num_return_sequences": (self.num_return_sequences >= 1, ">= 1"),
        }
        for name, (ok, allowed) in rules.items():
            if not ok:
                raise GenerationError(f"{name} must be {allowed}, got {getattr(self, name)}")
        if self.num_beams > 1 and self.do_sample:
            raise GenerationError("beam search is deterministic: use num_beams=1 to sample")
        if self.num_beams > 1 and self.repetition_penalty != 1.0:
            raise GenerationError("repetition_penalty applies to greedy decoding and sampling")
        if self.num_beams > 1 and self.num_return_sequences > 1:
            raise GenerationError("beam search returns one sequence per prompt")

    @property
    def pad_id(self) -> int:
        """What an ended row repeats: its end token (0 when there is none)."""
        return self.eos_ids[0] if self.eos_ids else 0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else self.eos_token_id


@dataclass
class Step:
    tokens: Tensor  # [B] the token chosen for each row (an ended row repeats the end token)
    logprobs: Tensor  # [B] log P(token | prefix) under the model, before any filtering
    finished: Tensor  # [B] bool: the row has produced an end-of-sequence token


class Context:
    """The tokens of every row so far, their padding mask, and their KV cache.

    The cache (or, without one, the window each step runs) covers ids[:, start:]. When the
    text outgrows the context window, the window slides: the cache is rebuilt from the last
    context_length tokens, which is exactly what the uncached model sees at that step.
    """

    def __init__(
        self,
        model: nn.Module,
        ids: Tensor,
        mask: Tensor | None,
        use_cache: bool,
        max_new_tokens: int | None = None,
    ) -> None:
        self.model, self.ids = for_decoding(model) if use_cache else model, ids
        self.mask = None if mask is None or bool(mask.all()) else mask  # no padding: no mask
        self.N = model.config.context_length
        self.cache, self.start = None, 0
        if use_cache:
            longest = self.N if max_new_tokens is None else ids.shape[1] + max_new_tokens
            capacity, dtype = min(self.N, longest), next(model.parameters()).dtype
            self.cache = KVCache(model.config, len(ids), capacity, dtype, ids.device)

    def next_logits(self) -> Tensor:
        """Logits [B,V] for the token after the last one of every row."""
        S = self.ids.shape[1]
        if self.cache is None:  # the reference: the whole (last) window, every step
            lo = max(0, S - self.N)
            return self.model(self.ids[:, lo:], attention_mask=self._mask(lo), last_only=True)[
                :, -1
            ]
        if S - self.start > self.N:  # full: recompute the cache from the last N tokens
            self.cache.reset()
            self.start = S - self.N
        new = self.ids[:, self.start + self.cache.length :]  # [B, prompt or 1]
        with decoding_step(self.model, len(new)) if new.shape[1] == 1 else torch.no_grad():
            return self.model(new, self.cache, self._mask(self.start), last_only=True)[:, -1]

    def _mask(self, lo: int) -> Tensor | None:
        return None if self.mask is None else self.mask[:, lo:]

    def append(self, tokens: Tensor) -> None:
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(tokens)[:, None]], dim=1)

    def reorder(self, rows: Tensor) -> None:
        """Keep rows `rows` (beam search)."""
        self.ids = self.ids[rows]
        self.mask = None if self.mask is None else self.mask[rows]
        if self.cache is not None:
            self.cache.reorder(rows)


def generate(
    model: nn.Module,
    input_ids: Tensor,
    config: GenerationConfig | None = None,
    attention_mask: Tensor | None = None,
    **settings,
) -> Iterator[Step]:
    """Yield one `Step` per new token for every row of input_ids [B,T] (left-padded if needed).

    With `num_return_sequences` n, each prompt becomes n consecutive rows. Sample j of a
    prompt draws from its own generator, seeded by (seed, j): a sample does not depend on
    which other prompts share the batch. Stops when every row has ended or after
    `max_new_tokens` steps. The cached path runs on `Slots` (each row at its own length);
    `use_cache=False` runs the whole window of every row at every step, the reference.
    """
    config = config or GenerationConfig(**settings)
    if config.num_beams > 1:
        raise GenerationError("beam search returns whole sequences: use tlm.generate.beam_search")
    n = config.num_return_sequences
    ids = input_ids.repeat_interleave(n, dim=0)
    mask = None if attention_mask is None else attention_mask.repeat_interleave(n, dim=0)
    if config.use_cache:
        yield from _decode_slots(model, ids, mask, config)
    else:
        yield from _decode(model, Context(model, ids, mask, use_cache=False), config)


def _decode_slots(model: nn.Module, ids: Tensor, mask: Tensor | None, c: GenerationConfig):
    """The rows of ids [B,T] (padding dropped) as sequences of one `Slots`, stepped together."""
    if c.max_new_tokens == 0:
        return
    B, n = ids.shape[0], c.num_return_sequences
    seed = random_seed() if c.seed is None else c.seed
    capacity = min(model.config.context_length, ids.shape[1] + c.max_new_tokens)
    slots = Slots(model, B, capacity)
    prompts = [
        row.tolist() if mask is None else row[mask[r].bool()].tolist() for r, row in enumerate(ids)
    ]
    rows = {slots.add(prompt, c, r % n, seed): r for r, prompt in enumerate(prompts)}
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    eos = torch.tensor(c.eos_ids, device=ids.device, dtype=torch.long)
    while not slots.idle():
        tokens = torch.full((B,), c.pad_id, dtype=torch.long, device=ids.device)
        logprobs = torch.zeros(B, device=ids.device)  # 0 for a row that has ended
        for emitted in slots.step():
            tokens[rows[emitted.sequence]] = emitted.token
            logprobs[rows[emitted.sequence]] = emitted.logprob
        finished = finished | torch.isin(tokens, eos)
        yield Step(tokens, logprobs, finished)


def _decode(model: nn.Module, context: Context, c: GenerationConfig) -> Iterator[Step]:
    """The loop. Grad mode is switched off inside each step only (`_next_step`): between
    steps the caller's code runs in its own mode, never in one this generator left on."""
    B, V = context.ids.shape[0], model.config.vocab_size
    device = context.ids.device
    eos = torch.tensor(c.eos_ids, device=device, dtype=torch.long)
    generators = _row_generators(c.seed, B, c.num_return_sequences, device) if c.do_sample else []
    seen = None
    if c.repetition_penalty != 1.0:
        real = torch.ones_like(context.ids) if context.mask is None else context.mask.long()
        counts = torch.zeros(B, V, dtype=torch.long, device=device)
        seen = counts.scatter_add_(1, context.ids, real) > 0  # [B,V]: padding counts 0
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    for _ in range(c.max_new_tokens):
        step = _next_step(context, c, generators, seen, finished, eos)
        yield step
        finished = step.finished
        if bool(finished.all()):
            return
        context.append(step.tokens)
        if seen is not None:
            seen[torch.arange(B, device=device), step.tokens] = True


@torch.no_grad()
def _next_step(
    context: Context,
    c: GenerationConfig,
    generators: list[torch.Generator],
    seen: Tensor | None,
    finished: Tensor,
    eos: Tensor,
) -> Step:
    logits = context.next_logits().float()  # [B,V]
    tokens = _choose(logits, c, generators, seen)
    tokens = torch.where(finished, c.pad_id, tokens)
    logprobs = logits.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
    return Step(tokens, logprobs, finished | torch.isin(tokens, eos))


def _choose(
    logits: Tensor, c: GenerationConfig, generators: list[torch.Generator], seen: Tensor | None
) -> Tensor:
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, c.repetition_penalty)
    if not c.do_sample:
        return greedy(logits)
    logits = process_logits(logits, c.temperature, c.top_k, c.top_p)
    return torch.stack([sample(row, g) for row, g in zip(logits, generators, strict=True)])


def _row_generators(
    seed: int | None, rows: int, per_prompt: int, device: torch.device
) -> list[torch.Generator]:
    """Row r is sample r % per_prompt of its prompt; it draws from a generator of (seed, j)."""
    seed = random_seed() if seed is None else seed
    return [row_generator(seed, row % per_prompt, device) for row in range(rows)]
