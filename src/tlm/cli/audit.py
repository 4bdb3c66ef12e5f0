"""`tlm audit`: what a trained model gives back verbatim of its training data (§10.10)."""

from __future__ import annotations

import argparse
import json

from tlm.audit import audit, passes, record
from tlm.cli.args import add_command, add_model_flags, fail, model_device
from tlm.data.tokens import TokenData
from tlm.load import load_language_model, load_tokenizer, source_of

EXAMPLE = """examples:
  tlm audit runs/demo --data data/demo
  tlm audit runs/demo --data data/demo --samples 1000 --prefix 50 --suffix 50 --json

Draws --samples windows of prefix + suffix tokens from the training split and as many from
the validation split, decodes each prefix greedily and counts exact matches of the true
suffix (discoverable memorization, Carlini et al. 2023), with 95% Wilson intervals; the
validation rate is the baseline. Training windows are also grouped by how often their text
occurs in the training split (1, 2-4, 5-16, 17+).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "audit", "measure what a model memorized of its data", EXAMPLE)
    parser.add_argument("run", help="run directory or Hugging Face GPT-2 directory")
    parser.add_argument("--data", required=True, help="the prepared data folder it was trained on")
    parser.add_argument("--samples", type=int, default=500, help="windows per split (500)")
    parser.add_argument("--prefix", type=int, default=32, help="tokens given to the model (32)")
    parser.add_argument("--suffix", type=int, default=32, help="tokens it must give back (32)")
    parser.add_argument("--batch-size", type=int, default=64, help="windows decoded at once (64)")
    parser.add_argument("--seed", type=int, default=0, help="which windows are drawn (0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.samples < 1 or args.batch_size < 1:
        fail("--samples and --batch-size must be at least 1")
    source = source_of(args.run)
    data, tokenizer = TokenData(args.data), load_tokenizer(source)
    if load_tokenizer(data.folder).to_json() != tokenizer.to_json():
        fail(f"{args.data} was not tokenized with the tokenizer of {args.run}")
    for split in ("train", "val"):
        if len(data.split(split)) == 0:
            fail(f"the {split} split of {args.data} is empty: nothing to audit")
    model = load_language_model(source, model_device(args), args.weights)
    epochs = passes(args.run, len(data.split("train")))
    report = audit(
        model, tokenizer, data, args.samples, args.prefix, args.suffix, args.batch_size,
        args.seed, epochs, progress=not args.quiet,
    )  # fmt: skip
    card = record(args.run, data.meta, report)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"windows of {args.prefix} + {args.suffix} tokens, greedy; exact suffix given back:")
    for split, r in report["extraction"].items():
        print(
            f"  {split:5s} {r['exact']:5d} of {r['windows']:5d}  {r['rate']:7.2%}"
            f"  (95% {r['low']:.2%}-{r['high']:.2%})  tokens matched {r['token_match']:.2%}"
        )
    print("training windows by how often their text occurs in the training split:")
    for row in report["duplication"]:
        print(f"  {row['bucket']:5s} {row['windows']:5d} windows  extracted {row['rate']:7.2%}")
    canaries = report["canaries"]
    if canaries:
        seen = "" if epochs is None else f"; {epochs:.1f} passes over the training split"
        print(f"canaries (exposure in bits, of at most {canaries[0]['max_exposure']:.1f}{seen}):")
    for row in canaries:
        times = "" if epochs is None else f" (seen ~{row['seen']:.0f} times)"
        given = "given back" if row["extracted"] else "not given back"
        print(f"  planted {row['repeats']:4d}x{times}: exposure {row['exposure']:5.1f}, {given}")
    if card is not None:
        print(f"recorded in {card} and {card.parent / 'audit.json'}")
    return 0
