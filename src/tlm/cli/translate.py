"""`tlm translate`: sentences in, translations out, with an encoder-decoder run."""

from __future__ import annotations

import argparse
import sys

from tlm.cli.args import add_command, add_model_flags, fail, model_device
from tlm.data.pairs import read_lines
from tlm.generate.translate import translate
from tlm.load import load_tokenizer, load_translation_model, source_of

EXAMPLE = """examples:
  tlm translate runs/multi30k "A man rides a bike." "Two dogs play in the snow."
  tlm translate runs/multi30k --file test.en.gz > test.hyp.de     # a line in, a line out
  tlm translate --beams 1 runs/multi30k "A girl reads a book."    # greedy (options first)
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "translate", "translate sentences with an encoder-decoder", EXAMPLE)
    parser.add_argument("run", help="run directory of a translation model")
    parser.add_argument("sentences", nargs="*", help="sentences to translate")
    parser.add_argument("--file", help="a file of sentences, one a line (.txt or .gz)")
    parser.add_argument("--beams", type=int, default=4, help="beam size (4; 1 is greedy)")
    parser.add_argument("--alpha", type=float, default=0.6, help="length penalty α (0.6)")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences decoded at once")
    parser.add_argument("--max-new-tokens", type=int, help="(default: source length + 50)")
    add_model_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.sentences) == bool(args.file):
        fail("give sentences to translate, or --file FILE (not both)")
    sentences = args.sentences or [line.strip() for line in read_lines(args.file)]
    empty = [n for n, s in enumerate(sentences, start=1) if not s]
    if empty:
        fail(f"line {empty[0]} of {args.file} is empty ({len(empty)} empty lines in all)")
    source = source_of(args.run)
    model = load_translation_model(source, model_device(args), args.weights)
    tokenizer = load_tokenizer(source)
    outputs = translate(
        model, tokenizer, sentences, args.beams, args.alpha, args.batch_size, args.max_new_tokens
    )
    for line in outputs:
        sys.stdout.write(line.replace("\n", " ") + "\n")
    return 0
