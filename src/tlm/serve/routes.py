"""The HTTP routes (FastAPI): OpenAI-compatible completions and chat, health, models,
metrics, the inspection endpoint and the page.

Each handler is short: it reads its request (`openai.py` checks the body), turns the
prompts into the engine's `Job`s (one per prompt, with its n samples), and hands the
engine's events to the response shape (`openai.Completions`, `openai.Chat`). Events
reach the request through an asyncio queue. A streamed response is server-sent events
ending in `data: [DONE]`; when its client goes away the jobs are cancelled and their rows
are free for the next step. The server's state lives in one `Server` object on the app.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from tlm._version import __version__
from tlm.chat import END, PLAIN_STOP, plain_prompt, speaks
from tlm.interpret.report import inspect_prompt
from tlm.interpret.report import page as filled_page
from tlm.serve import explain
from tlm.serve.echo import echoed, prompt_only, prompt_only_stream
from tlm.serve.engine import Engine, Job, QueueFull
from tlm.serve.metrics import Metrics
from tlm.serve.openai import (
    ApiError,
    Chat,
    Completions,
    Sampling,
    chat_messages,
    check_model,
    prompts,
    require_model,
    sampling,
)
from tlm.serve.page_schema import PAGE_ERRORS, InspectRequest
from tlm.serve.schema import (
    ERRORS,
    STREAM,
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    Model,
    ModelList,
)
from tlm.serve.server import Authorized, Server, chat_ids, ids, window


def create_app(engine: Engine, model_name: str, api_key: str | None, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="tlm serve", redoc_url=None, version=__version__)
    app.state.server = Server(engine, model_name, api_key, metrics)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.add_middleware(BodiesAreJson)
    app.include_router(router)
    app.include_router(explain.router)
    return app


class BodiesAreJson:
    """A request body is read as JSON whatever its Content-Type says: `curl -d` and Python's
    urllib send form encoding by default, and OpenAI's API takes JSON only."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


async def api_error(request: Request, error: ApiError) -> JSONResponse:
    request.app.state.server.metrics.requests.labels(request.url.path, str(error.status)).inc()
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (a body that is not UTF-8, an unknown path or method) in
    OpenAI's shape too."""
    message = "the request body is not valid JSON" if error.status_code == 400 else error.detail
    code = "invalid_json" if error.status_code == 400 else None
    return await api_error(request, ApiError(error.status_code, str(message), code=code))


async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body the request models refuse -> 400 in OpenAI's shape, naming the field."""
    errors = error.errors()
    if [part for part in errors[0]["loc"] if part != "body"] == []:  # not an object: JSON?
        try:
            json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            errors = [{"type": "json_invalid", "loc": ("body",)}]
    return await api_error(request, refusal(errors))


def refusal(errors) -> ApiError:
    first = errors[0]
    kind, where = first["type"], [part for part in first["loc"] if part != "body"]
    if kind == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    if not where:
        return ApiError(400, "the request body must be a JSON object", code="invalid_type")
    param = str(where[0])
    for part in where[1:]:  # fields and list indices, up to the first union member's name
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in UNION_MEMBERS:
            param += f".{part}"
        else:
            break
    if param in ONE_OF:
        return ApiError(400, f"{param} must be {ONE_OF[param]}", param, "invalid_type")
    if kind == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument: {param}", param, "unknown_parameter")
    code = "invalid_type" if kind.endswith("_type") or kind == "missing" else "invalid_value"
    return ApiError(400, f"{param}: {first['msg']}", param, code)


UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none"}
ONE_OF = {  # the unions, said once
    "prompt": "a string, a list of strings, a list of token ids, or a list of such lists",
    "stop": "a string or a list of at most 4 strings",
}


async def server_error(request: Request, error: Exception) -> JSONResponse:
    request.app.state.server.metrics.requests.labels(request.url.path, "500").inc()
    return JSONResponse(ApiError(500, f"internal error: {error}").body(), status_code=500)


router = APIRouter()
HEALTH_CONFIG = ("n_layers", "n_heads", "d_model", "context_length", "vocab_size")


@router.get("/health")
async def health(request: Request) -> dict:
    server = request.app.state.server
    engine = server.engine
    slots, config = len(engine.slots.rows), engine.slots.model.config
    return {
        "status": "ok",
        "model": server.name,
        "slots": slots,
        "busy": engine.busy,
        "queued": engine.queued,
        "chat": speaks(engine.tokenizer),  # a run made for chat: its template, the page's chat
        "prefix_cache": prefix_cache(engine.slots.prefix),
        "config": {name: getattr(config, name) for name in HEALTH_CONFIG},
    }


def prefix_cache(cache) -> dict | None:
    """The prefix cache's size and budget (None: off, --prefix-cache-mb 0)."""
    if cache is None:
        return None
    held = {"block": cache.block, "blocks": len(cache), "bytes": cache.bytes}
    return held | {"budget": cache.budget}


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def models(server: Authorized) -> dict:
    return {"object": "list", "data": [described(server)]}


@router.get("/v1/models/{model}", response_model=Model, responses=ERRORS)
async def model(model: str, server: Authorized) -> dict:
    require_model(model, server.name)
    return described(server)


def described(server: Server) -> dict:
    return {"id": server.name, "object": "model", "created": 0, "owned_by": "tlm"}


async def settings(*args, **kwargs) -> Sampling:
    """`openai.sampling` off the event loop: a response_format's grammar compiles there (up
    to a few hundred ms for a large schema over a 50k vocabulary)."""
    return await run_in_threadpool(sampling, *args, **kwargs)


COMPLETION = {200: {"model": Completion, "content": STREAM}} | ERRORS
CHAT = {200: {"model": ChatCompletion, "content": STREAM}} | ERRORS


@router.post("/v1/completions", response_model=None, responses=COMPLETION)
async def completions(request: Request, body: CompletionRequest, server: Authorized):
    check_model(body, server.name)
    echoing = bool(body.echo)
    texts = prompts(body)
    for p, text in enumerate(texts):  # ids outside the vocabulary: a 400 before any use
        if not isinstance(text, str):
            ids(server, text, f"prompt {p}", whole=False)
    tokenizer = server.engine.tokenizer
    s = await settings(body, server.max_n, tokenizer, least_tokens=0)
    decode = server.engine.tokenizer.decode
    echo = [t if isinstance(t, str) else decode(t) for t in texts] if echoing else None
    shape = Completions(server.name, server.engine.tokenizer, echo, s, server.metrics)
    if echoing and s.logprobs is not None:
        shape.echo_logprobs = await echoed(server, texts, s.logprobs)
    if s.max_tokens == 0:  # nothing generated (with echo: the prompt, and its score)
        shape.echo = shape.echo or [""] * len(texts)
        given = [ids(server, t, f"prompt {p}") for p, t in enumerate(texts)]
        shape.prompt_tokens = prompt_tokens(texts, given)
        server.metrics.prompt_tokens.inc(shape.prompt_tokens)
        server.metrics.requests.labels(request.url.path, "200").inc()
        if s.stream:
            return StreamingResponse(prompt_only_stream(shape, s.n), media_type="text/event-stream")
        return JSONResponse(prompt_only(shape, s.n))
    return await answer(request, texts, s, (), shape)


@router.post("/v1/chat/completions", response_model=None, responses=CHAT)
async def chat(request: Request, body: ChatRequest, server: Authorized):
    """A run made for chat answers in its template until end of turn; a base run gets the
    plain template (`tlm/chat.py`)."""
    check_model(body, server.name)
    tokenizer = server.engine.tokenizer
    s = await settings(body, server.max_n, tokenizer, default_max_tokens=256)
    messages = chat_messages(body.messages)
    if not speaks(tokenizer):
        shape = Chat(server.name, tokenizer, s, server.metrics)
        return await answer(request, [plain_prompt(messages)], s, (PLAIN_STOP,), shape)
    prompt = chat_ids(server, messages, s.max_tokens)
    shape = Chat(server.name, tokenizer, s, server.metrics, plain=False)
    ends = (tokenizer.special_id(END),)
    return await answer(request, [prompt.ids], s, (), shape, ends)


@router.post("/v1/inspect", response_model=None, responses=PAGE_ERRORS)
async def inspect(body: InspectRequest, server: Authorized) -> JSONResponse:
    require_model(body.model, server.name)
    model, tokenizer = server.engine.slots.model, server.engine.tokenizer
    prompt, first = window(server, body.prompt, "the prompt")  # as explain's routes read it
    explain.fp32_only(model)
    inspected = await explain.in_engine(
        server, lambda: inspect_prompt(model, tokenizer, prompt, lessons=False)
    )  # an empty prompt: a 400 (HookError), not a 500
    return JSONResponse({**inspected, "window": [first, first + len(prompt) - 1]})


@router.get("/", response_class=HTMLResponse)
async def page() -> str:
    return filled_page("tlm.serve")


@router.get("/explorer.html", response_class=HTMLResponse)
async def explorer() -> str:  # the inspection page of `tlm inspect`, filled in by the page
    return filled_page("tlm.interpret")


@router.get("/metrics")
async def prometheus(request: Request) -> PlainTextResponse:
    metrics = request.app.state.server.metrics
    return PlainTextResponse(metrics.render(), media_type=metrics.content_type)


def prompt_tokens(texts: list[str | list[int]], tokens: list[list[int]]) -> int:
    """The prompts' tokens as the client gave them: a text's after the <|endoftext|> tlm
    puts before it, a list of ids whole."""
    return sum(len(t) - isinstance(text, str) for text, t in zip(texts, tokens, strict=True))


async def answer(request: Request, texts: list, s: Sampling, extra_stop, shape, ends=()):
    """Submit a job per prompt and answer with the shape: whole, or streamed as events;
    `ends` are end tokens besides <|endoftext|> (a chat template's end of turn)."""
    server = request.app.state.server
    if s.best_of > server.engine.max_queue:  # could never be queued, however long it waits
        name = "n" if s.best_of == s.n else "best_of"
        raise ApiError(
            400, f"{name} must be <= {server.engine.max_queue} (--max-queue)", name, "invalid_value"
        )
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    started = jobs(server, texts, s, extra_stop, queue, loop, ends)
    submit(server.engine, started)
    shape.prompt_tokens = prompt_tokens(texts, [j.prompt for j in started])
    shape.jobs = started  # their prompts' cached tokens, read when the usage is written
    server.metrics.prompt_tokens.inc(shape.prompt_tokens)
    server.metrics.requests.labels(request.url.path, "200").inc()
    events = _events(server.engine, started, queue, s.best_of)
    if s.stream:
        return StreamingResponse(shape.stream(events), media_type="text/event-stream")
    return JSONResponse(await until_gone(request, shape.whole(events), server.engine, started))


async def until_gone(request: Request, answer, engine: Engine, started: list[Job]):
    """The whole answer, unless its client goes away first: then its jobs are cancelled and
    their rows free for the next step, as a stream's are, instead of decoding for nobody."""
    task = asyncio.ensure_future(answer)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            for job in started:
                engine.cancel(job)
            task.cancel()
            raise ApiError(499, "the client went away", code="client_closed")


def jobs(server: Server, texts: list, s: Sampling, extra_stop, queue, loop, ends=()) -> list[Job]:
    config = s.config  # every candidate decoded; the best n are answered
    if not s.ignore_eos:
        config = replace(config, eos_token_id=(server.engine.tokenizer.eot_id, *ends))
    out = []
    for p, text in enumerate(texts):

        def deliver(event, p=p):
            loop.call_soon_threadsafe(queue.put_nowait, (p, event))

        prompt = ids(server, text, f"prompt {p}")
        out.append(Job(prompt, config, deliver, s.stop + extra_stop, s.seed, s.logprobs or 0))
    return out


def submit(engine: Engine, started: list[Job]) -> None:
    """All of a request's jobs are queued, or none (429)."""
    submitted = []
    try:
        for job in started:
            engine.submit(job)
            submitted.append(job)
    except QueueFull as full:
        for job in submitted:
            engine.cancel(job)
        raise ApiError(429, f"the server is busy: {full}; retry later", code="queue_full") from None


async def _events(engine: Engine, started: list[Job], queue: asyncio.Queue, n: int):
    """(choice index, event) as they come, until every job has ended."""
    open_jobs = len(started)
    try:
        while open_jobs:
            p, event = await queue.get()
            if event is None:
                open_jobs -= 1
            elif event.error is not None:
                raise ApiError(500, f"internal error: {event.error}")
            else:
                yield p * n + event.index, event
    finally:
        for job in started:  # a client gone mid-stream: free its rows now
            engine.cancel(job)
