"""Reading a model directory, whatever wrote it: a tlm run or a Hugging Face GPT-2 directory.

This dispatch sits above `checkpoint` (run directories) and `interop` (Hugging Face
formats), so that neither of them needs the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tlm.checkpoint import CheckpointError, load_run, run_model_config
from tlm.config import ModelConfig
from tlm.interop import is_hf_model_dir, load_gpt2
from tlm.interop.gpt2 import config_from_gpt2, read_hf_config
from tlm.model import EncoderDecoder, TransformerLM
from tlm.tokenizer import load_tokenizer

__all__ = [
    "load_language_model",
    "load_model",
    "load_tokenizer",
    "load_translation_model",
    "model_config",
]


def model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a run directory or of a Hugging Face GPT-2 directory."""
    if is_hf_model_dir(path):
        return config_from_gpt2(read_hf_config(path))
    return run_model_config(path)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", weights: str = "latest"
) -> TransformerLM | EncoderDecoder:
    """A run directory of ours, or a Hugging Face GPT-2 directory -> the model (TransformerLM,
    or EncoderDecoder for a translation run) in eval mode, with a run's latest weights or,
    `weights="best"`, those of its lowest validation loss (a run trained with --keep-best)."""
    path = Path(path)
    if is_hf_model_dir(path):
        if weights != "latest":
            raise CheckpointError(f"{path} is a Hugging Face model: it has one set of weights")
        return load_gpt2(path).to(device)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (a run, or a Hugging Face GPT-2 model)")
    return load_run(path, weights).to(device)


# what a command that needs one kind of model says when given the other
WRONG_KIND = {
    TransformerLM: "an encoder-decoder (translation) model: use tlm translate, or tlm eval "
    "--task translate",
    EncoderDecoder: "a language model: translation needs an encoder-decoder run (trained on "
    "tlm prepare --task translate data)",
}


def _load_kind(path: str | Path, device: str | torch.device, kind: type, weights: str) -> Any:
    model = load_model(path, device, weights)
    if not isinstance(model, kind):
        raise CheckpointError(f"{path} is {WRONG_KIND[kind]}")
    return model


def load_language_model(
    path: str | Path, device: str | torch.device = "cpu", weights: str = "latest"
) -> TransformerLM:
    """`load_model` for the commands that continue text: an encoder-decoder is refused."""
    return _load_kind(path, device, TransformerLM, weights)


def load_translation_model(
    path: str | Path, device: str | torch.device = "cpu", weights: str = "latest"
) -> EncoderDecoder:
    """`load_model` for the commands that translate: a language model is refused."""
    return _load_kind(path, device, EncoderDecoder, weights)
