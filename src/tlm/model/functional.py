"""Small functions of the block, written as the book writes them (eq. 9.21-9.25).

The modules in `layers.py` call the fast torch kernels; the functions here are the
reference each kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
    """x @ W + b, with W stored [in, out] as the book writes it, in one BLAS call."""
    return F.linear(x, W.t(), b)  # [...,in] @ [in,out] -> [...,out]


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension, eq. 9.22-9.25 (eps inside the root, as torch)."""
    mu = x.mean(dim=-1, keepdim=True)  # eq. 9.22  μ = (1/d) Σ x_i
    sigma = torch.sqrt(((x - mu) ** 2).mean(dim=-1, keepdim=True) + eps)  # eq. 9.23
    x_hat = (x - mu) / sigma  # eq. 9.24
    return gamma * x_hat + beta  # eq. 9.25


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation used by GPT-2 (Hendrycks & Gimpel 2016)."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


ACTIVATIONS = {
    "relu": F.relu,  # eq. 9.21
    "gelu": F.gelu,  # exact: x·Φ(x)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # == gelu_tanh, in one kernel
    "relu2": lambda x: F.relu(x).square(),  # ReLU(x)², So et al. 2021 (not in the book)
}
