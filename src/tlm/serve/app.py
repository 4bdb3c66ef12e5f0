"""The HTTP API (FastAPI): OpenAI-compatible completions and chat, health, models, metrics.

Every request becomes `Job`s of the engine (one per prompt, with its n samples); their
events reach the request through an asyncio queue. A streamed response is server-sent
events ending in `data: [DONE]`; when its client goes away the jobs are cancelled and
their rows are free for the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from tlm.generate import GenerationConfig
from tlm.interpret.report import inspect_prompt
from tlm.serve.engine import Engine, Event, Job, QueueFull
from tlm.serve.metrics import Metrics
from tlm.serve.requests import (
    CHAT_STOP,
    ApiError,
    Sampling,
    chat_prompt,
    check_body,
    prompts,
    sampling,
)


def create_app(engine: Engine, model_name: str, api_key: str | None, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="tlm serve", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = engine.tokenizer
    context = engine.slots.model.config.context_length

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        metrics.requests.labels(request.url.path, str(error.status)).inc()
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        metrics.requests.labels(request.url.path, "500").inc()
        return JSONResponse(ApiError(500, f"internal error: {error}").body(), status_code=500)

    def authorize(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(
                401,
                "a missing or wrong API key (Authorization: Bearer KEY)",
                code="invalid_api_key",
            )

    async def read(request: Request) -> dict:
        authorize(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        return check_body(body, model_name)

    def jobs(texts: list[str], s: Sampling, extra_stop: tuple[str, ...], queue, loop) -> list[Job]:
        config = GenerationConfig(
            max_new_tokens=s.max_tokens,
            do_sample=s.temperature > 0,
            temperature=s.temperature if s.temperature > 0 else 1.0,
            top_k=s.top_k,
            top_p=s.top_p,
            repetition_penalty=s.repetition_penalty,
            num_return_sequences=s.n,
            eos_token_id=None if s.ignore_eos else tokenizer.eot_id,
        )
        out = []
        for p, text in enumerate(texts):
            ids = [tokenizer.eot_id, *tokenizer.encode(text)]
            if len(ids) > context:
                raise ApiError(
                    400,
                    f"prompt {p} has {len(ids)} tokens; the context holds {context}",
                    "prompt",
                    "context_length_exceeded",
                )

            def deliver(event, p=p):
                loop.call_soon_threadsafe(queue.put_nowait, (p, event))

            out.append(Job(ids, config, deliver, s.stop + extra_stop, s.seed, s.logprobs))
        return out

    async def run(request: Request, texts: list[str], s: Sampling, extra_stop, shape):
        if s.n > engine.max_queue:  # could never be queued, however long the client waits
            raise ApiError(
                400, f"n must be <= {engine.max_queue} (--max-queue)", "n", "invalid_value"
            )
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        started = jobs(texts, s, extra_stop, queue, loop)
        submitted = []
        try:
            for job in started:
                engine.submit(job)
                submitted.append(job)
        except QueueFull as full:
            for job in submitted:
                engine.cancel(job)
            raise ApiError(
                429, f"the server is busy: {full}; retry later", code="queue_full"
            ) from None
        shape.prompt_tokens = sum(len(j.prompt) - 1 for j in started)  # after <|endoftext|>
        metrics.prompt_tokens.inc(shape.prompt_tokens)
        metrics.requests.labels(request.url.path, "200").inc()

        async def events():
            open_jobs = len(started)
            try:
                while open_jobs:
                    p, event = await queue.get()
                    if event is None:
                        open_jobs -= 1
                    else:
                        yield p * s.n + event.index, event
            finally:
                for job in started:  # a client gone mid-stream: free its rows now
                    engine.cancel(job)

        if s.stream:
            return StreamingResponse(shape.stream(events()), media_type="text/event-stream")
        return JSONResponse(await shape.whole(events()))

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": model_name,
            "slots": len(engine.slots.rows),
            "busy": engine.busy,
            "queued": engine.queued,
        }

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "tlm"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read(request)
        texts = prompts(body)
        s = sampling(body, max_n=len(engine.slots.rows) * 4)
        echo = body.get("echo", False)
        shape = Completions(model_name, tokenizer, texts if echo is True else None, s, metrics)
        return await run(request, texts, s, (), shape)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read(request)
        s = sampling(body, max_n=len(engine.slots.rows) * 4, default_max_tokens=256)
        shape = Chat(model_name, tokenizer, s, metrics)
        return await run(request, [chat_prompt(body)], s, (CHAT_STOP,), shape)

    @app.post("/v1/inspect")
    async def inspect(request: Request):
        body = await read(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", "prompt", "invalid_type")
        n = 1 + len(tokenizer.encode(prompt))
        if n > context:
            raise ApiError(
                400,
                f"the prompt has {n} tokens; the context holds {context}",
                "prompt",
                "context_length_exceeded",
            )
        model = engine.slots.model
        fmt = getattr(model, "inference_format", None)
        if fmt not in (None, "float32"):  # its fp32 weights are released
            raise ApiError(
                400,
                f"inspection reads the fp32 weights, which a server started with --dtype "
                f"{fmt} does not keep: start it with --dtype float32",
                code="unsupported_dtype",
            )
        job = engine.call(lambda: inspect_prompt(model, tokenizer, prompt))
        return JSONResponse(await asyncio.wrap_future(job))

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("tlm.serve").joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/explorer.html", response_class=HTMLResponse)
    async def explorer():  # the inspection page of `tlm inspect`, filled in by the page
        return resources.files("tlm.interpret").joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    return app


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
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def choice(self, index: int, text: str, events: list[Event], offset: int) -> dict:
        logprobs, finish = self._logprobs(events, offset), events[-1].finish_reason
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
            choices.append(self.choice(index, text, got[index], start))
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
            text = event.text
            if index not in started:
                text, begun = self.opening(index, text)
                if begun:
                    started.add(index)
            chunk = self.body([self.choice(index, text, [event], offsets.get(index, 0))])
            offsets[index] = offsets.get(index, 0) + len(text)
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"


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

    def choice(self, index: int, text: str, events: list[Event], offset: int) -> dict:
        return {
            "index": index,
            "delta" if self.streaming else "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(events, offset),
            "finish_reason": events[-1].finish_reason,
        }
