"""`tlm tag`: a fine-tuned encoder's tag for each word of a text (§11.4)."""

from __future__ import annotations

import argparse
import json

from tlm.cli.args import add_command, add_model_flags, model_device

EXAMPLE = """examples:
  tlm tag runs/tagger "import json and call json.dumps on the object"
  tlm tag runs/tagger "def main ( ) : return 0" --json

The text is split at whitespace into words, as the tagger's examples were ({"tokens":
[...], "tags": [...]}); each word is tagged at its first token (tlm train --task tag).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "tag", "tag each word of a text (a --task tag run)", EXAMPLE)
    parser.add_argument("run", help="run directory of an encoder fine-tuned with --task tag")
    parser.add_argument("text", help="the text; its words are split at whitespace")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tlm.load import load_encoder, load_tokenizer, source_of
    from tlm.tasks.labels import tag_words

    source = source_of(args.run)
    model = load_encoder(source, model_device(args), args.weights)
    pairs = tag_words(model, load_tokenizer(source), args.text.split())
    if args.json:
        print(json.dumps({"tokens": [w for w, _ in pairs], "tags": [t for _, t in pairs]}))
        return 0
    for word, tag in pairs:
        print(f"{word}\t{tag}")
    return 0
