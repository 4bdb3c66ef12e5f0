"""What every route reads: the `Server` (engine, model name, key, metrics), the API key
checked (`Authorized`), and a prompt turned into token ids: whole (`ids`), as the model
reads it where generation reached its end (`window`), or a conversation in the run's chat
template (`chat_ids`). Bodies are validated by the
routes' pydantic models (`schema.py`, `page_schema.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tlm.chat import ChatError
from tlm.generate import window_start
from tlm.generate.chat import Prompt, chat_prompt, reply_room
from tlm.serve.engine import Engine
from tlm.serve.metrics import Metrics
from tlm.serve.openai import ApiError
from tlm.tokenizer import InputTooLong, TokenizerError, document_ids, within


@dataclass
class Server:
    """The server's state, one object on the app."""

    engine: Engine
    name: str
    api_key: str | None
    metrics: Metrics

    @property
    def context(self) -> int:
        return self.engine.slots.model.config.context_length

    @property
    def max_n(self) -> int:
        return len(self.engine.slots.rows) * 4

    @property
    def window_size(self) -> int:
        """The most tokens a decoding row reads at once: past it, the window slides. A model
        with an attention window decodes any length through its ring; a prompt read whole
        (the explaining routes) is then cut to its context."""
        slots = self.engine.slots
        return slots.capacity if slots.slides else slots.model.config.context_length


def authorized(request: Request) -> Server:
    server = request.app.state.server
    wanted = f"Bearer {server.api_key}"
    if server.api_key is not None and request.headers.get("authorization") != wanted:
        raise ApiError(
            401, "a missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
        )
    return server


Authorized = Annotated[Server, Depends(authorized)]  # a route's parameter: the key checked


def ids(
    server: Server, prompt: str | list[int], name: str, whole: bool = True, param: str = "prompt"
) -> list[int]:
    """A prompt's token ids, or a 400 naming `param`. A string is a document: <|endoftext|>,
    then its tokens (`tokenizer.document_ids`); a list of token ids is taken as it is, each
    checked against the vocabulary. With `whole`, it must fit the model's context."""
    limit = server.engine.slots.model.config.reads if whole else None  # any, for a window
    try:
        if isinstance(prompt, str):
            return document_ids(server.engine.tokenizer, prompt, limit, name)
        vocab = server.engine.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"{name} has token id {bad}, outside 0..{vocab - 1}", param, "invalid_value"
            )
        return within(list(prompt), limit, name)
    except InputTooLong as error:
        raise ApiError(400, str(error), param, "context_length_exceeded") from None
    except TokenizerError as error:  # a character a character vocabulary lacks
        raise ApiError(400, str(error), param, "invalid_value") from None


def window(server: Server, prompt: str | list[int], name: str) -> tuple[list[int], int]:
    """A prompt of any length read as generation reads the text at that length: its last
    `server.window_size` tokens (`window_start`, the one context policy of every decoding loop);
    returns those ids and the position of the first of them."""
    tokens = ids(server, prompt, name, whole=False)
    first = window_start(len(tokens), server.window_size)
    return tokens[first:], first


def chat_ids(server: Server, messages: list[dict[str, str]], max_tokens: int) -> Prompt:
    """A conversation's prompt in the run's template (`generate.chat.chat_prompt`: the
    oldest turns dropped until `max_tokens`, at most half the context, are left for the
    reply), or a 400 naming the rule it breaks."""
    try:
        room = reply_room(max_tokens, server.context)
        return chat_prompt(messages, server.engine.tokenizer, server.context, room)
    except (ChatError, TokenizerError) as error:
        raise ApiError(400, str(error), "messages", "invalid_value") from None
