"""The decoder-only transformer language model (J&M Fig. 9.15) and its initialisation."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tlm.config import ModelConfig
from tlm.model.counts import flops_per_token, parameter_counts
from tlm.model.hooks import HookPoint
from tlm.model.layers import BLOCKS, Embedding, LayerNorm


class TransformerLM(nn.Module):
    """input_ids [B,T] -> logits [B,T,V]: embed, L blocks, (final LayerNorm), unembed.

    The residual stream is readable at the hook points `embed`, `blocks.{l}.resid_pre`,
    `blocks.{l}.resid_mid`, `blocks.{l}.resid_post` and `final` (after the last norm).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.drop = nn.Dropout(config.dropout)
        self.embed = HookPoint()
        self.blocks = nn.ModuleList(BLOCKS[config.norm](config) for _ in range(config.n_layers))
        # pre-norm ends with one more LayerNorm before the head (§9.2); post-norm is normed already
        if config.norm == "pre":
            self.ln_f = LayerNorm(config.d_model, config.layer_norm_eps, config.bias)
        else:
            self.ln_f = nn.Identity()
        self.final = HookPoint()
        if config.tie_embeddings:
            self.W_U = None  # the head is E^T (weight tying, §9.5)
        else:
            self.W_U = nn.Parameter(torch.empty(config.d_model, config.vocab_size))
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2's initialisation (Radford et al. 2019), in one place.

        | parameter                        | init                | why                      |
        |----------------------------------|---------------------|--------------------------|
        | E, P, W_U, W_Q, W_K, W_V, W_1    | N(0, 0.02²)         | small, equal scales      |
        | W_O, W_2 (write to the residual) | N(0, (0.02/√(2L))²) | 2L adds keep the stream  |
        |                                  |                     | variance O(1) with depth |
        | biases, beta                     | 0                   |                          |
        | gamma                            | 1                   | LayerNorm starts as x̂    |
        """
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            with torch.no_grad():
                if leaf in ("W_O", "W_2"):
                    param.normal_(0.0, residual_std, generator=generator)
                elif leaf.startswith("W_") or leaf in ("E", "P"):
                    param.normal_(0.0, 0.02, generator=generator)
                elif leaf == "gamma":
                    param.fill_(1.0)
                else:  # b_*, beta
                    param.zero_()

    def unembedding(self) -> Tensor:
        """The [d, V] matrix of the LM head: E^T when tied (a view of E's storage), else W_U."""
        return self.embedding.E.t() if self.W_U is None else self.W_U

    def forward(self, input_ids: Tensor) -> Tensor:
        B, T = input_ids.shape
        if T > self.config.context_length:
            raise ValueError(
                f"input has {T} tokens; context_length is {self.config.context_length}"
            )
        positions = torch.arange(T, device=input_ids.device)
        x = self.embed(self.drop(self.embedding(input_ids, positions)))  # X [B,T,d]
        for block in self.blocks:
            x = block(x, positions)  # H^l [B,T,d], the residual stream
        h = self.final(self.ln_f(x))
        return self.unembed(h)

    def unembed(self, h: Tensor) -> Tensor:
        """u = h E^T (eq. 9.45), or h W_U untied: [B,T,d] -> [B,T,V]."""
        if self.W_U is None:
            return torch.nn.functional.linear(h, self.embedding.E)  # h @ E^T without a copy
        return h @ self.W_U

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters counted once each (a tied E is one matrix); Kaplan's N if non_embedding."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.embedding.E.numel()
            if isinstance(self.embedding.P, nn.Parameter):
                total -= self.embedding.P.numel()
            if self.W_U is not None:
                total -= self.W_U.numel()
        return total

    def parameter_counts(self) -> dict[str, int]:
        return parameter_counts(self.config)

    def flops_per_token(self, seq_len: int | None = None, training: bool = False) -> int:
        return flops_per_token(self.config, seq_len, training)
