"""`tlm inspect`: pictures and a page of what a model does with one prompt."""

from __future__ import annotations

import argparse
from pathlib import Path

from tlm.cli.args import add_command
from tlm.interpret.hooks import check_head
from tlm.interpret.report import inspect_prompt, write_report
from tlm.load import load_language_model, load_tokenizer

EXAMPLE = """examples:
  tlm inspect runs/demo --prompt "for item in items:" --out out/inspect
  tlm inspect path/to/gpt2 --prompt "The Eiffel Tower is in the city of" \\
      --corrupted "The Colosseum is in the city of" --target " Paris" --foil " Rome" --out out/paris

Writes attention.png (every layer and head), attention-L<l>H<h>.png (one head, tokens on
both axes), logit-lens.png, residual-norms.png, with --corrupted patching-positions.png and
patching-heads.png, and index.html: one self-contained page (open it in a browser; it needs
no network) where hovering a token shows its attention row and the logit lens at every depth.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "inspect", "look inside a model on one prompt", EXAMPLE)
    parser.add_argument("run", help="run directory or Hugging Face GPT-2 directory")
    parser.add_argument("--prompt", required=True, help="the (clean) prompt")
    parser.add_argument("--corrupted", help="a prompt of the same token length, for patching")
    parser.add_argument("--target", help="the token whose logit to explain (default: the top one)")
    parser.add_argument("--foil", help="with --corrupted: patch u[target] - u[foil]")
    parser.add_argument("--out", required=True, help="folder for the pictures and index.html")
    parser.add_argument("--layer", type=int, default=0, help="the head to draw alone: its layer")
    parser.add_argument("--head", type=int, default=0, help="... and its index (0)")
    parser.add_argument("--top-k", type=int, default=5, help="tokens per depth in the lens (5)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    model = load_language_model(args.run)
    tokenizer = load_tokenizer(args.run)
    check_head(model, args.layer, args.head)
    data = inspect_prompt(
        model, tokenizer, args.prompt, args.corrupted, args.target, args.foil, args.top_k
    )
    written = write_report(data, Path(args.out), args.layer, args.head)
    print(f"wrote {len(written)} files to {args.out}; open {Path(args.out) / 'index.html'}")
    return 0
