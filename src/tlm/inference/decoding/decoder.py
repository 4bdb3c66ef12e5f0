"""What decoding prepares for one model, in one object that the decoding loop holds.

A decoding loop (`generate`'s, the server's `Slots`, beam search's) makes a `Decoder` for
the model it steps and keeps it while it decodes; everything the fast step needs is made
on first use and kept here, never on the model or its cache:

- the model's layers as the step reads them (`step.layers`), the descriptions of the
  whole step for C (`program.Program`, one per route), and the scratch buffers of a slot
  cache's step (`step.Scratch`);
- the list of dicts a hook can be registered in, so that "is anyone listening?" is one
  pass over them (a hooked model runs its forward pass, so every hook point sees its
  activation);
- the thread count each step runs on, learnt from the steps' times (`threads.Threads`,
  through `chosen_threads`);
- on a GPU, the recorded step of a `GraphedDecoder`;
- where its owner gives it one, a `PrefixCache` (`prefix`) that every `Slots` loop on it
  reads and fills, so that a caller that decodes again and again (`tlm chat`'s turns)
  prefills only what each prompt adds to the texts before it.

Two decoders of one model share nothing, and dropping a decoder drops all of it. Whether
the C step means the same as the forward pass is one question, `can_step`: the part that
cannot change while a model decodes into one cache is answered once per cache, the hooks
at every step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from tlm.device import placement
from tlm.inference.decoding import program, step
from tlm.inference.devices.cuda_graph import GraphedDecoder
from tlm.inference.devices.threads import Threads, on_threads
from tlm.inference.formats.prepare import for_decoding
from tlm.inference.prefix_cache import PrefixCache
from tlm.inference.slot_cache import SlotCache
from tlm.model.kv_cache import KVCache
from tlm.model.transformer import TransformerLM


class Decoder:
    """Decodes `model` (as `for_decoding` gives it); `fixed_threads`: every step on
    torch's thread setting, never choosing (benchmarks compare with it)."""

    def __init__(self, model: nn.Module, fixed_threads: bool = False) -> None:
        self.model = for_decoding(model)
        self.fixed_threads = fixed_threads
        self._threads: Threads | None = None
        self._hooks: list[dict] | None = None
        self._layers: tuple | None = None
        self._programs: dict[str, program.Program | None] = {}
        self._steppable: tuple[Tensor | None, bool] | None = None  # (key store, answer)
        self._scratch: step.Scratch | None = None
        self._graphed: tuple[tuple, GraphedDecoder] | None = None
        self.prefix: PrefixCache | None = None  # set by a caller that keeps this decoder

    @property
    def device(self) -> torch.device:
        """Where the model's weights are: every tensor a decoding loop makes goes there (its
        caches, generators, the ids it is handed, what it returns)."""
        return placement(self.model)[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in, which its caches keep."""
        return placement(self.model)[1]

    @property
    def threads(self) -> Threads:
        """The thread choice for torch's setting now (remade when the setting changes). A
        model off the CPU keeps torch's setting: its steps' times are not the CPU's."""
        most = torch.get_num_threads()
        if self._threads is None or self._threads.most != most:
            on_cpu = self.device.type == "cpu"
            self._threads = Threads(most, adapt=on_cpu and not self.fixed_threads)
        return self._threads

    @contextmanager
    def chosen_threads(self, kind: object) -> Iterator[None]:
        """The block, one decoding step of `kind` (steps of one kind take the same time),
        on the thread count chosen for it, and timed for the next choice; torch's setting
        back after it, whatever happens in it."""
        threads = self.threads  # before the block: inside it, torch's setting is the count
        count = threads.count_for(kind)
        started = time.perf_counter()
        with on_threads(count):
            yield
        threads.took(time.perf_counter() - started)

    def listening(self) -> bool:
        """Whether any hook is registered on the model, on any of its modules, or globally."""
        if self._hooks is None:
            self._hooks = step.hook_dicts(self.model)
        return any(self._hooks)

    def can_step(self, store: Tensor | None) -> bool:
        """Whether `step`/`slot_step` mean the same as the model's forward pass, for a pass
        into the key store `store` (step.py's module says when)."""
        if self._steppable is None or self._steppable[0] is not store:
            self._steppable = (store, step.steppable(self.model, store))
        return self._steppable[1] and not self.listening()

    def layers(self) -> tuple:
        if self._layers is None:
            self._layers = step.layers(self.model)
        return self._layers

    def program(self, rows: int) -> program.Program | None:
        """The whole step described for C with `rows` rows, or None (a product without a
        C kernel)."""
        return program.program(self.model, self.layers(), rows, self._programs)

    def logits(self, input_ids: Tensor, cache: KVCache, attention_mask: Tensor | None) -> Tensor:
        """Logits [B,V] of the token after the last of each row of input_ids [B,T] fed to
        `cache`: the C step where it means the same, else the forward pass; no autograd."""
        rows = step.rows_of(cache, input_ids) if attention_mask is None else None
        with torch.no_grad():
            if rows is not None and self.can_step(cache.k):
                return self.step(input_ids, cache, rows)
            return self.model(input_ids, cache, attention_mask, last_only=True)[:, -1]

    def step(self, input_ids: Tensor, cache: KVCache, rows: tuple[list[int], list[int]]) -> Tensor:
        """Logits [R,V] of a pass feeding one token to each of R rows of a `KVCache`, rows
        = (slots, positions) from `step.rows_of`; their keys and values are stored and the
        cache moves on, as in the forward pass."""
        self.model.check_context(cache.end(1))
        cache.check_capacity(cache.end(1))
        ids = input_ids.reshape(-1)
        whole = self.program(len(ids))
        logits, _ = step.run(self.model, self.layers(), whole, ids, cache.k, cache.v, *rows)
        cache.advance(1)
        return logits

    def slot_step(
        self, cache: SlotCache, slots: list[int], tokens: list[int], greedy: bool = False
    ) -> tuple[Tensor, list[tuple[int, float]] | None]:
        """Logits [R,V] of `tokens`, one fed to each of the `slots` of `cache` at its length,
        which then grows by one, for a loop (`Slots`) that asked `can_step` and keeps every
        row's length within the cache's capacity. With `greedy`, also each row's (ŵ, log
        P(ŵ)) as `sampling.greedy_logprob` gives them where the whole step is one C call
        (token -1 for a row whose logits are not all finite), else None. Where the whole
        step is one C call, the logits are a view of the decoder's scratch: valid until its
        next step (clone them to keep them)."""
        positions = [cache.lengths[slot] for slot in slots]
        logits, picks = self._rows(cache, slots, positions, tokens, greedy)
        for slot in slots:
            cache.lengths[slot] += 1
        return logits, picks

    def check(
        self, cache: SlotCache, slot: int, tokens: list[int], greedy: bool = False
    ) -> tuple[Tensor, list[tuple[int, float]] | None]:
        """Logits [k,V] after each of the k `tokens` fed to `slot` of `cache` at its length,
        in one step (a draft's tokens checked at once: token i sees those before it, as in
        the forward pass); the slot is then k longer (`cache.truncate` rolls it back). The C
        step where it means the same (its k rows are the slot's next k positions), else the
        forward pass. With `greedy`, also each position's (ŵ, log P(ŵ)) where the C step made
        them, as `slot_step` gives them; the logits may be a view of the decoder's scratch,
        valid until its next step."""
        start, k = cache.lengths[slot], len(tokens)
        if k > cache.room(slot):  # past its store, or a ring's pass that writes first
            raise ValueError(
                f"the slot cache holds {cache.capacity} positions; {start + k} asked"
                if cache.window is None
                else f"a check of {k} tokens: a windowed cache checks at most {cache.room(slot)}"
            )
        if not self.can_step(cache.k):
            ids = torch.tensor(tokens, device=cache.k.device)
            with torch.no_grad():
                return self.model(ids[None], cache.feed([slot], [k]))[0], None
        positions = list(range(start, start + k))
        logits, picks = self._rows(cache, [slot] * k, positions, tokens, greedy)
        cache.lengths[slot] += k
        return logits, picks

    def _rows(
        self, cache: SlotCache, slots: list[int], positions: list[int], tokens: list[int], greedy
    ) -> tuple[Tensor, list[tuple[int, float]] | None]:
        """The C step of token r at positions[r] of slot slots[r] (lengths left alone)."""
        self.model.check_context(max(positions) + 1)
        R, whole = len(slots), self.program(len(slots))
        if whole is not None and whole.rows is not None:
            scratch = self._scratch_for(cache, whole.head.out, R)
            return step.scratch_step(
                self.model, whole, scratch, cache, slots, positions, tokens, greedy
            )
        cpu = torch.device("cpu")  # the C step's: the model is on the CPU
        chosen = (torch.empty(R, dtype=torch.int64, device=cpu), torch.empty(R, device=cpu))
        chosen = chosen if greedy else None
        ids = torch.tensor(tokens, device=cpu)
        logits, picked = step.run(
            self.model, self.layers(), whole, ids, cache.k, cache.v, slots, positions, chosen
        )
        if not picked:
            return logits, None
        return logits, list(zip(chosen[0].tolist(), chosen[1].tolist(), strict=True))

    def _scratch_for(self, cache: SlotCache, vocab: int, rows: int) -> step.Scratch:
        s, most = self._scratch, max(len(cache.lengths), rows)
        if s is None or s.vocab != vocab or s.slots < most:
            s = self._scratch = step.Scratch(most, self.model.config.d_model, vocab)
        return s

    def graphable(self, prompt_length: int, new_tokens: int) -> bool:
        """Whether a generation can run on a `GraphedDecoder`: a plain language model on a
        GPU, in eval mode, with no hook registered (a graph would call a hook once, at
        recording), with the whole generation inside its context (no sliding window), and
        no attention window."""
        model = self.model
        return (
            isinstance(model, TransformerLM)
            and self.device.type == "cuda"
            and not model.training
            and prompt_length + new_tokens <= model.config.context_length
            and model.config.rope_scaling != "dynamic"  # its tables change with the length
            and model.config.attention_window is None  # a ring's mask moves at every step
            and not self.listening()
        )

    def graphed(self, batch_size: int, positions: int) -> GraphedDecoder:
        """The recorded step for this batch size and at least `positions` positions, kept
        while the weights stay where they were recorded. The window is rounded up to a
        multiple of 256, so prompts of other lengths replay it too; one is kept at a time
        (the cache's memory is not held twice)."""
        model = self.model
        capacity = min(model.config.context_length, -(-positions // 256) * 256)
        weights = tuple(p.data_ptr() for p in model.parameters())
        key = (batch_size, capacity, self.dtype, weights)
        if self._graphed is None or self._graphed[0] != key:
            self._graphed = None  # freed before the next is made
            self._graphed = (key, GraphedDecoder(model, batch_size, capacity, graph=True))
        return self._graphed[1]
