"""`tlm inspect`: pictures and a page of what a model does with one prompt."""

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
from tlm.generate.translate import translate
from tlm.interpret.attention import cross_attention_of
from tlm.interpret.hooks import check_head
from tlm.interpret.plots import plot_attention, plot_attention_grid
from tlm.interpret.report import inspect_prompt, write_report
from tlm.load import load_model, load_tokenizer, source_of
from tlm.model import EncoderDecoder

EXAMPLE = """examples:
  tlm inspect runs/demo --prompt "for item in items:" --out out/inspect
  tlm inspect path/to/gpt2 --prompt "The Eiffel Tower is in the city of" \\
      --corrupted "The Colosseum is in the city of" --target " Paris" --foil " Rome" --out out/paris

For an encoder run (tlm train --objective mlm, or fine-tuned), --prompt is read as
[CLS] prompt [SEP] ([MASK] allowed): its attention is all-to-all, and the lens reads each
depth through its head (tokens, or a fine-tuned head's labels).

For a translation run, --prompt is the source sentence: it is translated (beam 4) and
cross-attention.png shows, for every decoder layer and head, which source token each
target token read; cross-attention-L<l>.png shows layer --layer's heads averaged.

Writes attention.png (every layer and head), attention-L<l>H<h>.png (one head, tokens on
both axes), logit-lens.png, residual-norms.png, with --corrupted patching-positions.png and
patching-heads.png, and index.html: one self-contained page (open it in a browser; it needs
no network) where hovering a token shows its attention row and the logit lens at every depth.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "inspect", "look inside a model on one prompt", EXAMPLE)
    parser.add_argument("run", help="run directory or Hugging Face directory")
    parser.add_argument("--prompt", required=True, help="the (clean) prompt")
    parser.add_argument("--corrupted", help="a prompt of the same token length, for patching")
    parser.add_argument("--target", help="the token whose logit to explain (default: the top one)")
    parser.add_argument("--foil", help="with --corrupted: patch u[target] - u[foil]")
    parser.add_argument("--out", required=True, help="folder for the pictures and index.html")
    parser.add_argument("--layer", type=int, default=0, help="the head to draw alone: its layer")
    parser.add_argument("--head", type=int, default=0, help="... and its index (0)")
    parser.add_argument("--top-k", type=int, default=5, help="tokens per depth in the lens (5)")
    add_model_flags(parser)
    add_long_context_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    source = source_of(args.run)
    model = load_model(source, model_device(args), args.weights, **long_context_flags(args))
    tokenizer = load_tokenizer(source)
    if isinstance(model, EncoderDecoder):
        return inspect_translation(args, model, tokenizer)
    check_head(model, args.layer, args.head)
    data = inspect_prompt(
        model, tokenizer, args.prompt, args.corrupted, args.target, args.foil, args.top_k
    )
    written = write_report(data, Path(args.out), args.layer, args.head)
    print(f"wrote {len(written)} files to {args.out}; open {Path(args.out) / 'index.html'}")
    return 0


def inspect_translation(args: argparse.Namespace, model: EncoderDecoder, tokenizer) -> int:
    """Translate the prompt, then draw the decoder's cross-attention over the source."""
    if args.corrupted or args.target or args.foil:
        fail("--corrupted, --target and --foil apply to language models")
    check_head(model, args.layer, args.head)
    translation = translate(model, tokenizer, [args.prompt])[0]
    patterns, rows, keys = cross_attention_of(model, tokenizer, args.prompt, translation)
    out = Path(args.out)
    title = "cross-attention α: row = target token read, column = source token"
    plot_attention(patterns, rows, out / "cross-attention.png", title, keys=keys)
    mean = patterns[args.layer].mean(0)
    name = f"cross-attention-L{args.layer}.png"
    plot_attention_grid(mean, rows, out / name, f"layer {args.layer}, heads averaged", keys)
    print(f"{args.prompt} -> {translation}")
    print(f"wrote cross-attention.png and {name} to {args.out}")
    return 0
