"""What every route reads: the `Server` (engine, model name, key, metrics) and the request,
authorized, parsed and its prompt turned into token ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

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


def authorized(request: Request) -> Server:
    server = request.app.state.server
    wanted = f"Bearer {server.api_key}"
    if server.api_key is not None and request.headers.get("authorization") != wanted:
        raise ApiError(
            401, "a missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
        )
    return server


Authorized = Annotated[Server, Depends(authorized)]  # a route's parameter: the key checked


async def read(request: Request) -> tuple[Server, dict]:
    """The server and the request's JSON body, authorized and checked: the page's routes
    (tlm extras) read their few fields from it; OpenAI's routes take `schema`'s models."""
    server = authorized(request)
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    model = body.get("model", server.name)
    if model != server.name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server has {server.name!r}",
            "model",
            "model_not_found",
        )
    return server, body


def ids(server: Server, prompt: str | list[int], name: str, whole: bool = True) -> list[int]:
    """A prompt's token ids, or a 400. A string is a document: <|endoftext|>, then its
    tokens (`tokenizer.document_ids`); a list of token ids is taken as it is, each checked
    against the vocabulary. With `whole`, it must fit the model's context."""
    limit = server.context if whole else None
    try:
        if isinstance(prompt, str):
            return document_ids(server.engine.tokenizer, prompt, limit, name)
        vocab = server.engine.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"{name} has token id {bad}, outside 0..{vocab - 1}", "prompt", "invalid_value"
            )
        return within(list(prompt), limit, name)
    except InputTooLong as error:
        raise ApiError(400, str(error), "prompt", "context_length_exceeded") from None
    except TokenizerError as error:  # a character a character vocabulary lacks
        raise ApiError(400, str(error), "prompt", "invalid_value") from None
