"""Attention patterns α (eq. 9.12) of every layer and head, and a figure of them."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from tlm.interpret.hooks import run_with_cache
from tlm.io import atomic_path
from tlm.model import TransformerLM


def attention_patterns(model: TransformerLM, input_ids: Tensor) -> Tensor:
    """α for input_ids [1, T] -> [L, H, T, T], row i = how much position i attends to each j.

    Listening to `attn.pattern` makes this forward pass form α (the written-out path).
    """
    names = [f"blocks.{layer}.attn.pattern" for layer in range(model.config.n_layers)]
    _, cache = run_with_cache(model, input_ids, names)
    return torch.stack([cache[name][0] for name in names])  # L x [H,T,T] -> [L,H,T,T]


def plot_attention(patterns: Tensor, tokens: list[str], path: str | Path, title: str = "") -> None:
    """A grid of heat maps, one per layer (rows) and head (columns); written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H, T, _ = patterns.shape
    fig, axes = plt.subplots(L, H, figsize=(2.4 * H + 1, 2.4 * L + 1), squeeze=False)
    labels = [repr(t)[1:-1] for t in tokens]
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            ax.imshow(patterns[layer, head].cpu().numpy(), cmap="Blues", vmin=0, vmax=1)
            ax.set_title(f"layer {layer}, head {head}", fontsize=8)
            small = T <= 24
            ax.set_xticks(range(T) if small else [])
            ax.set_yticks(range(T) if small else [])
            if small:
                ax.set_xticklabels(labels, rotation=90, fontsize=6)
                ax.set_yticklabels(labels, fontsize=6)
    fig.suptitle(title or "attention patterns α (eq. 9.12): row = query, column = key")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
