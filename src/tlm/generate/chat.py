"""Replies to conversations: the chat template's prompt, decoded until end of turn.

Everything that answers a conversation (`tlm chat`, the server's `/v1/chat/completions`,
`tlm eval --task chat`) builds its prompt here: `chat.render(..., generation=True)`, which
ends with `<|assistant|>`, and decodes with `<|end|>` (and `<|endoftext|>`) as end tokens.
A conversation longer than the context loses its oldest turns first, a user turn and the
answer to it at a time, the system message kept, until the prompt leaves `room` tokens for
the reply; the caller gets the messages kept and how many were dropped (a conversation that
goes on continues from those: the rule is applied here only). A last user turn that does
not fit on its own is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from tlm.chat import END, ChatError, check, render
from tlm.generate.config import GenerationConfig
from tlm.generate.text import Completion, complete_tokens, stream_tokens
from tlm.inference import Decoder
from tlm.tokenizer import Tokenizer


@dataclass
class Prompt:
    """A conversation's prompt: its ids, the messages they render (checked, the system
    message and the newest turns that fit), and how many of its oldest turns did not fit."""

    ids: list[int]
    messages: list[dict[str, str]]
    dropped: int = 0


def reply_room(max_new_tokens: int, context_length: int) -> int:
    """Positions a prompt leaves for the reply: max_new_tokens, at most half the context
    (a longer reply slides the window as any generation does)."""
    return min(max_new_tokens, context_length // 2)


def chat_prompt(
    messages: Sequence[Any], tokenizer: Tokenizer, context_length: int, room: int
) -> Prompt:
    """The ids a reply to `messages` continues, with the oldest turns dropped (a user turn
    and its answer at a time; the system message stays) until `room` positions are left,
    and the messages kept."""
    messages = check(messages, generation=True)
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    dropped = 0
    while True:
        kept = [*system, *turns]
        ids, _ = render(kept, tokenizer, generation=True)
        if len(ids) + room <= context_length:
            return Prompt(ids, kept, dropped)
        if len(turns) == 1:
            raise ChatError(
                f"the conversation's last turn needs {len(ids)} tokens with the template; the "
                f"model reads {context_length}, and {room} are kept for the reply"
            )
        turns, dropped = turns[2:], dropped + 2


def reply_config(config: GenerationConfig, tokenizer: Tokenizer) -> GenerationConfig:
    """`config` with end of turn (and end of text) as the end tokens."""
    return replace(config, eos_token_id=(tokenizer.special_id(END), tokenizer.eot_id))


def stream_reply(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: Prompt,
    config: GenerationConfig,
    decoder: Decoder | None = None,
) -> Iterator[str]:
    """The reply's text, piece by piece as it is generated, until end of turn (on the
    conversation's `decoder`, whose prefix cache holds the turns before, if given)."""
    ids = torch.tensor([prompt.ids])
    yield from stream_tokens(model, tokenizer, ids, reply_config(config, tokenizer), (), decoder)


def replies(
    model: nn.Module, tokenizer: Tokenizer, prompts: list[Prompt], config: GenerationConfig
) -> list[Completion]:
    """The replies to several prompts, decoded as one batch: finish_reason "eos" where a
    reply ended its turn with `<|end|>`, "length" where it ran out of tokens (a reply that
    writes `<|endoftext|>` instead runs on: it did not end its turn)."""
    config = replace(config, eos_token_id=tokenizer.special_id(END))
    return complete_tokens(model, tokenizer, [p.ids for p in prompts], config)
