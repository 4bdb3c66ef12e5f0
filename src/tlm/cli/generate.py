"""`tlm generate`: continue a prompt with a trained model, printing text as it comes."""

from __future__ import annotations

import argparse
import sys

from tlm.checkpoint import load_model
from tlm.cli.args import add_command, fail
from tlm.generate import complete
from tlm.tokenizer import load_tokenizer

EXAMPLE = """example:
  tlm generate runs/shakespeare_char --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "generate", "generate text from a prompt", EXAMPLE)
    parser.add_argument("run", help="run directory")
    parser.add_argument("--prompt", default="", help="text to continue (empty: <|endoftext|>)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        fail(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        fail(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        fail(f"--top-k must be >= 1, got {args.top_k}")
    model = load_model(args.run)
    tokenizer = load_tokenizer(args.run)
    sys.stdout.write(args.prompt)
    pieces = complete(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        on_truncate=_say_truncated,
    )
    for text in pieces:
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _say_truncated(n: int, kept: int) -> None:
    print(f"tlm: prompt has {n} tokens; keeping the last {kept}", file=sys.stderr)
