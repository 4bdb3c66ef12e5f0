"""`tlm score`: log-probabilities of continuations, or multiple-choice accuracy."""

from __future__ import annotations

import argparse
import json

from tlm.cli.args import (
    add_command,
    add_long_context_flags,
    add_model_flags,
    fail,
    long_context_flags,
    model_device,
)
from tlm.inference import FORMATS
from tlm.load import load_language_model, load_tokenizer, source_of
from tlm.tasks import multiple_choice, score
from tlm.tasks.inputs import read_choices

EXAMPLE = """examples:
  tlm score runs/demo --context "A list is" --continuation " mutable" --continuation " immutable"
  tlm score runs/demo --choices questions.jsonl --json

--choices reads one item per line, {"context": ..., "choices": [...], "gold": index}; each
choice is appended to its context as written (start it with a space if a space goes
between). Reported: acc (by summed log-probability), acc_per_token, acc_norm (per UTF-8
byte, as lm-evaluation-harness), each with its standard error, and chance.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "score", "log-probabilities of continuations", EXAMPLE)
    parser.add_argument("run", help="run directory or Hugging Face GPT-2 directory")
    parser.add_argument("--context", help="the text before the continuations")
    parser.add_argument("--continuation", action="append", default=[], help="(repeat)")
    parser.add_argument("--choices", metavar="FILE.jsonl", help="multiple-choice items")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dtype", choices=FORMATS, help="weights (as trained: float32)")
    add_model_flags(parser)
    add_long_context_flags(parser, context=False)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.choices) == bool(args.continuation):
        fail("give --continuation (with --context) or --choices FILE.jsonl")
    source = source_of(args.run)
    device = model_device(args, args.dtype)
    model = load_language_model(
        source, device, args.weights, args.dtype, **long_context_flags(args)
    )
    tokenizer = load_tokenizer(source)
    if args.choices:
        results = multiple_choice(model, tokenizer, read_choices(args.choices))
        if args.json:
            print(json.dumps(results))
            return 0
        print(f"{results['n']} items, chance {results['chance']:.3f}")
        for name in ("acc", "acc_per_token", "acc_norm"):
            print(f"{name:14s} {results[name]:.3f} ± {results[name + '_stderr']:.3f}")
        return 0
    scored = score(model, tokenizer, args.context or "", args.continuation)
    if args.json:
        rows = [{**vars(s), "logprob": s.logprob} for s in scored]
        print(json.dumps({"context": args.context or "", "continuations": rows}))
        return 0
    for s in scored:
        flag = " (greedy)" if s.greedy else ""
        print(f"{s.logprob:10.4f}  {len(s.tokens)} tokens  {s.continuation!r}{flag}")
    return 0
