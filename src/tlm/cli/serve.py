"""`tlm serve`: an OpenAI-compatible HTTP server for a run or a GPT-2 directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from tlm.cli.args import (
    add_command,
    add_long_context_flags,
    add_model_flags,
    fail,
    long_context_flags,
    model_device,
)
from tlm.cli.generate import load_draft
from tlm.device import describe
from tlm.generate import GenerationConfig
from tlm.inference import FORMATS
from tlm.load import load_language_model, load_tokenizer, source_of
from tlm.serve.engine import PREFILL_CHUNK

EXAMPLE = """examples:
  tlm serve runs/demo                                 # http://127.0.0.1:8000
  tlm serve out/gpt2 --port 8080 --slots 8 --dtype int8 --api-key secret
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "The for statement", "max_tokens": 20, "temperature": 0}'

Listens on loopback unless --host says otherwise. Endpoints: GET /health, /v1/models,
/metrics; POST /v1/completions, /v1/chat/completions (streaming with "stream": true).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "serve", "serve a model over HTTP (the OpenAI API)", EXAMPLE)
    parser.add_argument("run", help="run directory or GPT-2 directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1/*")
    parser.add_argument("--slots", type=int, default=4, help="sequences decoded at once (4)")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting sequences (64)")
    parser.add_argument("--dtype", default="float32", choices=FORMATS, help="weights (float32)")
    parser.add_argument("--name", help="the model's name in the API (the directory's name)")
    parser.add_argument(
        "--prompt-lookup",
        type=int,
        metavar="N",
        help="a request decoding alone drafts from its text's n-grams, n <= N (the same tokens)",
    )
    parser.add_argument(
        "--draft",
        metavar="RUN|int8",
        help="a request decoding alone drafts with RUN (same tokenizer) or int8 (own weights)",
    )
    parser.add_argument("--draft-tokens", type=int, help="most tokens a draft proposes (5)")
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        default=PREFILL_CHUNK,
        help=f"while others decode, prefill N prompt tokens a step ({PREFILL_CHUNK}; 0: all)",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=float,
        metavar="N",
        help="memory for prompts' keys and values that later requests reuse (default: a "
        "quarter of what the device has free, at most 4096; 0: off)",
    )
    add_model_flags(parser)
    add_long_context_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tlm.serve import Engine, Metrics, create_app

    if args.slots < 1 or args.max_queue < 1:
        fail("--slots and --max-queue must be at least 1")
    if not 0 <= args.port <= 65535:
        fail(f"--port {args.port} is not a port")
    if args.prefix_cache_mb is not None and not args.prefix_cache_mb >= 0:
        fail(f"--prefix-cache-mb must be 0 (off) or more, not {args.prefix_cache_mb}")
    prefix = None if args.prefix_cache_mb is None else int(args.prefix_cache_mb * 2**20)
    if args.prefill_chunk < 0:
        fail(f"--prefill-chunk must be 0 (whole prompts) or more, not {args.prefill_chunk}")
    metrics = Metrics()
    device = model_device(args, args.dtype, say=False)  # named in the first line below
    source = source_of(args.run)  # its kind decided once; the model and tokenizer read it

    def load():  # in the engine thread: the one thread that runs torch's parallel work
        return load_language_model(
            source, device, args.weights, args.dtype, **long_context_flags(args)
        )

    speculate = {"prompt_lookup": args.prompt_lookup, "draft_tokens": args.draft_tokens}
    tokenizer = None  # read after the model, whose errors say more, unless a draft needs it
    if args.draft is not None:
        tokenizer = load_tokenizer(source)
        speculate["draft"] = load_draft(
            args.draft, source, args.dtype, args.weights, tokenizer, device,
            **long_context_flags(args),
        )  # fmt: skip
    speculate = {name: value for name, value in speculate.items() if value is not None}
    GenerationConfig(**speculate)  # a bad setting: one line, before the model loads
    engine = Engine(
        load, None, args.slots, args.max_queue, metrics.on_token, speculate, prefix,
        args.prefill_chunk or None,
    )  # fmt: skip
    engine.tokenizer = tokenizer or load_tokenizer(source)
    metrics.watch(engine)
    name = args.name or Path(args.run).resolve().name
    app = create_app(engine, name, args.api_key, metrics)
    cache = engine.slots.prefix  # a PrefixCache has a length: an empty one is not "none"
    cached = cache.budget / 2**20 if cache is not None else 0
    where = f"{args.slots} slots, prefix cache {cached:,.0f} MB, {describe(device)}"
    print(f"tlm serve: {name} on http://{args.host}:{args.port} ({where})", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()
    return 0
