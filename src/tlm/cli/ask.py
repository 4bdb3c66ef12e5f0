"""`tlm ask` and `tlm summarize`: answering and summarising as continuations (§10.7)."""

from __future__ import annotations

import argparse

from tlm.cli.args import add_command, add_model_flags, model_device, read_text_file
from tlm.load import load_language_model, load_tokenizer, source_of
from tlm.tasks import answer, summarize

ASK = """examples:
  tlm ask runs/demo "What does the for statement do?"
  tlm ask path/to/gpt2 "Where is the Eiffel Tower?" --context-file article.txt

The prompt is "Q: <question>\\nA:" (after the context and a blank line, if given); the answer
is the greedy continuation up to the first newline.
"""
SUMMARIZE = """examples:
  tlm summarize path/to/gpt2 article.txt

The prompt is "<text>\\ntl;dr:"; the summary is the greedy continuation up to a newline.
"""


def register(sub: argparse._SubParsersAction) -> None:
    ask = add_command(sub, "ask", "answer a question by continuing 'Q: ... A:'", ASK)
    ask.add_argument("run", help="run directory or Hugging Face GPT-2 directory")
    ask.add_argument("question")
    ask.add_argument("--context-file", help="a text the question is about")
    ask.add_argument("--max-new-tokens", type=int, default=48)
    add_model_flags(ask)
    ask.set_defaults(handler=run_ask)
    summary = add_command(sub, "summarize", "summarize a text by continuing 'tl;dr:'", SUMMARIZE)
    summary.add_argument("run", help="run directory or Hugging Face GPT-2 directory")
    summary.add_argument("file", help="the text to summarize (UTF-8)")
    summary.add_argument("--max-new-tokens", type=int, default=64)
    add_model_flags(summary)
    summary.set_defaults(handler=run_summarize)


def run_ask(args: argparse.Namespace) -> int:
    context = read_text_file(args.context_file) if args.context_file else None
    source = source_of(args.run)
    model = load_language_model(source, model_device(args), args.weights, "float32")
    tokenizer = load_tokenizer(source)
    print(answer(model, tokenizer, args.question, context, args.max_new_tokens))
    return 0


def run_summarize(args: argparse.Namespace) -> int:
    text = read_text_file(args.file)
    source = source_of(args.run)
    model = load_language_model(source, model_device(args), args.weights, "float32")
    tokenizer = load_tokenizer(source)
    print(summarize(model, tokenizer, text, args.max_new_tokens))
    return 0
