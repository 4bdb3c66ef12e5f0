"""Reading a model directory, whatever wrote it: a tlm run or a Hugging Face GPT-2 or GPT-NeoX
directory (or llama.cpp's GGUF file).

This dispatch sits above `checkpoint` (run directories) and `interop` (Hugging Face
formats), so that neither of them needs the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tlm.checkpoint import CheckpointError, load_run, run_model_config, run_weights
from tlm.config import ModelConfig
from tlm.inference import check_format, for_inference, in_parts, load_prepared
from tlm.interop import is_hf_model_dir
from tlm.interop.gguf import read_gguf
from tlm.interop.gguf_tokens import read_gguf_tokenizer
from tlm.interop.hf import hf_model_config, hf_weights, load_hf
from tlm.model import EncoderDecoder, TransformerLM
from tlm.tokenizer import Tokenizer
from tlm.tokenizer import load_tokenizer as load_tokenizer_file

__all__ = [
    "load_language_model",
    "load_model",
    "load_tokenizer",
    "load_translation_model",
    "model_config",
]


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a run, a prepared data folder, a Hugging Face directory, a
    tokenizer.json, or a GGUF file (its `tokenizer.ggml.*` vocabulary)."""
    if is_gguf(Path(path)):
        return read_gguf_tokenizer(path)
    return load_tokenizer_file(path)


def model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a run directory or of a Hugging Face GPT-2 or GPT-NeoX directory."""
    if is_hf_model_dir(path):
        return hf_model_config(path)
    if is_gguf(Path(path)):
        return read_gguf(path)[0].config
    return run_model_config(path)


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    weights: str = "latest",
    dtype: str | None = None,
) -> TransformerLM | EncoderDecoder:
    """A run directory of ours, a Hugging Face GPT-2 or GPT-NeoX directory, or a GGUF file
    -> the model (TransformerLM, or EncoderDecoder for a translation run) in eval mode, with
    a run's latest weights or, `weights="best"`, those of its lowest validation loss (a run
    trained with --keep-best).

    `dtype` ("float32", "float16", "bfloat16", "int8") gives a language model prepared for
    inference, as `tlm.inference.for_inference(model, dtype)` would, and on a CPU reads it
    one part at a time, packing each part before the next is read: the whole fp32 model is never in
    memory, so the peak follows the format (docs/benchmarks-history.md, "Memory").
    """
    path = Path(path)
    hf = is_hf_model_dir(path)
    if (hf or is_gguf(path)) and weights != "latest":
        kind = "a Hugging Face model" if hf else "a GGUF file"
        raise CheckpointError(f"{path} is {kind}: it has one set of weights")
    if is_gguf(path):  # llama.cpp's file, read whole (quantized matrices expanded)
        model = read_gguf(path)[0].to(device)
        return model if dtype is None else for_inference(model, dtype)
    if not hf and not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory (a run, or a Hugging Face GPT-2 or GPT-NeoX "
            "model) or a .gguf file"
        )
    if dtype is not None:
        check_format(dtype, torch.device(device))
        config = model_config(path)
        if config.model_type == "decoder" and torch.device(device).type == "cpu":
            return _load_packed(path, config, weights, dtype)
    model = (load_hf(path) if hf else load_run(path, weights)).to(device)
    if dtype is None:
        return model
    if not isinstance(model, TransformerLM):  # dtype prepares language models only
        raise CheckpointError(f"{path} is {WRONG_KIND[TransformerLM]}")
    return for_inference(model, dtype)


def _load_packed(path: Path, config: ModelConfig, weights: str, dtype: str) -> TransformerLM:
    """The language model at `path`, each part packed in `dtype` as soon as it is read."""
    model = TransformerLM(config, init=False)  # untouched memory: every weight is assigned
    if is_hf_model_dir(path):
        pairs = hf_weights(path, config, lazy_embedding=True)
    else:
        names = in_parts(model.state_dict())  # each product's weights together
        pairs = run_weights(path, weights, names, lazy=("embedding.E",))
    return load_prepared(model, pairs, dtype)


# what a command that needs one kind of model says when given the other
WRONG_KIND = {
    TransformerLM: "an encoder-decoder (translation) model: use tlm translate, or tlm eval "
    "--task translate",
    EncoderDecoder: "a language model: translation needs an encoder-decoder run (trained on "
    "tlm prepare --task translate data)",
}


def _load_kind(
    path: str | Path, device: str | torch.device, kind: type, weights: str, dtype: str | None
) -> Any:
    model = load_model(path, device, weights, dtype)
    if not isinstance(model, kind):
        raise CheckpointError(f"{path} is {WRONG_KIND[kind]}")
    return model


def load_language_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    weights: str = "latest",
    dtype: str | None = None,
) -> TransformerLM:
    """`load_model` for the commands that continue text: an encoder-decoder is refused."""
    return _load_kind(path, device, TransformerLM, weights, dtype)


def load_translation_model(
    path: str | Path, device: str | torch.device = "cpu", weights: str = "latest"
) -> EncoderDecoder:
    """`load_model` for the commands that translate: a language model is refused."""
    return _load_kind(path, device, EncoderDecoder, weights, None)
