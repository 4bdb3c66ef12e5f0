"""The table of kinds: every format tlm reads a model from or writes one to, one row each.

    kind       a path of that kind                                weights      written by
    tlm run    a directory whose config.json has a "model" section  latest, best  tlm train
    GPT-2      a directory whose config.json says model_type gpt2   one set      export-hf
    GPT-NeoX   ... model_type gpt_neox                              one set      export-hf
    Marian     ... model_type marian                                (not read)   export-hf
    BERT       ... model_type bert                                  one set      export-hf
    GGUF       a file named *.gguf (llama.cpp's)                    one set      export-gguf

`kind_of(path)` decides a path's kind once; `tlm.load` then reads through that row's
`Reader` alone (the config, the weights part by part, the tokenizer), and an export command
writes through the `Writer` of the row that takes the model's config (`writer_of`). A new
format is a new row: its detector, its reader, its writer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from tlm.checkpoint import CheckpointError, run_model_config, run_weights
from tlm.config import ModelConfig
from tlm.inference import in_parts
from tlm.interop.bert import bert_config, bert_weights, config_from_bert, state_to_bert
from tlm.interop.export import write_hf
from tlm.interop.gguf import export_gguf, gguf_config, gguf_weights
from tlm.interop.gguf_tokens import read_gguf_tokenizer
from tlm.interop.gpt2 import (
    HFFormatError,
    config_from_gpt2,
    gpt2_config,
    gpt2_weights,
    read_hf_config,
    read_hf_weights,
    state_to_gpt2,
)
from tlm.interop.gptneox import (
    config_from_gptneox,
    gptneox_config,
    gptneox_weights,
    state_to_gptneox,
)
from tlm.interop.marian import marian_config, state_to_marian
from tlm.model import EncoderDecoder, TransformerLM
from tlm.tensor_files import LazyMatrix
from tlm.tokenizer import Tokenizer, load_tokenizer

# (tlm name, tensor) of every weight of a model, each part's together (`inference.in_parts`)
Weights = Iterator[tuple[str, Tensor | LazyMatrix]]


@dataclass(frozen=True)
class Reader:
    """How a kind becomes a model: its config, then the weights of the model built empty
    from it (`which` set; with `lazy`, E may stay in its file as a `LazyMatrix`)."""

    config: Callable[[Path], ModelConfig]
    weights: Callable[[Path, nn.Module, str, bool], Weights]
    tokenizer: Callable[[Path], Tokenizer] = load_tokenizer  # tokenizer.json (or GPT-2's files)


@dataclass(frozen=True)
class Writer:
    """How `command` writes a model whose config `takes`; `opens_with` reads the result."""

    command: str
    takes: Callable[[ModelConfig], bool]
    write: Callable[..., Path]  # (model, tokenizer, out, the command's one option) -> out
    opens_with: str


@dataclass(frozen=True)
class Kind:
    name: str
    called: str  # "{path} is {called}" in messages
    detect: Callable[[Path], bool]  # cheap: a look at the name or at config.json
    reader: Reader | None = None  # None: tlm writes this kind, and does not read it
    writer: Writer | None = None
    best: bool = False  # holds a second set of weights, the best (--keep-best)


def _config_json(path: Path) -> dict[str, Any]:
    """A directory's config.json, or {} where there is none that parses to an object."""
    try:
        found = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return found if isinstance(found, dict) else {}


def _is_run(path: Path) -> bool:
    found = _config_json(path)
    return "model" in found and "model_type" not in found


def _says(model_type: str) -> Callable[[Path], bool]:
    return lambda path: _config_json(path).get("model_type") == model_type


def _is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def _run_weights(path: Path, model: nn.Module, which: str, lazy: bool) -> Weights:
    names = in_parts(model.state_dict())  # each product's weights together
    return run_weights(path, which, names, lazy=("embedding.E",) if lazy else ())


def _hf(config_from, weights_from) -> Reader:
    """A Hugging Face layout's reader: config.json through `config_from`, the tensors
    (safetensors or pytorch_model.bin) through `weights_from`."""
    return Reader(
        config=lambda path: config_from(read_hf_config(path)),
        weights=lambda path, model, which, lazy: weights_from(
            read_hf_weights(path), model.config, lazy
        ),
    )


def _gguf_weights(path: Path, model: nn.Module, which: str, lazy: bool) -> Weights:
    return iter(gguf_weights(path, model.config).items())


def _decoder(config: ModelConfig) -> bool:
    return config.model_type == "decoder"


KINDS = (
    Kind(
        "tlm run",
        'a tlm run (config.json with a "model" section)',
        _is_run,
        Reader(run_model_config, _run_weights),
        best=True,
    ),
    Kind(
        "GPT-2",
        "a Hugging Face model (model_type gpt2)",
        _says("gpt2"),
        _hf(config_from_gpt2, gpt2_weights),
        Writer(
            "export-hf",
            lambda config: _decoder(config) and config.position != "rope",  # absolute positions
            partial(write_hf, layout=(gpt2_config, state_to_gpt2)),
            "GPT2LMHeadModel",
        ),
    ),
    Kind(
        "GPT-NeoX",
        "a Hugging Face model (model_type gpt_neox)",
        _says("gpt_neox"),
        _hf(config_from_gptneox, gptneox_weights),
        Writer(
            "export-hf",
            lambda config: _decoder(config) and config.position == "rope",  # rotary
            partial(write_hf, layout=(gptneox_config, state_to_gptneox)),
            "GPTNeoXForCausalLM",
        ),
    ),
    Kind(
        "Marian",
        "a Hugging Face model (model_type marian)",
        _says("marian"),
        writer=Writer(
            "export-hf",
            lambda config: config.model_type == "encoder-decoder",
            partial(write_hf, layout=(marian_config, state_to_marian)),
            "MarianMTModel",
        ),
    ),
    Kind(
        "BERT",
        "a Hugging Face model (model_type bert)",
        _says("bert"),
        _hf(config_from_bert, bert_weights),
        Writer(
            "export-hf",
            lambda config: config.model_type == "encoder",
            partial(write_hf, layout=(bert_config, state_to_bert)),
            "BertForMaskedLM",
        ),
    ),
    Kind(
        "GGUF",
        "a GGUF file (.gguf)",
        _is_gguf,
        Reader(gguf_config, _gguf_weights, read_gguf_tokenizer),
        # every model: export_gguf itself refuses, naming the field, what llama.cpp lacks
        Writer("export-gguf", lambda config: True, export_gguf, "llama.cpp"),
    ),
)


def detected(path: str | Path) -> Kind | None:
    """The row whose detector claims `path`, or None."""
    return next((kind for kind in KINDS if kind.detect(Path(path))), None)


def kind_of(path: str | Path) -> Kind:
    """The kind of model at `path`, of those tlm reads; else a one-line error naming them."""
    kind = detected(path)
    if kind is not None and kind.reader is not None:
        return kind
    readable = ", ".join(kind.called for kind in KINDS if kind.reader is not None)
    model_type = _config_json(Path(path)).get("model_type")
    if model_type is not None:
        raise HFFormatError(f"{path}: model_type {model_type!r}: tlm reads {readable}")
    raise CheckpointError(f"{path} is none of what tlm reads: {readable}")


def writer_of(config: ModelConfig, command: str) -> Kind:
    """The kind `command` ("export-hf", "export-gguf") writes a model of `config` as."""
    writes = [kind for kind in KINDS if kind.writer and kind.writer.command == command]
    return next(kind for kind in writes if kind.writer.takes(config))  # one takes every config


def export_hf(
    model: TransformerLM | EncoderDecoder, tokenizer: Tokenizer, out: str | Path, card=None
) -> Path:
    """`tlm export-hf` in Python: `model` and `tokenizer` as the Hugging Face directory of
    the kind its config takes (GPT-2, GPT-NeoX, Marian or BERT), `card` (a file) as README.md."""
    return writer_of(model.config, "export-hf").writer.write(model, tokenizer, out, card=card)
