"""The OpenAI API's shapes: request bodies in, completion objects out.

Request bodies are validated by the models of `schema.py`; what needs more than one field
or the model is checked here. Every mistake gets OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}, with its status. `Completions` and `Chat`
turn the engine's events into the text_completion and chat.completion objects, whole or
as server-sent chunks.

A run fine-tuned on conversations answers in its chat template (`tlm/chat.py`,
`generate/chat.py`: the oldest turns dropped when the context is full, the reply ending at
`<|end|>`); a base run gets the plain template (`chat.plain_prompt`, documented in
docs/serve.md), one line per message, then "Assistant:", its reply stopping at "\\nUser:"
(as well as at the end of text and the caller's stops).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

import torch

from tlm.generate import GenerationConfig, GenerationError, best_rows
from tlm.generate.constrain import Grammar
from tlm.serve.engine import Event
from tlm.serve.metrics import Metrics
from tlm.serve.schema import (
    ChatRequest,
    CompletionRequest,
    Message,
    ResponseFormat,
    Sampled,
    unsupported,
)
from tlm.tokenizer import Tokenizer


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return {
            401: "authentication_error",
            404: "invalid_request_error",
            429: "rate_limit_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class Sampling:
    """A validated request's settings (`schema.Sampled`): how to decode, as the one
    `GenerationConfig` every entry point builds (`GenerationConfig.of`: its defaults are
    the CLI's and Python's too), with every candidate of `best_of` decoded; and what only
    the API has."""

    config: GenerationConfig  # num_return_sequences: the candidates (`candidates()`)
    max_tokens: int
    n: int
    best_of: int  # candidates per prompt (n unless best_of is given)
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: int | None  # alternatives per token; None: no logprobs object
    ignore_eos: bool  # an extra, as vLLM names it: decode past <|endoftext|>


def require_model(model: str | None, served: str) -> None:
    """A 404 for a model name that is not the one served (None: the one served)."""
    if model is not None and model != served:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server has {served!r}",
            "model",
            "model_not_found",
        )


def check_model(request: Sampled, model_name: str) -> None:
    require_model(request.model, model_name)
    refused = unsupported(request)
    if refused is not None:
        field, why = refused
        raise ApiError(400, f"{field}: {why}", field, "unsupported_parameter")


def sampling(
    request: CompletionRequest | ChatRequest,
    max_n: int,
    tokenizer: Tokenizer,
    default_max_tokens: int = 16,
    least_tokens: int = 1,
) -> Sampling:
    """The sampling settings of a validated request, with the checks that need more than one
    field or the model: `max_tokens` 0 only where `least_tokens` allows it (completions with
    echo: the prompt scored alone), n and best_of, logit_bias's token ids, the schema of a
    response_format."""
    r = request
    chat = isinstance(r, ChatRequest)
    max_tokens = (r.max_completion_tokens if chat else None) or r.max_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if max_tokens < least_tokens:
        message = f"max_tokens must be >= {least_tokens}, got {max_tokens}"
        raise ApiError(400, message, "max_tokens", "invalid_value")
    n = r.n or 1
    if n > max_n:
        raise ApiError(400, f"n must be <= {max_n}, got {n}", "n", "invalid_value")
    best_of = n if chat or r.best_of is None else r.best_of
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be >= n ({n})", "best_of", "invalid_value")
    if best_of > n and r.stream:
        raise ApiError(400, "best_of chooses among whole answers: not with stream", "best_of")
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if not all(stop):
        raise ApiError(400, "stop strings must not be empty", "stop", "invalid_value")
    logprobs = None if chat else r.logprobs  # completions: how many alternatives (0: none)
    if chat:  # chat: logprobs true, with top_logprobs alternatives
        if r.top_logprobs is not None and not r.logprobs:
            message = "top_logprobs needs logprobs: true"
            raise ApiError(400, message, "top_logprobs", "invalid_value")
        logprobs = (r.top_logprobs or 0) if r.logprobs else None
    try:
        config = GenerationConfig.of(
            max_new_tokens=max_tokens,
            do_sample=True,  # OpenAI samples unless told otherwise; temperature 0 is greedy
            temperature=r.temperature,
            top_p=None if r.top_p == 0 else r.top_p,  # 0 keeps the likeliest token: top-k 1
            top_k=1 if r.top_p == 0 else r.top_k,
            repetition_penalty=r.repetition_penalty,
            frequency_penalty=r.frequency_penalty,
            presence_penalty=r.presence_penalty,
            logit_bias=logit_bias(r.logit_bias, tokenizer.vocab_size),
            num_return_sequences=n,
            best_of=best_of,
            grammar=grammar(r.response_format, tokenizer),
        )
    except GenerationError as error:
        raise ApiError(400, str(error), code="invalid_value") from None
    return Sampling(
        config=config.candidates()[0],
        max_tokens=max_tokens,
        n=n,
        best_of=best_of,
        stop=tuple(stop),
        seed=r.seed,
        stream=bool(r.stream),
        include_usage=bool(r.stream_options and r.stream_options.include_usage),
        logprobs=logprobs,
        ignore_eos=bool(r.ignore_eos),
    )


def grammar(given: ResponseFormat | None, tokenizer: Tokenizer) -> Grammar | None:
    """The grammar of a response_format: None for text, any JSON object for json_object,
    JSON valid against the schema for json_schema (one without a schema: any JSON)."""
    if given is None or given.type == "text":
        return None
    if given.type == "json_schema" and given.json_schema is None:
        message = "response_format json_schema needs a json_schema object (name, schema)"
        raise ApiError(400, message, "response_format", "invalid_value")
    schema = None if given.type == "json_object" else given.json_schema.schema_ or {}
    try:
        return Grammar.json_schema(schema, tokenizer)
    except GenerationError as error:
        raise ApiError(400, str(error), "response_format", "invalid_value") from None


def logit_bias(given: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> sorted (id, bias) pairs; an id must be in the vocabulary."""
    pairs = []
    for key, bias in (given or {}).items():
        if not (key.isdigit() and int(key) < vocab_size):
            raise ApiError(
                400,
                f"logit_bias keys are token ids in 0..{vocab_size - 1}, got {key!r}",
                "logit_bias",
                "invalid_value",
            )
        pairs.append((int(key), bias))
    return tuple(sorted(pairs))


def prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts in any of OpenAI's four forms: a string, a list of strings, a
    list of token ids, or a list of such lists; none is the empty text."""
    prompt = request.prompt
    if prompt is None or isinstance(prompt, str):
        return [prompt or ""]
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def chat_messages(messages: list[Message]) -> list[dict[str, str]]:
    """The request's messages as {role, content} (developer is OpenAI's newer name for
    system; a content of text parts is their text)."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if content is None:
            raise ApiError(
                400, f"messages[{i}] has no content", f"messages[{i}].content", "invalid_value"
            )
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": content})
    return out


class Completions:
    """Events -> the text_completion object, whole or as chunks."""

    object = chunk_object = "text_completion"
    prompt_tokens = 0

    def __init__(self, model, tokenizer, echo, s: Sampling, metrics: Metrics):
        self.model, self.tokenizer, self.echo, self.s, self.metrics = (
            model,
            tokenizer,
            echo,
            s,
            metrics,
        )
        self.id, self.created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        self.jobs: list = []  # the engine's jobs of the request, once submitted
        self.streaming = False
        self.echo_logprobs: list[dict] | None = None  # per prompt, with echo and logprobs

    def opening(self, index: int, text: str) -> tuple[str, bool]:
        """The text a choice starts with (the prompt, with echo), and whether it has started."""
        return (self.echo[index // self.s.n] if self.echo is not None else "") + text, True

    def _logprobs(self, events: list[Event], offset: int) -> dict | None:
        if self.s.logprobs is None:
            return None
        tokens = [self.tokenizer.decode([e.token]) for e in events]
        top = [{self.tokenizer.decode([t]): lp for t, lp in e.top} for e in events]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_ids": [e.token for e in events],  # tlm extras: a text can be ambiguous,
            "rest": [rest(e.top) for e in events],  # and the mass past top_logprobs
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def choice(
        self, index: int, text: str, events: list[Event], offset: int, first: bool = False
    ) -> dict:
        logprobs, finish = self._logprobs(events, offset), events[-1].finish_reason
        if first and logprobs is not None and self.echo_logprobs is not None:
            echoed = self.echo_logprobs[index // self.s.n]  # the prompt's tokens come first
            logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def body(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {
            "id": self.id,
            "object": self.chunk_object if self.streaming else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    async def whole(self, events) -> dict:
        got: dict[int, list[Event]] = {}
        async for index, event in events:
            got.setdefault(index, []).append(event)
        generated = sum(len(v) for v in got.values())  # every candidate's tokens
        if self.s.best_of > self.s.n:
            got = best_of(got, self.s.best_of, self.s.n)
        choices = []
        for index in sorted(got):
            text, _ = self.opening(index, "".join(e.text for e in got[index]))
            start = len(text) - sum(len(e.text) for e in got[index])  # the echoed prompt
            choices.append(self.choice(index, text, got[index], start, first=True))
        self.metrics.generated_tokens.inc(generated)
        return self.body(choices, self.usage(generated))

    def usage(self, generated: int) -> dict:
        """OpenAI's usage; a prompt's cached tokens are those its rows took from the prefix
        cache (of a prompt's n rows, the one that took most: the prompt is counted once)."""
        cached = sum(max((c.sequence.cached for c in job.choices), default=0) for job in self.jobs)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": self.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def stream(self, events):
        """Server-sent chunks, one per token; with `stream_options.include_usage` every
        chunk has `usage: null` and a last one, with no choices, the usage."""
        self.streaming = True
        started: set[int] = set()
        offsets: dict[int, int] = {}  # text sent so far per choice
        generated = 0
        async for index, event in events:
            self.metrics.generated_tokens.inc()
            generated += 1
            text, first = event.text, index not in offsets
            if index not in started:
                text, begun = self.opening(index, text)
                if begun:
                    started.add(index)
            offset = offsets.get(index, 0) + len(text) - len(event.text)  # after an echo
            chunk = self.body([self.choice(index, text, [event], offset, first)])
            if self.s.include_usage:
                chunk["usage"] = None
            offsets[index] = offsets.get(index, 0) + len(text)
            yield f"data: {json.dumps(chunk)}\n\n"
        if self.s.include_usage:
            yield f"data: {json.dumps(self.body([], self.usage(generated)))}\n\n"
        yield "data: [DONE]\n\n"


def best_of(got: dict[int, list[Event]], candidates: int, keep: int) -> dict[int, list[Event]]:
    """Of each prompt's `candidates` answers (indices p·candidates + j), the `keep` whose
    tokens' total log-probability is highest, best first (`decode.best_rows`, as
    `model.generate` ranks them), as choices p·keep + rank."""
    answers = [got.get(i, []) for i in range((max(got) // candidates + 1) * candidates)]
    totals = torch.tensor(
        [math.fsum(e.logprob or 0.0 for e in a) for a in answers], dtype=torch.float64
    )
    return dict(enumerate(answers[i] for i in best_rows(totals, candidates, keep).tolist()))


def rest(top: list[tuple[int, float]]) -> float:
    """The probability of every token not in `top` (ids and log-probabilities)."""
    return max(0.0, 1.0 - math.fsum(math.exp(lp) for _, lp in top))


class Chat(Completions):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, model, tokenizer, s: Sampling, metrics: Metrics, plain: bool = True):
        super().__init__(model, tokenizer, None, s, metrics)
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.plain = plain  # the plain template leaves a space after "Assistant:"

    def opening(self, index: int, text: str) -> tuple[str, bool]:
        text = text.lstrip(" ") if self.plain else text
        return text, bool(text)

    def _logprobs(self, events: list[Event], offset: int) -> dict | None:
        if self.s.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                entry(e.token, e.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in e.top]}
                for e in events
            ],
            "refusal": None,
        }

    def choice(
        self, index: int, text: str, events: list[Event], offset: int, first: bool = False
    ) -> dict:
        said = {"content": text, "refusal": None}  # OpenAI's schema requires refusal
        if first or not self.streaming:  # a stream names the role in its first chunk only
            said = {"role": "assistant"} | said
        return {
            "index": index,
            "delta" if self.streaming else "message": said,
            "logprobs": self._logprobs(events, offset),
            "finish_reason": events[-1].finish_reason,
        }
