"""A draft model for speculative decoding: a second, cheaper model that proposes tokens.

The draft keeps a cache of its own over the text (`SlotCache`, one slot) and the tokens it
holds the keys of. To propose, it rolls its cache back to the longest prefix it shares with
the text now (what the target kept of its last proposal), feeds the rest, then its own
tokens one step at a time: its greedy ones for a greedy row, for a sampled row each drawn
from its own distribution q after the row's processing (temperature, top-k, top-p,
penalties, bias). The target checks them (`Slots._speculate`): a greedy row's tokens are
the target's own choices, a sampled row's follow the target's distribution exactly
(the acceptance rule), so the draft changes how fast, never what.

`int8` is the target's own weights packed in int8 (`self_draft`): a full-precision model's
exact output at close to int8's speed.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from tlm.generate.choice import RowChoice
from tlm.generate.errors import GenerationError
from tlm.generate.sampling import draw, greedy_logprob
from tlm.inference import Decoder, SlotCache, in_parts, load_prepared
from tlm.model.kv_cache import cache_size
from tlm.model.transformer import TransformerLM


def self_draft(target: nn.Module) -> TransformerLM:
    """The target's weights packed in int8, each part as it is read from the target's own
    parameters (no fp32 copy); the target is left as it was. A target whose weights are
    packed already (float16, bfloat16, int8) has no fp32 weights left to read: refused."""
    if getattr(target, "inference_format", "float32") != "float32":
        raise GenerationError(
            f"the target keeps its weights in {target.inference_format} only: load the draft "
            "with tlm.load_model(path, dtype='int8') and pass it as draft="
        )
    state = {name: tensor.detach() for name, tensor in target.state_dict().items()}
    draft = TransformerLM(target.config, init=False)
    pairs = ((name, state[name]) for name in in_parts(draft.state_dict()))
    return load_prepared(draft, pairs, "int8")


CATCH_UP = 16  # most tokens the draft feeds in one C step (every row's logits computed)


class DraftModel:
    """Proposes tokens for one sequence at a time from `model`, a language model with the
    target's vocabulary, keeping its own cache of `capacity` positions."""

    def __init__(
        self, model: nn.Module, vocab_size: int, capacity: int, device: torch.device
    ) -> None:
        if model.config.vocab_size != vocab_size:
            raise GenerationError(
                f"the draft's vocabulary has {model.config.vocab_size} tokens, the target's "
                f"{vocab_size}: a draft must share the target's tokenizer"
            )
        self.decoder = Decoder(model)
        if self.decoder.device != device:
            raise GenerationError(
                f"the draft is on {self.decoder.device}, the target on {device}: load both on "
                "one device"
            )
        size = cache_size(model.config, capacity)
        self.cache = SlotCache(model.config, 1, size, self.decoder.dtype, device)
        self.bounded = model.config.attention_window is None  # else it reads on (a ring)
        self.held: list[int] = []  # the tokens whose keys and values the cache holds
        self.caught_up = 0.0  # seconds the last proposal spent feeding the text it missed

    def propose(
        self, text: list[int], count: int, choice: RowChoice | None = None
    ) -> tuple[list[int], list[Tensor] | None]:
        """Up to `count` tokens of the draft after `text` ([] where the text and the draft do
        not fit its cache): its greedy ones, or with `choice` (a sampled row's `fork`) each
        drawn from the draft's distribution as the row processes it, returned with those
        distributions q [V] for the acceptance rule (`Slots._speculate`)."""
        if self.bounded and len(text) + count > self.cache.capacity:
            return [], None
        shared = 0
        for held, token in zip(self.held, text[:-1], strict=False):
            if held != token:
                break
            shared += 1
        if not self.cache.can_truncate(0, shared):  # a ring that lost what it needs
            shared = 0
        self.cache.truncate(0, shared)
        self.held = self.held[:shared]
        proposed, drawn_from = [], []
        started = time.perf_counter()
        logits = self._feed(text[shared:])
        self.caught_up = time.perf_counter() - started if len(text) - shared > 1 else 0.0
        while True:
            if choice is None:
                proposed.append(greedy_logprob(logits.float())[0])
            else:
                drawn_from.append(choice.probabilities(logits))
                proposed.append(draw(drawn_from[-1], choice.generator))
                choice.record(proposed[-1])
            if len(proposed) == count:
                return proposed, drawn_from if choice is not None else None
            logits = self._feed(proposed[-1:])

    def _feed(self, tokens: list[int]) -> Tensor:
        """The logits [V] after feeding `tokens` at the cache's end: the C step where it
        means the same, for up to CATCH_UP tokens (the text it missed while its row paused:
        a step of a few rows costs a small draft a fraction of a forward pass), else the
        forward pass."""
        self.held += tokens
        if len(tokens) <= CATCH_UP and self.decoder.can_step(self.cache.k):
            if len(tokens) == 1:
                return self.decoder.slot_step(self.cache, [0], tokens)[0][0]
            return self.decoder.check(self.cache, 0, tokens)[0][-1]
        ids = torch.tensor(tokens, device=self.cache.k.device)
        fed = self.cache.feed([0], [len(tokens)])
        with torch.no_grad():
            return self.decoder.model(ids[None], fed, last_only=True)[0, -1]
