"""`tlm eval`: loss, perplexity and bits per byte of a model on a split or on text files."""

from __future__ import annotations

import argparse
import json

from tlm.cli.args import add_command, fail
from tlm.data import TokenData, documents, resolve_sources
from tlm.evaluate import evaluate_text, evaluate_tokens
from tlm.load import load_model, load_tokenizer

EXAMPLE = """examples:
  tlm eval runs/shakespeare_char --data data/shakespeare_char --split val --json
  tlm eval runs/shakespeare_char --text some.txt other.txt
  tlm eval runs/shakespeare_char --data data/shakespeare_char --stride 16   # more context

--text reads files as `tlm prepare` does (a .txt file is one document, --line-docs one per
line, .jsonl a "text" field per line; folders, globs and built-in corpora too), and puts
<|endoftext|> before every document.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "eval", "loss, perplexity and bits per byte", EXAMPLE)
    parser.add_argument("run", help="run directory (or model directory)")
    parser.add_argument("--data", help="prepared data folder")
    parser.add_argument("--split", default="val", help="train or val (default val)")
    parser.add_argument("--text", nargs="+", metavar="FILE", help="raw UTF-8 text files")
    parser.add_argument("--line-docs", action="store_true", help="with --text: one per line")
    parser.add_argument(
        "--stride",
        type=int,
        help="rolling windows: each new window scores S tokens, with T - S of context before",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.data) == bool(args.text):
        fail("give either --data DIR (with --split) or --text FILE...")
    model = load_model(args.run)
    tokenizer = load_tokenizer(args.run)
    if args.data:
        data = TokenData(args.data)
        if load_tokenizer(data.folder).to_json() != tokenizer.to_json():
            fail(f"{args.data} was not tokenized with the tokenizer of {args.run}")
        tokens = data.split(args.split)
        scores = evaluate_tokens(
            model, tokens, tokenizer.token_bytes(), args.batch_size, None, True, args.stride
        )
        results = {"split": args.split, **scores}
    else:
        texts = list(documents(resolve_sources(args.text, args.line_docs)))
        if not texts:
            fail(f"{' '.join(args.text)}: no text to evaluate")
        scores = evaluate_text(model, tokenizer, texts, args.batch_size, True, args.stride)
        results = {"text": args.text, **scores}
    if args.stride is not None:
        results["stride"] = args.stride
    if args.json:
        print(json.dumps(results))
    else:
        print(
            f"loss {results['loss']:.4f} nats/token, perplexity {results['perplexity']:.2f}, "
            f"{results['bits_per_byte']:.4f} bits/byte over {results['tokens']:,} tokens "
            f"({results['bytes']:,} bytes)"
        )
    return 0
