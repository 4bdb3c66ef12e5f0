"""Helpers shared by the commands: config fields as `--kebab-case` flags, one-line errors."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, NoReturn, get_type_hints

from tlm.config import coerce
from tlm.errors import UserError


class UsageError(UserError):
    """Bad input from the user: printed as one line, exit code 2."""


def add_command(
    sub: argparse._SubParsersAction, name: str, help: str, example: str = ""
) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with its examples, printed as written."""
    return sub.add_parser(
        name, help=help, epilog=example, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def fail(message: str) -> NoReturn:
    raise UsageError(message)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# a field's old flag: it still works, with a line that names the new one (--dtype names the
# weight format a model is read in, everywhere else: one meaning per name)
DEPRECATED = {"precision": "--dtype"}


class Deprecated(argparse.Action):
    """An old spelling of a flag: sets the same field and says, once, what it is now."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        now = flag(self.dest)
        print(f"tlm: {option_string} is now {now} here (the training precision); "
              f"{option_string} names a weight format", file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One `--kebab-case` flag per field of dataclass `cls`; unset flags stay None. A bool
    field's flag alone means true (`--keep-best`), and still takes a value (`--bias false`)."""
    group = parser.add_argument_group(title)
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        default = field.default if field.default is not dataclasses.MISSING else None
        kinds = getattr(hints[field.name], "__args__", (hints[field.name],))
        kind = "|".join(k.__name__ for k in kinds if k is not type(None))
        switch = {"nargs": "?", "const": "true"} if kinds == (bool,) else {}
        if field.name in DEPRECATED:
            group.add_argument(
                DEPRECATED[field.name], dest=field.name, action=Deprecated, help=argparse.SUPPRESS
            )
        group.add_argument(
            flag(field.name),
            dest=field.name,
            default=None,
            metavar=kind.upper(),
            help=f"default: {default}",
            **switch,
        )


def add_model_flags(parser: argparse.ArgumentParser, device: bool = True) -> None:
    """The flags of a command that reads a model: --weights latest|best (which of a run's
    weights) and, for one that runs it, --device auto|cpu|cuda[:N] (where)."""
    parser.add_argument(
        "--weights",
        choices=("latest", "best"),  # checkpoint.WEIGHTS (not imported: it loads PyTorch)
        default="latest",
        help="latest (default), or best: the lowest validation loss (a run trained --keep-best)",
    )
    if device:
        add_device_flag(parser)


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """--device auto|cpu|cuda[:N]: where the model runs (`tlm.device.pick_device`)."""
    parser.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda[:N]",
        help="where the model runs: auto (default) is a CUDA GPU where there is one, else the CPU",
    )


def model_device(args: argparse.Namespace, dtype: str | None = None, say: bool = True) -> Any:
    """The torch device of --device for a model read in weight format `dtype`
    (`tlm.device.pick_device` decides). On a machine with a GPU, where the choice matters,
    the command's first line names it on stderr (`say`: unless the command names it in a
    first line of its own); on one without, the CPU goes without saying, and an error stays
    the one line it is."""
    import torch

    from tlm.device import describe, pick_device

    device = pick_device(getattr(args, "device", "auto"), dtype)
    if say and torch.cuda.is_available():
        print(f"tlm {args.command}: on {describe(device)}", file=sys.stderr, flush=True)
    return device


def add_long_context_flags(parser: argparse.ArgumentParser, context: bool = True) -> None:
    """--rope-scaling METHOD --rope-factor S: read a rotary model at S times the context it
    was trained at (`ModelConfig.stretched`), without retraining; --context N: windows of
    N positions (`ModelConfig.with_context`); --attention-window W: each query sees at most
    W keys, and decoding keeps W positions (`model/window.py`)."""
    parser.add_argument(
        "--rope-scaling",
        choices=("linear", "ntk", "dynamic", "yarn"),  # config.ROPE_SCALINGS
        help="read a rotary model past its trained context (with --rope-factor)",
    )
    parser.add_argument(
        "--rope-factor", type=float, default=None, help="with --rope-scaling: the context's factor"
    )
    parser.add_argument(
        "--attention-window",
        type=int,
        metavar="W",
        help="each query sees at most W keys; the cache keeps the last W + 64 positions, "
        "however long the text",
    )
    if context:  # `tlm score` has a --context of its own: the text before the choices
        parser.add_argument(
            "--context",
            type=int,
            metavar="N",
            dest="context_length",
            help="read the model with N positions (rotary: past its trained context)",
        )


def long_context_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The loader's keywords of --rope-scaling, --rope-factor, --context and
    --attention-window ({} when none is given)."""
    method, factor = getattr(args, "rope_scaling", None), getattr(args, "rope_factor", None)
    context, window = getattr(args, "context_length", None), getattr(args, "attention_window", None)
    out = {} if context is None else {"context_length": context}
    if context is not None and context < 1:
        fail(f"--context must be >= 1, got {context}")
    if window is not None:
        if window < 1:
            fail(f"--attention-window must be >= 1, got {window}")
        out["attention_window"] = window
    if method is None and factor is None:
        return out
    if method is None or factor is None:
        fail("--rope-scaling and --rope-factor go together")
    if not factor >= 1:
        fail(f"--rope-factor must be >= 1, got {factor:g}")
    return {"rope_scaling": method, "rope_factor": factor, **out}


def config_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` given on the command line, converted to their types."""
    hints = get_type_hints(cls)
    out = {}
    for field in dataclasses.fields(cls):
        value = getattr(args, field.name, None)
        if value is not None:
            out[field.name] = coerce(field.name, value, hints[field.name])
    return out


def read_text_file(path: str) -> str:
    """A UTF-8 file's text, or a one-line error naming the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"{path}: no such file")
    except UnicodeDecodeError as exc:
        fail(f"{path}: not valid UTF-8 (byte {exc.start})")


def error_exit(message: str) -> int:
    print(f"tlm: error: {message}", file=sys.stderr)
    return 2
