"""The `tlm` command line: argument parsing only; the work is done by the library."""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from tlm.cli.args import error_exit
from tlm.errors import UserError

# Command -> the module that registers it. Only the module of the command being run is
# imported, so `tlm prepare` and `tlm info` start without PyTorch (1.4 s of a 5 s prepare).
COMMANDS = {
    "prepare": "prepare",
    "train": "train",
    "generate": "generate",
    "eval": "evaluate",
    "score": "score",
    "classify": "classify",
    "ask": "ask",
    "summarize": "ask",
    "scaling": "scaling",
    "serve": "serve",
    "export-hf": "export",
    "export-gguf": "export",
    "info": "info",
    "inspect": "inspect",
    "demo": "demo",
    "translate": "translate",
    "audit": "audit",
    "lm-eval": "lm_eval",
    "chat": "chat",
    "fill-mask": "fill_mask",
    "tag": "tag",
    "embed": "embed",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `command` alone, or of every command (for `tlm --help` and typos)."""
    parser = argparse.ArgumentParser(
        prog="tlm",
        description="Transformer language models as the textbook describes them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for name in dict.fromkeys(modules):
        import_module(f"tlm.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.handler(args) or 0
    except UserError as exc:
        return error_exit(str(exc))
    except KeyboardInterrupt:
        print("tlm: interrupted", file=sys.stderr)
        return 130
