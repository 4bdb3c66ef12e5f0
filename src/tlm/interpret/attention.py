"""Attention patterns α (eq. 9.12) of every layer and head."""

from __future__ import annotations

import torch
from torch import Tensor

from tlm.interpret.hooks import run_with_cache
from tlm.model import TransformerLM


def attention_patterns(model: TransformerLM, input_ids: Tensor) -> Tensor:
    """α for input_ids [1, T] -> [L, H, T, T], row i = how much position i attends to each j.

    Listening to `attn.pattern` makes this forward pass form α (the written-out path).
    """
    names = [f"blocks.{layer}.attn.pattern" for layer in range(model.config.n_layers)]
    _, cache = run_with_cache(model, input_ids, names)
    return torch.stack([cache[name][0] for name in names])  # L x [H,T,T] -> [L,H,T,T]
