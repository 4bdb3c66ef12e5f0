"""Position information (J&M §9.4): sinusoidal tables and rotary embeddings.

Learned absolute positions are a plain parameter P [N, d] in `layers.Embedding`; this file
holds the two fixed schemes:

- sinusoidal (Vaswani et al. 2017, §3.5), added once to the token embeddings;
- rotary (Su et al. 2021, "RoFormer"), applied to q and k inside every attention layer, so
  that q_i · k_j depends on the positions only through i - j (a relative scheme).

A rotary model trained at context T sees, past T, angles m·θ_i it never saw. Four ways to
read longer texts, `ModelConfig.rope_scaling` with factor s = `rope_factor` (the context
becomes s·T), each a change of θ_i = b^(-2i/d) (`rotary_frequencies`):

- "linear", position interpolation (Chen et al. 2023): θ_i / s, i.e. position m read as
  m / s, so every angle stays within what training saw;
- "ntk", NTK-aware scaling (bloc97 2023): the base raised to b·s^(d/(d-2)), which leaves
  the fastest pair (i = 0) as it was and slows the slowest by s;
- "dynamic" NTK: the same with s replaced, for a pass whose last position is L - 1 > T,
  by s·L/T - (s - 1) (1 at L = T): the model is untouched within T;
- "yarn" (Peng et al. 2023): per pair, r_i = T·θ_i/2π rotations over the trained context;
  pairs of r_i > β_fast (32) keep θ_i, pairs of r_i < β_slow (1) take θ_i / s, a linear
  ramp between (over the pair index i, its ends rounded outwards), and the attention
  logits are multiplied by (0.1·ln s + 1)²: q and k each by 0.1·ln s + 1, folded into the
  cos and sin tables.
"""

from __future__ import annotations

import math

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


def rotary_frequencies(config: ModelConfig, length: int | None = None) -> tuple[Tensor, float]:
    """(θ_i [d_head/2] in float64, the factor q and k are each multiplied by) under
    `config.rope_scaling` (the module's list); `length` is a pass's last position + 1,
    which "dynamic" reads (None: within the trained context)."""
    d, base, s, T = config.d_head, config.rope_base, config.rope_factor, config.trained_context
    method = config.rope_scaling
    if method == "ntk":
        base = base * s ** (d / (d - 2))
    elif method == "dynamic" and length is not None and length > T:
        base = base * (s * length / T - (s - 1)) ** (d / (d - 2))
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if method == "linear":
        return theta / s, 1.0
    if method == "yarn":
        ramp = yarn_ramp(d, base, T, config.yarn_beta_fast, config.yarn_beta_slow)
        return theta / s * ramp + theta * (1 - ramp), yarn_attention_factor(s)
    return theta, 1.0


def yarn_ramp(d: int, base: float, T: int, beta_fast: float, beta_slow: float) -> Tensor:
    """γ_i [d/2]: 0 for the pairs that turn more than β_fast times over T positions (kept),
    1 for those that turn less than β_slow times (interpolated), linear in i between. A
    pair turns r_i = T·θ_i / 2π times, so r_i = β at i = d·ln(T / 2πβ) / (2·ln b); the
    ends are rounded outwards to whole pairs (as `transformers` and llama.cpp do)."""

    def pair(rotations: float) -> float:
        return d * math.log(T / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(pair(beta_fast)), 0), min(math.ceil(pair(beta_slow)), d - 1)
    high = high if high > low else low + 0.001  # one pair wide at the least
    i = torch.arange(d // 2, dtype=torch.float64)
    return ((i - low) / (high - low)).clamp(0, 1)


def yarn_attention_factor(s: float) -> float:
    """YaRN's √(1/t) = 0.1·ln s + 1 on q and k, so the logits are divided by t (1 at s = 1)."""
    return 0.1 * math.log(s) + 1.0 if s > 1 else 1.0


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of x [..., T, d_head] by its angle; cos/sin [T, d/2]."""
    x1, x2 = x.chunk(2, dim=-1)  # [...,T,d/2] each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Rotary(nn.Module):
    """Rotary position embedding of q or k [B,H,T,d_head] at absolute positions, with the
    config's scaling (tables of cos and sin for every position of its context; "dynamic"
    makes them anew for a pass that reaches past the trained context, and a model with an
    attention window, which reads on past its context, computes the angles of positions
    past the tables for each pass: the tables never grow)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dynamic = config.rope_scaling == "dynamic"
        self.reads_on = config.attention_window is not None  # positions past the tables
        cos, sin = rotary_tables(config, torch.arange(config.context_length))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """positions [T], or [B,T] when each batch row has its own (left padding)."""
        asks = (self.dynamic or self.reads_on) and positions.numel()
        length = int(positions.max()) + 1 if asks else 0
        if (self.dynamic and length > self.config.trained_context) or length > len(self.cos):
            cos, sin = rotary_tables(self.config, positions, length if self.dynamic else None)
            cos, sin = cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)
        else:
            cos = self.cos[positions].to(x.dtype)  # [T,d/2] or [B,T,d/2]
            sin = self.sin[positions].to(x.dtype)
        if positions.dim() == 2:  # [B,T,d/2] -> [B,1,T,d/2]: the same angle in every head
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return apply_rotary(x, cos, sin)


def rotary_tables(
    config: ModelConfig, positions: Tensor, length: int | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin [*positions.shape, d_head/2] (fp32) of the angles m·θ_i at `positions`,
    times the scaling's factor on q and k (`rotary_frequencies`)."""
    theta, factor = rotary_frequencies(config, length)
    angles = positions.to("cpu", torch.float64)[..., None] * theta  # [..., d/2]
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()
