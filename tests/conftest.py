"""Shared fixtures: tiny models (2 layers, d=64) that run in milliseconds on a CPU."""

from __future__ import annotations

import pytest
import torch

from tlm import ModelConfig, TransformerLM

POSITIONS = ["learned", "sinusoidal", "rope", "none"]
NORMS = ["pre", "post"]


def tiny_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, context_length=32)
    values.update(overrides)
    return ModelConfig(**values)


@pytest.fixture
def make_model():
    """A factory: make_model(**config overrides) -> TransformerLM in eval mode, seeded."""

    def make(seed: int = 0, **overrides) -> TransformerLM:
        torch.manual_seed(seed)
        model = TransformerLM(tiny_config(**overrides))
        return model.eval()

    return make


@pytest.fixture(scope="session")
def docs_chars(tmp_path_factory):
    """The built-in python-docs corpus prepared with the char tokenizer, once per session."""
    from tlm.data import prepare

    folder = tmp_path_factory.mktemp("data") / "python-docs"
    prepare(["python-docs"], folder, tokenizer="char", progress=False)
    return folder
