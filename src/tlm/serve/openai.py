"""The OpenAI API's shapes: request bodies in, completion objects out.

Request bodies are checked by hand so that every mistake gets the OpenAI error shape:
{"error": {"message", "type", "param", "code"}} with its status. `Completions` and `Chat`
turn the engine's events into the text_completion and chat.completion objects, whole or
as server-sent chunks.

The chat template (documented in docs/serve.md) renders messages to one plain prompt:

    System: <content>
    User: <content>
    Assistant: <content>
    ...
    Assistant:

and the reply stops at "\\nUser:" (as well as at the end of text and the caller's stops).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from tlm.serve.engine import Event
from tlm.serve.metrics import Metrics

ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOP = "\nUser:"


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
    """The settings both endpoints share, checked."""

    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    n: int
    stop: tuple[str, ...]
    seed: int | None
    repetition_penalty: float
    stream: bool
    logprobs: int
    ignore_eos: bool  # an extra, as vLLM names it: decode past <|endoftext|>


def check_body(body: object, model_name: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server has {model_name!r}",
            "model",
            "model_not_found",
        )
    return body


def _number(body: dict, name: str, default, low, high, integer=False, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ApiError(
            400,
            f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}",
            name,
            "invalid_type",
        )
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        bound = f"{'>' if low_open else '>='} {low}" + ("" if high is None else f" and <= {high}")
        raise ApiError(400, f"{name} must be {bound}, got {value!r}", name, "invalid_value")
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", name, "invalid_type")
    return value


def sampling(
    body: dict, max_n: int, default_max_tokens: int = 16, least_tokens: int = 1
) -> Sampling:
    """The sampling settings of a request, checked; `max_tokens` may be 0 only where
    `least_tokens` says so (completions with echo: the prompt scored alone)."""
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)
    ):
        raise ApiError(
            400,
            "stop must be a non-empty string or a list of at most 4 of them",
            "stop",
            "invalid_value",
        )
    logprobs = body.get("logprobs")
    if logprobs is True:  # chat's form: logprobs true with top_logprobs k
        logprobs = max(1, _number(body, "top_logprobs", 0, 0, 20, integer=True))
    elif logprobs is False:
        logprobs = 0
    else:
        logprobs = _number(body, "logprobs", 0, 0, 20, integer=True)
    return Sampling(
        max_tokens=_number(body, "max_tokens", default_max_tokens, least_tokens, None, True),
        temperature=float(_number(body, "temperature", 1.0, 0, 2)),
        top_p=_number(body, "top_p", None, 0, 1, low_open=True),
        top_k=_number(body, "top_k", None, 1, None, integer=True),
        n=_number(body, "n", 1, 1, max_n, integer=True),
        stop=tuple(stop),
        seed=_number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, 0, None, low_open=True)),
        stream=_bool(body, "stream"),
        ignore_eos=_bool(body, "ignore_eos"),
        logprobs=logprobs,
    )


def prompts(body: dict) -> list[str | list[int]]:
    """The request's prompts in any of OpenAI's four forms: a string, a list of strings, a
    list of token ids, or a list of such lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if token_ids(prompt):
            return [prompt]
        if all(isinstance(p, list) and p and token_ids(p) for p in prompt):
            return prompt
    raise ApiError(
        400,
        "prompt must be a string, a list of token ids, or a non-empty list of either",
        "prompt",
        "invalid_type",
    )


def token_ids(values: list) -> bool:
    """Whether a JSON list holds token ids (integers, not booleans)."""
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def chat_prompt(body: dict) -> str:
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise ApiError(400, "messages must be a non-empty list", "messages", "invalid_type")
    lines = []
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and message.get("role") in ROLES
            and isinstance(message.get("content"), str)
        ):
            raise ApiError(
                400,
                f"messages[{i}] needs a role ({', '.join(ROLES)}) and a string content",
                f"messages[{i}]",
                "invalid_value",
            )
        lines.append(f"{ROLES[message['role']]}: {message['content']}\n")
    return "".join(lines) + "Assistant:"


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
        self.streaming = False
        self.echo_logprobs: list[dict] | None = None  # per prompt, with echo and logprobs

    def opening(self, index: int, text: str) -> tuple[str, bool]:
        """The text a choice starts with (the prompt, with echo), and whether it has started."""
        return (self.echo[index // self.s.n] if self.echo is not None else "") + text, True

    def _logprobs(self, events: list[Event], offset: int) -> dict | None:
        if not self.s.logprobs:
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
        choices = []
        for index in sorted(got):
            text, _ = self.opening(index, "".join(e.text for e in got[index]))
            start = len(text) - sum(len(e.text) for e in got[index])  # the echoed prompt
            choices.append(self.choice(index, text, got[index], start, first=True))
        generated = sum(len(v) for v in got.values())
        self.metrics.generated_tokens.inc(generated)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": generated}
        return self.body(choices, usage | {"total_tokens": self.prompt_tokens + generated})

    async def stream(self, events):
        self.streaming = True
        started: set[int] = set()
        offsets: dict[int, int] = {}  # text sent so far per choice
        async for index, event in events:
            self.metrics.generated_tokens.inc()
            text, first = event.text, index not in offsets
            if index not in started:
                text, begun = self.opening(index, text)
                if begun:
                    started.add(index)
            offset = offsets.get(index, 0) + len(text) - len(event.text)  # after an echo
            chunk = self.body([self.choice(index, text, [event], offset, first)])
            offsets[index] = offsets.get(index, 0) + len(text)
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"


def rest(top: list[tuple[int, float]]) -> float:
    """The probability of every token not in `top` (ids and log-probabilities)."""
    return max(0.0, 1.0 - math.fsum(math.exp(lp) for _, lp in top))


class Chat(Completions):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, model, tokenizer, s: Sampling, metrics: Metrics):
        super().__init__(model, tokenizer, None, s, metrics)
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"

    def opening(self, index: int, text: str) -> tuple[str, bool]:
        text = text.lstrip(" ")  # the template leaves a space after "Assistant:"
        return text, bool(text)

    def _logprobs(self, events: list[Event], offset: int) -> dict | None:
        if not self.s.logprobs:
            return None
        decode = self.tokenizer.decode
        return {
            "content": [
                {
                    "token": decode([e.token]),
                    "logprob": e.logprob,
                    "top_logprobs": [{"token": decode([t]), "logprob": lp} for t, lp in e.top],
                }
                for e in events
            ]
        }

    def choice(
        self, index: int, text: str, events: list[Event], offset: int, first: bool = False
    ) -> dict:
        return {
            "index": index,
            "delta" if self.streaming else "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(events, offset),
            "finish_reason": events[-1].finish_reason,
        }
