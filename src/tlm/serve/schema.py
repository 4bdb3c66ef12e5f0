"""The OpenAI API's request and response bodies as pydantic models: the one place a request
is validated, and what `/openapi.json` and `/docs` describe.

Requests are strict (a number is not a string, true is not 1) and closed: a field tlm does
not know is refused, named. Of OpenAI's fields, those that do not change the output are
accepted (`user`, `store`, `metadata`, `service_tier`, `parallel_tool_calls`); those that
would and that tlm does not implement (`tools`, `functions`, `audio`, `modalities` other
than text, `prediction`, ...) are refused by `unsupported`. Ranges are OpenAI's. tlm's
extras carry vLLM's names: `top_k`, `repetition_penalty`, `ignore_eos`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Stop = str | Annotated[list[str], Field(max_length=4)] | None


class Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Closed):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # padding against side channels: none is sent


class JsonSchema(Closed):
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Closed):
    """Structured outputs: `json_object` (any JSON object) or `json_schema` (JSON valid
    against `json_schema.schema`), by constrained decoding (`tlm.generate.constrain`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class Sampled(Closed):
    """The settings both endpoints take."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # 0: the likeliest token only
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None  # completions too, as vLLM takes it
    user: str | None = None
    # tlm's extras, as vLLM names them
    top_k: int | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None


class CompletionRequest(Sampled):
    """`POST /v1/completions`. `prompt` in any of OpenAI's four forms; left out or null it is
    the empty text (a new document: <|endoftext|> alone)."""

    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)
    ] | None = None  # fmt: skip
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=20)
    suffix: str | None = None


class TextPart(Closed):
    type: Literal["text"]
    text: str


class Message(Closed):
    """A chat message. An assistant message as a response gave it (with `refusal`) may be
    sent back as it is."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # refused when not empty (no tools)


class ChatRequest(Sampled):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # OpenAI's fields that would change the output and that tlm does not implement:
    # accepted by the schema so that `unsupported` refuses them by name
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None


def unsupported(request: CompletionRequest | ChatRequest) -> tuple[str, str] | None:
    """(field, why) of the first field given that would change the answer and that tlm does
    not implement; None when there is none."""
    given = request.model_dump(exclude_none=True, by_alias=True)
    refusals = [
        ("tools", bool(given.get("tools")), "tools (function calling) are not implemented"),
        ("functions", bool(given.get("functions")), "functions are not implemented"),
        ("tool_choice", given.get("tool_choice", "none") != "none", "no tools to choose"),
        ("function_call", given.get("function_call", "none") != "none", "no functions"),
        ("audio", "audio" in given, "audio output is not implemented"),
        ("modalities", given.get("modalities", ["text"]) != ["text"], "only text is produced"),
        ("prediction", "prediction" in given, "predicted outputs are not implemented"),
        ("web_search_options", "web_search_options" in given, "web search is not implemented"),
        ("suffix", bool(given.get("suffix")), "insertion (suffix) is not implemented"),
        ("reasoning_effort", "reasoning_effort" in given, "tlm's models do not reason apart"),
        ("verbosity", "verbosity" in given, "verbosity is not implemented"),
        ("moderation", "moderation" in given, "moderation is not implemented"),
    ]
    for i, message in enumerate(given.get("messages", [])):
        if message.get("tool_calls"):
            refusals.append((f"messages[{i}].tool_calls", True, "no tools were offered"))
    return next(((field, why) for field, refused, why in refusals if refused), None)


# responses (documented in /openapi.json; the routes build the same shapes)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    token_ids: list[int]  # tlm's extras: a token's text can be ambiguous,
    rest: list[float | None]  # and the probability past top_logprobs


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERRORS = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (400, "a bad value, named in `param`"),
        (401, "a missing or wrong API key"),
        (404, "another model"),
        (429, "the queue is full; retry after `Retry-After` seconds"),
    ]
}
STREAM = {"text/event-stream": {"schema": {"type": "string"}}}
