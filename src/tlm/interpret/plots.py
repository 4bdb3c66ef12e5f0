"""Pictures of what `tlm.interpret` computes (matplotlib, PNG, written atomically).

Every function takes the tensors the analysis returns, so the figures show data a user can
also get as numbers: attention grids as the book draws them (Fig. 9.8-9.9: query rows, key
columns, nothing above the diagonal), the logit lens, the residual stream's norm per layer,
and the activation-patching heatmap.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from tlm.io import atomic_path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path, dpi: int = 100) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    _pyplot().close(fig)


def labels_of(tokens: list[str]) -> list[str]:
    """Tokens as readable tick labels: whitespace and newlines escaped."""
    return [repr(t)[1:-1] for t in tokens]


def plot_attention_grid(
    pattern: Tensor, tokens: list[str], path: str | Path, title: str, keys: list[str] | None = None
) -> None:
    """One head's α [T, S]: row i = query i, column j = key j (Fig. 9.9), tokens on both axes
    (`keys` for the columns when they differ from the rows, as in cross-attention)."""
    plt = _pyplot()
    keys = tokens if keys is None else keys
    size = min(12, 2 + 0.35 * max(len(tokens), len(keys)))
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(pattern.cpu().numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(keys)), labels_of(keys), rotation=90, fontsize=8)
    ax.set_yticks(range(len(tokens)), labels_of(tokens), fontsize=8)
    ax.set_xlabel("key j (attended to)")
    ax.set_ylabel("query i")
    fig.colorbar(image, ax=ax, fraction=0.04, label="α_ij")
    ax.set_title(title)
    fig.tight_layout()
    _save(fig, path)


def plot_attention(
    patterns: Tensor,
    tokens: list[str],
    path: str | Path,
    title: str = "",
    keys: list[str] | None = None,
) -> None:
    """The overview: one small grid per layer (rows) and head (columns), α [L, H, T, S];
    `keys` labels the columns when they are other tokens than the rows (cross-attention).
    The tokens label the outer grids only (keys along the bottom row, queries down the left
    column): every grid shares them, and each label is text matplotlib lays out."""
    plt = _pyplot()
    L, H, T, S = patterns.shape
    keys = tokens if keys is None else keys
    fig, axes = plt.subplots(L, H, figsize=(2.4 * H + 1, 2.4 * L + 1), squeeze=False)
    small = max(T, S) <= 24
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            ax.imshow(patterns[layer, head].cpu().numpy(), cmap="Blues", vmin=0, vmax=1)
            ax.set_title(f"layer {layer}, head {head}", fontsize=8)
            x_labels, y_labels = small and layer == L - 1, small and head == 0
            ax.set_xticks(range(S) if small else [], labels_of(keys) if x_labels else [])
            ax.set_yticks(range(T) if small else [], labels_of(tokens) if y_labels else [])
            ax.tick_params(axis="x", labelrotation=90, labelsize=6)
            ax.tick_params(axis="y", labelsize=6)
    fig.suptitle(title or "attention patterns α (eq. 9.12): row = query, column = key")
    fig.tight_layout()
    _save(fig, path, dpi=90)


def plot_logit_lens(
    probs: Tensor, words: list[list[str]], depths: list[str], tokens: list[str], path: str | Path
) -> None:
    """The lens's top token at every depth (rows) and position (columns), coloured by its
    probability: probs [L+1, T], words [L+1][T] the top tokens as text."""
    plt = _pyplot()
    D, T = probs.shape
    fig, ax = plt.subplots(figsize=(min(20, 2 + 1.1 * T), 1.5 + 0.55 * D))
    image = ax.imshow(probs.cpu().numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for d in range(D):
        for t in range(T):
            color = "black" if probs[d, t] > 0.6 else "white"
            text = repr(words[d][t])[1:-1][:8]
            ax.text(t, d, text, ha="center", va="center", fontsize=7, color=color)
    ax.set_xticks(range(T), labels_of(tokens), rotation=90, fontsize=8)
    ax.set_yticks(range(D), depths, fontsize=8)
    ax.set_xlabel("position (the prediction is for the token after it)")
    fig.colorbar(image, ax=ax, fraction=0.03, label="probability of the top token")
    ax.set_title("logit lens (§9.5): the final norm and unembedding applied at every depth")
    fig.tight_layout()
    _save(fig, path)


def plot_residual_norms(
    norms: Tensor, depths: list[str], tokens: list[str], path: str | Path
) -> None:
    """‖h‖ of the residual stream after each depth [L+1, T], one line per position."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for t, label in enumerate(labels_of(tokens)):
        ax.plot(range(len(depths)), norms[:, t].cpu().numpy(), marker="o", lw=1, label=label)
    ax.set_xticks(range(len(depths)), depths, rotation=45, fontsize=8)
    ax.set_ylabel("‖residual stream‖")
    ax.set_title("the residual stream's norm, layer by layer (Fig. 9.6-9.7)")
    if len(tokens) <= 16:
        ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def plot_patching(
    recovery: Tensor, rows: list[str], columns: list[str], path: str | Path, title: str
) -> None:
    """The share of the clean behaviour each patched activation restores [rows, columns]."""
    plt = _pyplot()
    R, C = recovery.shape
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.4 * C), 2.5 + 0.45 * R))
    limit = max(1.0, float(recovery.abs().max()))
    image = ax.imshow(recovery.cpu().numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(C), labels_of(columns), rotation=90, fontsize=8)
    ax.set_yticks(range(R), rows, fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.04, label="recovery")
    ax.set_title(title)
    fig.tight_layout()
    _save(fig, path)


def plot_anisotropy(values: list[float], path: str | Path) -> None:
    """The mean cosine between random words' vectors at each layer (§11.3, `tasks/embed.py`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(values)), values, marker="o")
    ax.set_xticks(range(len(values)), ["input", *(f"block {b}" for b in range(len(values) - 1))])
    ax.set_ylabel("mean cosine of random words")
    ax.set_ylim(min(0.0, *values) - 0.05, 1.0)
    ax.set_title("anisotropy (§11.3): how much all contextual vectors point one way")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
