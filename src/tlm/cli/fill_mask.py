"""`tlm fill-mask`: the most probable tokens at each [MASK] of a text (an encoder run)."""

from __future__ import annotations

import argparse
import json

from tlm.cli.args import add_command, add_model_flags, fail, model_device

EXAMPLE = """examples:
  tlm fill-mask runs/encoder "The [MASK] module reads and writes JSON."
  tlm fill-mask runs/encoder "import [MASK]" --top-k 10 --json

The text is read whole, as `[CLS] text [SEP]`; each [MASK] gets its --top-k most probable
tokens with their probabilities (every mask predicted at once, the others still masked).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "fill-mask", "predict the tokens at [MASK] (an encoder run)", EXAMPLE)
    parser.add_argument("run", help="run directory of an encoder (tlm train --objective mlm)")
    parser.add_argument("text", help="text with one or more [MASK]")
    parser.add_argument("--top-k", type=int, default=5, help="candidates per mask (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tlm.load import load_encoder, load_tokenizer, source_of
    from tlm.tasks.fill_mask import fill_mask

    if args.top_k < 1:
        fail("--top-k must be at least 1")
    source = source_of(args.run)
    model = load_encoder(source, model_device(args), args.weights)
    masks = fill_mask(model, load_tokenizer(source), args.text, args.top_k)
    if args.json:
        rows = [
            [{"token": f.token, "id": f.token_id, "probability": f.probability} for f in m]
            for m in masks
        ]
        print(json.dumps({"text": args.text, "masks": rows}))
        return 0
    for n, candidates in enumerate(masks, start=1):
        print(f"[MASK] {n}:")
        for f in candidates:
            print(f"  {f.probability:.4f}  {f.token!r}")
    return 0
