"""The page's routes (tlm extras, not OpenAI's) as pydantic models: their request bodies,
validated in one place as `schema.py` validates OpenAI's, and the answers whose shape is
fixed; /openapi.json and /docs describe both.

Requests are strict and closed like OpenAI's (`schema.Closed`): a field the route does
not know is a 400 naming it. lm-eval's remote tokenizer sends `/tokenize` only `prompt`
and `add_special_tokens`, and `/detokenize` only `tokens`. Bounds that need the model (the
vocabulary, the number of layers and heads) are checked by the routes.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, StrictInt

from tlm.serve.schema import ERRORS, Closed, Message, TokenIds

PAGE_ERRORS = {status: ERRORS[status] for status in (400, 401, 404)}  # never queued: no 429


class PageRequest(Closed):
    model: str | None = None  # this server's model, or left out


class TokenizeRequest(PageRequest):
    """`POST /tokenize` (vLLM's shape): `<|endoftext|>` first unless add_special_tokens is
    false, of any length."""

    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(PageRequest):
    """`POST /detokenize`."""

    tokens: list[StrictInt]


class DistributionRequest(PageRequest):
    """`POST /v1/distribution`: the next-token distribution after `prompt`, its `top`
    likeliest tokens (at most the vocabulary), and where `token` ranks."""

    prompt: str | TokenIds
    token: StrictInt | None = Field(None, ge=0)
    top: StrictInt = Field(20, ge=1)


class AttentionRequest(PageRequest):
    """`POST /v1/attention`: one head (below the model's `n_heads`) of one layer (below its
    `n_layers`) on `prompt`, step by step."""

    prompt: str | TokenIds
    layer: StrictInt = Field(0, ge=0)
    head: StrictInt = Field(0, ge=0)


class ChatRenderRequest(PageRequest):
    """`POST /v1/chat/render`: a conversation in the run's chat template, as
    /v1/chat/completions renders it for a reply of `max_tokens`."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt = Field(256, ge=1)


class InspectRequest(PageRequest):
    """`POST /v1/inspect`: what `tlm inspect` computes for `prompt`."""

    prompt: str


# answers


class Tokens(BaseModel):
    tokens: list[int]
    texts: list[str]  # each token's text
    count: int
    max_model_len: int


class ChatRendered(BaseModel):
    tokens: list[int]
    texts: list[str]  # each token's text
    dropped: int  # the oldest turns left out: the conversation outgrew the context


class Detokenized(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What a remote tokenizer client (lm-eval's `tokenizer_backend=remote`) asks first."""

    tokenizer_class: str
    eos_token: str
    bos_token: str
    pad_token: str
    model_max_length: int


class TopToken(BaseModel):
    id: int
    token: str
    logprob: float


class RankedToken(TopToken):
    rank: int  # 0: the likeliest


Window = list[int]  # [first, last]: the positions the model read (the last `window` tokens)


class Distribution(BaseModel):
    position: int  # the prompt's length: the distribution is of the token at this index
    window: Window
    top: list[TopToken]
    logprobs: list[float]  # every token's, largest first
    token: RankedToken | None = None  # only when asked


Grid = list[list[float | None]]  # [T][T]; null for -inf


class AttentionSteps(BaseModel):
    """One head step by step (eq. 9.10-9.14, `interpret.attention.attention_steps`)."""

    tokens: list[str]  # those of the window
    ids: list[int]
    window: Window
    layer: int
    head: int
    scores: Grid  # before the mask (eq. 9.11)
    masked: Grid
    pattern: Grid  # eq. 9.12
    contrib: Grid  # α_ij ‖v_j‖ (eq. 9.13)
    value_norms: list[float]  # [T], each ‖v_j‖
