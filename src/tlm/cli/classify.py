"""`tlm classify`: zero-shot classification by comparing the labels' probabilities (§10.7),
or a fine-tuned encoder's classifier (§11.4)."""

from __future__ import annotations

import argparse
import json

from tlm.cli.args import add_command, add_model_flags, fail, model_device
from tlm.load import load_language_model, load_tokenizer, model_config, source_of
from tlm.tasks import accuracy, classify, confusion_matrix
from tlm.tasks.inputs import read_examples

EXAMPLE = """examples:
  tlm classify runs/classifier "The json module encodes and decodes JSON."   # a --task run
  tlm classify runs/classifier "first sentence" "second sentence"   # a pair (text_a, text_b)
  tlm classify runs/demo --labels positive,negative \\
      --template 'The sentiment of the sentence "{text}" is:' \\
      --input reviews.jsonl --gold-field label
  echo "I loved it" | tlm classify runs/demo --labels positive,negative --template '{text} It was'

Each input goes into the template in place of {text}; each label follows it after a space,
and the label with the higher probability wins. --input: .jsonl (--text-field, default
text), .tsv (text<TAB>gold), or plain lines (- for stdin). With gold labels: accuracy (by
summed log-probability, per token, and per byte as acc_norm) and a confusion matrix. A run
fine-tuned with tlm train --task classify needs neither: its head gives each label's
probability for TEXT.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "classify", "classify texts by label probability", EXAMPLE)
    parser.add_argument("run", help="run directory or Hugging Face GPT-2 directory")
    parser.add_argument("text", nargs="*", help="a fine-tuned classifier's text (or pair)")
    parser.add_argument("--labels", help="comma-separated labels (a language model)")
    parser.add_argument("--template", help='with {text}, e.g. "{text} It was" (a language model)')
    parser.add_argument("--input", default="-", help="FILE.jsonl/.parquet/.tsv, FILE or -")
    parser.add_argument("--text-field", default="text", help="JSONL field of the text")
    parser.add_argument("--gold-field", help="JSONL field of the gold label (.tsv: 2nd column)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_flags(parser)
    parser.set_defaults(handler=run)


def run_classifier(args: argparse.Namespace, source) -> int:
    """A fine-tuned encoder's label for TEXT (or the pair TEXT TEXT_B)."""
    from tlm.load import load_encoder
    from tlm.tasks.labels import classify_text

    if not 1 <= len(args.text) <= 2 or args.labels or args.template:
        fail("a fine-tuned classifier takes TEXT (or TEXT TEXT_B), and no --labels or --template")
    model = load_encoder(source, model_device(args), args.weights)
    got = classify_text(model, load_tokenizer(source), *args.text)
    if args.json:
        print(json.dumps({"label": got.label, "probabilities": got.probabilities}))
        return 0
    probs = "  ".join(f"{label} {p:.3f}" for label, p in got.probabilities.items())
    print(f"{got.label}\t{probs}")
    return 0


def run(args: argparse.Namespace) -> int:
    source = source_of(args.run)
    if model_config(source).model_type == "encoder":
        return run_classifier(args, source)
    if args.text or not args.labels or not args.template:
        fail("a language model classifies by --labels and --template, texts from --input")
    labels = [label.strip() for label in args.labels.split(",")]
    examples = read_examples(args.input, args.text_field, args.gold_field)
    model, tokenizer = (
        load_language_model(source, model_device(args), args.weights),
        load_tokenizer(source),
    )
    results = classify(model, tokenizer, [text for text, _ in examples], labels, args.template)
    rows = [
        {
            "text": r.text,
            "label": r.label,
            "label_norm": r.label_norm,
            "probabilities": r.probabilities,
        }
        for r in results
    ]
    gold = [g for _, g in examples]
    summary = None
    if all(g is not None for g in gold):
        summary = {"labels": labels, "n": len(gold)}
        for name, key in (("acc", "label"), ("acc_norm", "label_norm")):
            summary[name], summary[f"{name}_stderr"] = accuracy(
                [row[key] == g for row, g in zip(rows, gold, strict=True)]
            )
        summary["confusion"] = confusion_matrix(gold, [row["label"] for row in rows], labels)
    if args.json:
        print(json.dumps({"results": rows, "summary": summary}))
        return 0
    for row in rows:
        probs = "  ".join(f"{label} {p:.3f}" for label, p in row["probabilities"].items())
        print(f"{row['label']}\t{probs}\t{row['text']}")
    if summary:
        print(
            f"accuracy {summary['acc']:.3f} ± {summary['acc_stderr']:.3f} (acc_norm "
            f"{summary['acc_norm']:.3f}) over {summary['n']}; rows gold, columns predicted:"
        )
        width = max(len(label) for label in labels)
        for label, counts in zip(labels, summary["confusion"], strict=True):
            print(f"  {label:>{width}}  " + "  ".join(f"{c:5d}" for c in counts))
    return 0
