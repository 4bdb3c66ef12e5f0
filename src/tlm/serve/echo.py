"""`echo` with `logprobs` on /v1/completions, as OpenAI's completions API answers it: the
prompt's tokens come back before the completion's, each with its log-probability under the
model and the likeliest alternatives at its position. This is how lm-evaluation-harness's
`local-completions` scores a continuation (`max_tokens` 0 or 1, `echo: true`, `logprobs`).

A prompt given as token ids is taken as it is: its first token has no context, so its
log-probability and alternatives are null. A text prompt is read after <|endoftext|>, as
every tlm prompt is: its first token is predicted from <|endoftext|> and has both; the
<|endoftext|> itself is not echoed.
"""

from __future__ import annotations

import asyncio
import json

from tlm.generate.text import token_logprobs
from tlm.serve.openai import Completions, rest
from tlm.serve.server import Server, ids


async def echoed(server: Server, prompts: list[str | list[int]], top: int) -> list[dict]:
    """Per prompt, the logprobs object of its echo (the keys of a completion's)."""
    model, decode = server.engine.slots.model, server.engine.tokenizer.decode
    given = [ids(server, prompt, f"prompt {p}") for p, prompt in enumerate(prompts)]
    job = server.engine.call(lambda: [token_logprobs(model, t, top) for t in given])
    out = []
    for prompt, tokens, scored in zip(prompts, given, await asyncio.wrap_future(job), strict=True):
        if isinstance(prompt, list):  # as given: the first token has no context
            scored = [(None, None), *scored]
        else:  # after <|endoftext|>, which is context, not echo
            tokens = tokens[1:]
        texts = [decode([t]) for t in tokens]
        out.append(
            {
                "tokens": texts,
                "token_ids": tokens,
                "token_logprobs": [lp for lp, _ in scored],
                "top_logprobs": [
                    None if alt is None else {decode([t]): v for t, v in alt} for _, alt in scored
                ],
                "text_offset": [sum(len(t) for t in texts[:i]) for i in range(len(texts))],
                "rest": [None if alt is None else rest(alt) for _, alt in scored],
            }
        )
    return out


def prompt_only(shape: Completions, n: int) -> dict:
    """The answer to `max_tokens: 0` with `echo`: each prompt back, n times, nothing new."""
    choices = []
    for p, text in enumerate(shape.echo):
        logprobs = None if shape.echo_logprobs is None else shape.echo_logprobs[p]
        for j in range(n):
            choices.append(
                {"index": p * n + j, "text": text, "logprobs": logprobs, "finish_reason": "length"}
            )
    usage = {"prompt_tokens": shape.prompt_tokens, "completion_tokens": 0}
    return shape.body(choices, usage | {"total_tokens": shape.prompt_tokens})


async def prompt_only_stream(shape: Completions, n: int):
    shape.streaming = True
    for choice in prompt_only(shape, n)["choices"]:
        yield f"data: {json.dumps(shape.body([choice]))}\n\n"
    yield "data: [DONE]\n\n"
