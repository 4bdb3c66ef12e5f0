"""The routes behind the page's lessons (tlm extras, not OpenAI's): a prompt's tokens (and
back, as lm-eval's remote tokenizer asks), the model's whole next-token distribution at a
position (the page applies temperature, top-k and top-p to it, eq. 10.47-10.49), and one
head's attention step by step (eq. 9.10-9.14).

A position past the model's context is explained as generation computed it there: the
model reads the last tokens of the prompt that fit (`server.window_size`), and each answer says
which (`window`: the first and last positions read).

Bodies and answers are `page_schema`'s models; each route checks what needs the model.
Each reads the model in the engine thread, between two decoding steps (`Engine.call`).
"""

from __future__ import annotations

import asyncio
import math

import torch
from fastapi import APIRouter

from tlm.chat import speaks
from tlm.interpret.attention import attention_steps
from tlm.interpret.hooks import HookError
from tlm.interpret.report import next_token
from tlm.serve.openai import ApiError, chat_messages, require_model
from tlm.serve.page_schema import (
    PAGE_ERRORS,
    AttentionRequest,
    AttentionSteps,
    ChatRendered,
    ChatRenderRequest,
    Detokenized,
    DetokenizeRequest,
    Distribution,
    DistributionRequest,
    TokenizeRequest,
    TokenizerInfo,
    Tokens,
)
from tlm.serve.server import Authorized, Server, chat_ids, ids, window
from tlm.tokenizer import EOT

router = APIRouter(responses=PAGE_ERRORS)


@router.post("/tokenize", response_model=Tokens)
async def tokenize(body: TokenizeRequest, server: Authorized) -> dict:
    """A text's ids as the model reads them (<|endoftext|> first; without it when
    add_special_tokens is false) and each token's text."""
    require_model(body.model, server.name)
    tokens = ids(server, body.prompt, "the prompt", whole=False)  # any length: a client may count
    if not body.add_special_tokens:
        tokens = tokens[1:]
    decode = server.engine.tokenizer.decode
    texts = [decode([t]) for t in tokens]
    return {"tokens": tokens, "texts": texts, "count": len(tokens), "max_model_len": server.context}


@router.post("/detokenize", response_model=Detokenized)
async def detokenize(body: DetokenizeRequest, server: Authorized) -> dict:
    """Token ids -> their text."""
    require_model(body.model, server.name)
    tokens = ids(server, body.tokens, "the tokens", param="tokens")
    return {"prompt": server.engine.tokenizer.decode(tokens)}


@router.post("/v1/chat/render", response_model=ChatRendered)
async def chat_render(body: ChatRenderRequest, server: Authorized) -> dict:
    """A conversation's ids in the run's chat template, as /v1/chat/completions renders it
    for a reply of `max_tokens` (the oldest turns dropped when it outgrows the context), and
    each token's text: the page's chat mode shows these, then streams the reply after them."""
    require_model(body.model, server.name)
    if not speaks(server.engine.tokenizer):
        raise ApiError(
            400, "this run has no chat template (a base model)", "messages", "invalid_value"
        )
    prompt = chat_ids(server, chat_messages(body.messages), body.max_tokens)
    decode = server.engine.tokenizer.decode
    return {
        "tokens": prompt.ids,
        "texts": [decode([t]) for t in prompt.ids],
        "dropped": prompt.dropped,
    }


@router.get("/tokenizer_info", response_model=TokenizerInfo)
async def tokenizer_info(server: Authorized) -> dict:
    """What a remote tokenizer client (lm-eval's `tokenizer_backend=remote`) asks first."""
    return {
        "tokenizer_class": type(server.engine.tokenizer).__name__,
        "eos_token": EOT,
        "bos_token": EOT,
        "pad_token": EOT,
        "model_max_length": server.context,
    }


@router.post("/v1/distribution", response_model=Distribution, response_model_exclude_none=True)
async def distribution(body: DistributionRequest, server: Authorized) -> dict:
    """The model's next-token distribution after the prompt: every log-probability, largest
    first; the `top` likeliest tokens with their ids and text; and where `token` ranks."""
    require_model(body.model, server.name)
    seen, first = window(server, body.prompt, "the prompt")
    vocab = server.engine.tokenizer.vocab_size
    top = at_most(body.top, "top", vocab)
    token = None if body.token is None else at_most(body.token, "token", vocab - 1)
    model, device = server.engine.slots.model, server.engine.slots.device

    @torch.no_grad()
    def compute():
        return model(torch.tensor([seen], device=device))[0, -1]

    logits = await in_engine(server, compute)
    answer = next_token(server.engine.tokenizer, logits, top, token)
    end = first + len(seen)
    return {"position": end, "window": [first, end - 1], **answer}


@router.post("/v1/attention", response_model=AttentionSteps)
async def attention(body: AttentionRequest, server: Authorized) -> dict:
    """One head's scores before and after the causal mask (null for -inf), its pattern and
    each source's contribution, each [T][T], and each ‖v_j‖."""
    require_model(body.model, server.name)
    prompt, first = window(server, body.prompt, "the prompt")
    model, device = server.engine.slots.model, server.engine.slots.device
    layer = at_most(body.layer, "layer", model.config.n_layers - 1)
    head = at_most(body.head, "head", model.config.n_heads - 1)
    fp32_only(model)

    def compute():
        return attention_steps(model, torch.tensor([prompt], device=device), layer, head)

    steps = await in_engine(server, compute)
    decode = server.engine.tokenizer.decode
    answer = {"tokens": [decode([t]) for t in prompt], "ids": prompt, "layer": layer, "head": head}
    answer["window"] = [first, first + len(prompt) - 1]
    answer["value_norms"] = steps.pop("value_norms").cpu().tolist()
    for name, values in steps.items():
        rows = values.cpu().tolist()
        answer[name] = [[v if math.isfinite(v) else None for v in row] for row in rows]
    return answer


def fp32_only(model) -> None:
    """Hook points read the fp32 weights, which a server started with --dtype int8 or
    float16 has released."""
    fmt = getattr(model, "inference_format", None)
    if fmt not in (None, "float32"):
        raise ApiError(
            400,
            f"inspection reads the fp32 weights, which a server started with --dtype {fmt} "
            "does not keep: start it with --dtype float32",
            code="unsupported_dtype",
        )


async def in_engine(server: Server, compute):
    """`compute`'s result, run in the engine thread; a prompt the hooks refuse is a 400."""
    try:
        return await asyncio.wrap_future(server.engine.call(compute))
    except HookError as error:
        raise ApiError(400, str(error)) from None


def at_most(value: int, name: str, high: int) -> int:
    """A field's upper bound that needs the model (its lower bound is the schema's)."""
    if value > high:
        raise ApiError(400, f"{name} must be <= {high}, got {value}", name, "invalid_value")
    return value
