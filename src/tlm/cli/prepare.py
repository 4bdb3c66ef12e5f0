"""`tlm prepare`: corpus -> tokenizer + packed token files."""

from __future__ import annotations

import argparse

from tlm.cli.args import add_command
from tlm.data import prepare

EXAMPLE = """examples:
  tlm prepare python-docs --tokenizer bpe --vocab-size 2048 --out data/python-docs
  tlm prepare tinyshakespeare --tokenizer char --val-fraction 0.1 --out data/shakespeare_char
  tlm prepare names --line-docs --tokenizer char --out data/names   # one document per name
  tlm prepare more.txt --tokenizer runs/my_model --out data/finetune   # reuse a tokenizer
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "prepare", "train a tokenizer and pack a corpus into token files", EXAMPLE
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        help="files, folders, globs, or a built-in corpus: python-docs, tinyshakespeare, names",
    )
    parser.add_argument("--out", required=True, help="folder to create")
    parser.add_argument(
        "--tokenizer",
        default="bpe",
        help="bpe (default), char, or an existing tokenizer.json / run / data folder to reuse",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (4096)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="held-out share (0.1)")
    parser.add_argument("--line-docs", action="store_true", help="one document per line")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace --out if tlm prepare wrote it (and nothing else is in it)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    meta = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        line_docs=args.line_docs,
        force=args.force,
        progress=not args.quiet,
    )
    splits = meta["splits"]
    print(
        f"{args.out}: {meta['tokenizer']} tokenizer, vocabulary {meta['vocab_size']}, "
        f"{meta['documents']:,} documents, {splits['train']['tokens']:,} train + "
        f"{splits['val']['tokens']:,} val tokens ({meta['dtype']})"
    )
    return 0
