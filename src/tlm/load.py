"""Reading a model, whatever wrote it: a tlm run, a Hugging Face GPT-2 or GPT-NeoX
directory, or llama.cpp's GGUF file.

`tlm.kinds.kind_of` decides once which kind a path is; everything here then reads through
that kind's reader and builds the model (or, with a `dtype`, packs it part by part). A
command that reads a path's tokenizer and its model (and perhaps its config) asks once:
`source_of(path)` is the path with its kind, and each function here takes it wherever it
takes a path, reading through the reader it carries without asking the kind again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tlm.checkpoint import CheckpointError
from tlm.config import ModelConfig
from tlm.inference import check_format, for_inference, load_prepared
from tlm.kinds import Kind, detected, kind_of
from tlm.model import Encoder, EncoderDecoder, TransformerLM, build_model
from tlm.tokenizer import Tokenizer
from tlm.tokenizer import load_tokenizer as load_tokenizer_file

__all__ = [
    "Source",
    "load_language_model",
    "load_model",
    "load_tokenizer",
    "load_translation_model",
    "model_config",
    "source_of",
]


@dataclass(frozen=True)
class Source:
    """A path of a kind tlm reads, its kind decided (`source_of`): its tokenizer, config and
    weights are read through `kind.reader`."""

    path: Path
    kind: Kind


def source_of(path: str | Path | Source) -> Source:
    """`path` with its kind, decided here once (`kind_of`: a one-line error for a path of
    no kind tlm reads); a `Source` is decided already and comes back as it is."""
    return path if isinstance(path, Source) else Source(Path(path), kind_of(path))


def load_tokenizer(path: str | Path | Source) -> Tokenizer:
    """The tokenizer of a run, a prepared data folder, a Hugging Face directory, a
    tokenizer.json, or a GGUF file (its `tokenizer.ggml.*` vocabulary)."""
    if isinstance(path, Source):  # decided already
        return path.kind.reader.tokenizer(path.path)
    kind = detected(path)  # none for a data folder or a tokenizer.json
    reader = kind.reader if kind is not None else None
    return load_tokenizer_file(path) if reader is None else reader.tokenizer(Path(path))


def model_config(path: str | Path | Source) -> ModelConfig:
    """The ModelConfig of a run directory, a Hugging Face GPT-2 or GPT-NeoX directory or a
    GGUF file."""
    source = source_of(path)
    return source.kind.reader.config(source.path)


def load_model(
    path: str | Path | Source,
    device: str | torch.device = "cpu",
    weights: str = "latest",
    dtype: str | None = None,
    rope_scaling: str | None = None,
    rope_factor: float = 1.0,
    context_length: int | None = None,
    attention_window: int | None = None,
) -> TransformerLM | EncoderDecoder | Encoder:
    """A run directory of ours, a Hugging Face GPT-2 or GPT-NeoX directory, or a GGUF file
    -> the model (TransformerLM; EncoderDecoder for a translation run, Encoder for a
    masked-LM run) in eval mode, with a run's latest weights or, `weights="best"`, those of
    its lowest validation loss (a run trained with --keep-best).

    `dtype` (one of `tlm.inference.FORMATS`: "float32", "float16", "bfloat16", "int8",
    "q8_0", "q4_0", "q4_k") gives a language model prepared for inference, as
    `tlm.inference.for_inference(model, dtype)` would, and on a CPU reads it one part at a
    time, packing each part before the next is read: the whole fp32 model is never in
    memory, so the peak follows the format (docs/benchmarks-history.md, "Memory"). A GGUF
    file of type q8_0, q4_0 or q4_k read in that dtype computes with the file's own values
    (each block quantized again as it was; Q4_K's fit finds nearly every block again).

    `rope_scaling` ("linear", "ntk", "dynamic", "yarn") with `rope_factor` s reads a rotary
    model at s times the context it was trained at (`ModelConfig.stretched`,
    `model/positions.py`), without retraining; `context_length` reads it with windows of
    that many positions (`ModelConfig.with_context`: past the trained context, with or
    without a scaling); `attention_window` W lets each query see at most W keys
    (`model/window.py`: decoding then keeps W positions, however long the text).
    """
    source, device = source_of(path), torch.device(device)
    path, kind = source.path, source.kind
    if weights != "latest" and not kind.best:
        raise CheckpointError(f"{path} is {kind.called}: it has one set of weights")
    if dtype is not None:
        check_format(dtype, device)
    config = kind.reader.config(path)
    if rope_scaling is not None:
        config = config.stretched(rope_scaling, rope_factor)
    if context_length is not None:
        config = config.with_context(context_length)
    if attention_window is not None:
        config = config.replace(attention_window=attention_window)
    if dtype is not None and config.model_type == "decoder" and device.type == "cpu":
        return _load_packed(path, kind, config, weights, dtype)
    model = build_model(config, init=False)  # every weight is read below
    model.load_state_dict(dict(kind.reader.weights(path, model, weights, False)), assign=True)
    model = model.eval().to(device)
    if dtype is None:
        return model
    if not isinstance(model, TransformerLM):  # dtype prepares language models only
        raise CheckpointError(f"{path} is {wrong_model(type(model), TransformerLM)}")
    return for_inference(model, dtype)


def _load_packed(
    path: Path, kind: Kind, config: ModelConfig, weights: str, dtype: str
) -> TransformerLM:
    """The language model at `path`, each part packed in `dtype` as soon as it is read."""
    model = TransformerLM(config, init=False)  # untouched memory: every weight is assigned
    return load_prepared(model, kind.reader.weights(path, model, weights, True), dtype)


# what a command that needs one kind of model says when given another: what it was given,
# and what it is for (a command that continues text) or what the command needs (the others)
IS = {
    TransformerLM: "a language model",
    EncoderDecoder: "an encoder-decoder (translation) model",
    Encoder: "a bidirectional encoder (masked LM)",
}
FOR = {
    TransformerLM: "it continues text (tlm generate, tlm eval)",
    EncoderDecoder: "use tlm translate, or tlm eval --task translate",
    Encoder: "it fills masks (tlm fill-mask) and, fine-tuned, labels text (tlm eval RUN "
    "--data FILE scores it); it does not continue text",
}
NEEDS = {
    EncoderDecoder: "translation needs an encoder-decoder run (trained on tlm prepare --task "
    "translate data)",
    Encoder: "this command needs an encoder run (tlm train --objective mlm)",
}


def wrong_model(given: type, wanted: type) -> str:
    """'is ...' of a model of type `given` handed to a command that needs a `wanted`."""
    return f"{IS[given]}: {NEEDS.get(wanted, FOR[given])}"


def _load_one(
    path: str | Path | Source,
    device: str | torch.device,
    wanted: type,
    weights: str,
    dtype: str | None,
    **scaling: Any,
) -> Any:
    source = source_of(path)
    model = load_model(source, device, weights, dtype, **scaling)
    if not isinstance(model, wanted):
        raise CheckpointError(f"{source.path} is {wrong_model(type(model), wanted)}")
    return model


def load_language_model(
    path: str | Path | Source,
    device: str | torch.device = "cpu",
    weights: str = "latest",
    dtype: str | None = None,
    rope_scaling: str | None = None,
    rope_factor: float = 1.0,
    context_length: int | None = None,
    attention_window: int | None = None,
) -> TransformerLM:
    """`load_model` for the commands that continue text: an encoder-decoder is refused."""
    scaling = {"rope_scaling": rope_scaling, "rope_factor": rope_factor}
    scaling |= {"context_length": context_length, "attention_window": attention_window}
    return _load_one(path, device, TransformerLM, weights, dtype, **scaling)


def load_encoder(
    path: str | Path | Source, device: str | torch.device = "cpu", weights: str = "latest"
) -> Encoder:
    """`load_model` for the commands that read an encoder (fill-mask): other models refused."""
    return _load_one(path, device, Encoder, weights, None)


def load_translation_model(
    path: str | Path | Source, device: str | torch.device = "cpu", weights: str = "latest"
) -> EncoderDecoder:
    """`load_model` for the commands that translate: a language model is refused."""
    return _load_one(path, device, EncoderDecoder, weights, None)
