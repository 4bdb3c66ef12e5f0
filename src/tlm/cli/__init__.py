"""The `tlm` command line: argument parsing only; the work is done by the library."""

from __future__ import annotations

import argparse
import sys

from tlm.checkpoint import CheckpointError
from tlm.cli import (
    ask,
    classify,
    demo,
    evaluate,
    export,
    generate,
    info,
    inspect,
    prepare,
    scaling,
    score,
    serve,
    train,
)
from tlm.cli.args import UsageError, error_exit
from tlm.config import ConfigError
from tlm.data import CorpusError
from tlm.generate import GenerationError
from tlm.interop import HFFormatError
from tlm.interpret import HookError
from tlm.io import FolderError
from tlm.scaling import FitError, SweepError
from tlm.tasks import TaskError
from tlm.tokenizer import TokenizerError
from tlm.train import RunError

USER_ERRORS = (
    UsageError,
    ConfigError,
    CorpusError,
    TokenizerError,
    CheckpointError,
    RunError,
    GenerationError,
    HFFormatError,
    FolderError,
    HookError,
    TaskError,
    FitError,
    SweepError,
)

COMMANDS = [
    prepare,
    train,
    generate,
    evaluate,
    score,
    classify,
    ask,
    scaling,
    serve,
    export,
    info,
    inspect,
    demo,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tlm",
        description="Transformer language models as the textbook describes them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except USER_ERRORS as exc:
        return error_exit(str(exc))
    except KeyboardInterrupt:
        print("tlm: interrupted", file=sys.stderr)
        return 130
