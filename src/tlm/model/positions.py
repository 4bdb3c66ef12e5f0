"""Position information (J&M §9.4): sinusoidal tables and rotary embeddings.

Learned absolute positions are a plain parameter P [N, d] in `layers.Embedding`; this file
holds the two fixed schemes:

- sinusoidal (Vaswani et al. 2017, §3.5), added once to the token embeddings;
- rotary (Su et al. 2021, "RoFormer"), applied to q and k inside every attention layer, so
  that q_i · k_j depends on the positions only through i - j (a relative scheme).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tlm.config import ModelConfig


def document_positions(documents: Tensor) -> Tensor:
    """The position of each token within its document, for documents packed side by side
    in a window: `documents` [B,T] numbers each position's document (a run of equal
    numbers is one document); each document's positions count from 0. Returns [B,T]."""
    T = documents.shape[1]
    t = torch.arange(T, device=documents.device).expand_as(documents)  # [B,T]
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]  # a document begins here
    first = torch.where(starts, t, 0).cummax(dim=1).values  # where this token's document began
    return t - first


def sinusoidal_table(n_positions: int, d: int, base: float = 10000.0) -> Tensor:
    """[n_positions, d] with PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # [N,1]
    two_i = torch.arange(0, d, 2, dtype=torch.float64)  # [ceil(d/2)]
    angle = pos / base ** (two_i / d)  # [N, ceil(d/2)]
    table = torch.empty(n_positions, 2 * angle.shape[1], dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table[:, :d].float()


def rotary_angles(n_positions: int, d_head: int, base: float = 10000.0) -> Tensor:
    """[n_positions, d_head/2] angles m·θ_i with θ_i = base^(-2i/d_head)."""
    theta = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)  # [d_head/2]
    pos = torch.arange(n_positions, dtype=torch.float64)
    return torch.outer(pos, theta)  # [N, d_head/2]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of x [..., T, d_head] by its angle; cos/sin [T, d/2]."""
    x1, x2 = x.chunk(2, dim=-1)  # [...,T,d/2] each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Rotary(nn.Module):
    """Rotary position embedding of q or k [B,H,T,d_head] at absolute positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        angles = rotary_angles(config.context_length, config.d_head, config.rope_base)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """positions [T], or [B,T] when each batch row has its own (left padding)."""
        cos = self.cos[positions].to(x.dtype)  # [T,d/2] or [B,T,d/2]
        sin = self.sin[positions].to(x.dtype)
        if positions.dim() == 2:  # [B,T,d/2] -> [B,1,T,d/2]: the same angle in every head
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return apply_rotary(x, cos, sin)
