"""A Hugging Face directory, whichever decoder layout it holds: GPT-2 (absolute positions)
or GPT-NeoX (rotary). `model_type` in its config.json says which."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torch import Tensor

from tlm.config import ModelConfig
from tlm.interop.gpt2 import (
    HFFormatError,
    config_from_gpt2,
    gpt2_weights,
    read_hf_config,
    read_hf_weights,
)
from tlm.interop.gptneox import config_from_gptneox, gptneox_weights
from tlm.model import TransformerLM
from tlm.tensor_files import LazyMatrix

LAYOUTS = {
    "gpt2": (config_from_gpt2, gpt2_weights),
    "gpt_neox": (config_from_gptneox, gptneox_weights),
}


def _layout(path: str | Path):
    hf = read_hf_config(path)
    kind = hf.get("model_type")
    if kind not in LAYOUTS:
        raise HFFormatError(f"model_type {kind!r}: tlm reads {' and '.join(LAYOUTS)} checkpoints")
    return hf, LAYOUTS[kind]


def hf_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig that computes a Hugging Face directory's model."""
    hf, (config_of, _) = _layout(path)
    return config_of(hf)


def hf_weights(
    path: str | Path, config: ModelConfig, lazy_embedding: bool = False
) -> Iterator[tuple[str, Tensor | LazyMatrix]]:
    """(tlm name, tensor) of a Hugging Face directory's weights, part by part."""
    _, (_, weights_of) = _layout(path)
    return weights_of(read_hf_weights(path), config, lazy_embedding)


def load_hf(path: str | Path) -> TransformerLM:
    """A Hugging Face GPT-2 or GPT-NeoX directory -> TransformerLM (float32, eval mode)."""
    config = hf_model_config(path)
    model = TransformerLM(config, init=False)
    model.load_state_dict(dict(hf_weights(path, config)), assign=True)
    return model.eval()
