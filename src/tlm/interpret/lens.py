"""The logit lens (§9.5): read the residual stream after every block as if it were the last.

The final norm and the unembedding (u = LN(h) Eᵀ, eq. 9.45) are applied to the stream after
the embedding and after each block; the softmax of each gives the model's "current guess"
of the next token at that depth. At the last layer this is the model's own output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tlm.interpret.hooks import run_with_cache
from tlm.model import TransformerLM


@dataclass
class LogitLens:
    labels: list[str]  # "embed", "block 0", ..., one per depth
    logprobs: Tensor  # [L+1, T, V] log-softmax of the lens at every depth and position

    def top(self, k: int = 5) -> tuple[Tensor, Tensor]:
        """The k likeliest tokens at every depth and position: (probs, ids), each [L+1, T, k]."""
        logprobs, ids = self.logprobs.topk(k, dim=-1)
        return logprobs.exp(), ids


def residual_stream(model: TransformerLM, input_ids: Tensor) -> tuple[list[str], Tensor]:
    """The stream of one prompt [1, T] after the embedding and after every block: [L+1, T, d]."""
    L = model.config.n_layers
    names = ["embed", *(f"blocks.{layer}.resid_post" for layer in range(L))]
    _, cache = run_with_cache(model, input_ids, names)
    labels = ["embed", *(f"block {layer}" for layer in range(L))]
    return labels, torch.stack([cache[name][0] for name in names])


@torch.no_grad()
def logit_lens(model: TransformerLM, input_ids: Tensor) -> LogitLens:
    """The lens for one prompt input_ids [1, T]."""
    labels, stream = residual_stream(model, input_ids)
    logits = model.unembed(model.ln_f(stream)).float()  # [L+1, T, d] -> [L+1, T, V]
    return LogitLens(labels, logits.log_softmax(dim=-1))
