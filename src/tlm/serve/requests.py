"""Request bodies of the OpenAI API, checked by hand so that every mistake gets the
OpenAI error shape: {"error": {"message", "type", "param", "code"}} with its status.

The chat template (documented in docs/serve.md) renders messages to one plain prompt:

    System: <content>
    User: <content>
    Assistant: <content>
    ...
    Assistant:

and the reply stops at "\\nUser:" (as well as at the end of text and the caller's stops).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def sampling(body: dict, max_n: int, default_max_tokens: int = 16) -> Sampling:
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
        logprobs = max(1, _number(body, "top_logprobs", 0, 0, 5, integer=True))
    elif logprobs is False:
        logprobs = 0
    else:
        logprobs = _number(body, "logprobs", 0, 0, 5, integer=True)
    return Sampling(
        max_tokens=_number(body, "max_tokens", default_max_tokens, 1, None, integer=True),
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


def prompts(body: dict) -> list[str]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    raise ApiError(
        400, "prompt must be a string or a non-empty list of strings", "prompt", "invalid_type"
    )


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
