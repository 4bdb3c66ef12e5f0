"""The routes behind the page's lessons (tlm extras, not OpenAI's): a prompt's tokens, the
model's whole next-token distribution at a position (the page applies temperature, top-k
and top-p to it, eq. 10.47-10.49), and one head's attention step by step (eq. 9.10-9.14).

Each reads the model in the engine thread, between two decoding steps (`Engine.call`).
"""

from __future__ import annotations

import asyncio
import math

import torch
from fastapi import APIRouter, Request

from tlm.interpret.attention import attention_steps
from tlm.interpret.hooks import HookError
from tlm.interpret.report import next_token
from tlm.serve.openai import ApiError, token_ids
from tlm.serve.server import Server, authorized, ids, read
from tlm.tokenizer import EOT

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    """{"prompt": text, "add_special_tokens": true} -> its ids as the model reads them
    (<|endoftext|> first; without it when add_special_tokens is false) and each token's text."""
    server, body = await read(request)
    prompt = _prompt(body)
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string", "prompt", "invalid_type")
    tokens = ids(server, prompt, "the prompt", whole=False)  # any length: a client may count
    if body.get("add_special_tokens", True) is False:
        tokens = tokens[1:]
    decode = server.engine.tokenizer.decode
    texts = [decode([t]) for t in tokens]
    return {"tokens": tokens, "texts": texts, "count": len(tokens), "max_model_len": server.context}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    """{"tokens": ids} -> {"prompt": their text}."""
    server, body = await read(request)
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and token_ids(tokens)):
        raise ApiError(400, "tokens must be a list of token ids", "tokens", "invalid_type")
    return {"prompt": server.engine.tokenizer.decode(ids(server, tokens, "the tokens"))}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    """What a remote tokenizer client (lm-eval's `tokenizer_backend=remote`) asks first."""
    server = authorized(request)
    return {
        "tokenizer_class": type(server.engine.tokenizer).__name__,
        "eos_token": EOT,
        "bos_token": EOT,
        "pad_token": EOT,
        "model_max_length": server.context,
    }


@router.post("/v1/distribution")
async def distribution(request: Request) -> dict:
    """{"prompt": text or ids, "token": id?, "top": 20} -> the model's next-token
    distribution after the prompt: every log-probability, largest first; the `top` likeliest
    tokens with their ids and text; and where `token` ranks."""
    server, body = await read(request)
    prompt = ids(server, _prompt(body), "the prompt")
    top = _integer(body, "top", 20, 1, server.engine.tokenizer.vocab_size)
    token = body.get("token")
    if token is not None:
        _integer(body, "token", None, 0, server.engine.tokenizer.vocab_size - 1)
    model, device = server.engine.slots.model, server.engine.slots.device

    @torch.no_grad()
    def compute():
        return model(torch.tensor([prompt], device=device))[0, -1]

    logits = await _in_engine(server, compute)
    answer = next_token(server.engine.tokenizer, logits, top, token)
    return {"position": len(prompt), **answer}


@router.post("/v1/attention")
async def attention(request: Request) -> dict:
    """{"prompt": text or ids, "layer", "head"} -> the head's scores before and after the
    causal mask (null for -inf), its pattern and each source's contribution, each [T][T],
    and each ‖v_j‖."""
    server, body = await read(request)
    prompt = ids(server, _prompt(body), "the prompt")
    model, device = server.engine.slots.model, server.engine.slots.device
    config = model.config
    layer = _integer(body, "layer", 0, 0, config.n_layers - 1)
    head = _integer(body, "head", 0, 0, config.n_heads - 1)
    fp32_only(model)

    def compute():
        return attention_steps(model, torch.tensor([prompt], device=device), layer, head)

    steps = await _in_engine(server, compute)
    decode = server.engine.tokenizer.decode
    answer = {"tokens": [decode([t]) for t in prompt], "ids": prompt, "layer": layer, "head": head}
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


async def _in_engine(server: Server, compute):
    try:
        return await asyncio.wrap_future(server.engine.call(compute))
    except HookError as error:
        raise ApiError(400, str(error)) from None


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and token_ids(prompt):
        return prompt
    raise ApiError(
        400, "prompt must be a string or a non-empty list of token ids", "prompt", "invalid_type"
    )


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", name, "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be in {low}..{high}, got {value}", name, "invalid_value")
    return value
