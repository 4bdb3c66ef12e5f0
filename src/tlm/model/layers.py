"""The pieces of the model around attention (J&M §9.2, §9.4): embeddings, LayerNorm, FFN, block.

Parameter names are the book's: E [V, d] token embeddings, P [N, d] learned positions,
gamma/beta (eq. 9.25), W_1 b_1 W_2 b_2 (eq. 9.21).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tlm.config import ModelConfig
from tlm.model.attention import MultiHeadAttention
from tlm.model.functional import ACTIVATIONS, linear
from tlm.model.hooks import HookPoint
from tlm.model.kv_cache import Cache
from tlm.model.positions import sinusoidal_table


class Embedding(nn.Module):
    """X = E[w] + P[pos] (Fig. 9.13): token embeddings plus absolute positions if any."""

    def __init__(self, config: ModelConfig, scale: float = 1.0) -> None:
        super().__init__()
        self.E = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.scale = scale  # √d_model in the encoder-decoder (Vaswani et al. §3.4)
        self.position = config.position
        if config.position == "learned":
            self.P = nn.Parameter(torch.empty(config.context_length, config.d_model))
        elif config.position == "sinusoidal":
            table = sinusoidal_table(config.context_length, config.d_model)
            self.register_buffer("P", table, persistent=False)
        else:  # rope (applied inside attention) or none
            self.P = None

    def tokens(self, input_ids: Tensor) -> Tensor:
        """E[w]: row selection == one_hot(w) @ E (Fig. 9.11); [B,T] -> [B,T,d]. A method, so
        that a model built for inference (`tlm.inference`) can keep the rows in its format."""
        return F.embedding(input_ids, self.E)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """input_ids [B,T], positions [T] or [B,T] -> X [B,T,d]."""
        x = self.tokens(input_ids)
        if self.scale != 1.0:
            x = x * self.scale
        if self.P is not None:
            x = x + self.P[positions]  # [B,T,d] + [T,d] (or [B,T,d] per row)
        return x


class LayerNorm(nn.Module):
    """LayerNorm(x) = γ (x - μ)/σ + β (eq. 9.25); the formula is `functional.layer_norm`."""

    def __init__(self, d: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d))
        self.beta = nn.Parameter(torch.zeros(d)) if bias else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.gamma.shape, self.gamma, self.beta, self.eps)


class FeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2 (eq. 9.21), applied at each position.

    The two products are methods (`up`, `down`), which a model built for inference
    (`tlm.inference`) runs through faster kernels. Hook points (public names
    `blocks.l.mlp.*`): `pre` and `post` the hidden layer before and after the activation
    [B,T,d_ff], `out` [B,T,d].
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, d_ff = config.d_model, config.d_ff
        self.W_1 = nn.Parameter(torch.empty(d, d_ff))
        self.W_2 = nn.Parameter(torch.empty(d_ff, d))
        self.b_1 = nn.Parameter(torch.zeros(d_ff)) if config.bias else None
        self.b_2 = nn.Parameter(torch.zeros(d)) if config.bias else None
        self.act = ACTIVATIONS[config.activation]
        self.pre, self.post, self.out = HookPoint(), HookPoint(), HookPoint()

    def up(self, x: Tensor) -> Tensor:
        return linear(x, self.W_1, self.b_1)  # x W_1 + b_1: [B,T,d] -> [B,T,d_ff]

    def down(self, h: Tensor) -> Tensor:
        return linear(h, self.W_2, self.b_2)  # h W_2 + b_2: [B,T,d_ff] -> [B,T,d]

    def forward(self, x: Tensor) -> Tensor:
        h = self.post(self.act(self.pre(self.up(x))))  # eq. 9.21
        return self.out(self.down(h))


class PreNormBlock(nn.Module):
    """One transformer block in the pre-norm form (eq. 9.37-9.44), the one GPT-2 uses.

    `causal=False` makes it an encoder block: every position attends to every other one
    (but never to padding, which `mask` hides).
    """

    def __init__(self, config: ModelConfig, layer: int = 0, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.resid_pre = HookPoint()
        self.ln1 = LayerNorm(config.d_model, config.layer_norm_eps, config.bias)
        self.attn = MultiHeadAttention(config, layer)
        self.resid_mid = HookPoint()
        self.ln2 = LayerNorm(config.d_model, config.layer_norm_eps, config.bias)
        self.ffn = FeedForward(config)
        self.resid_post = HookPoint()
        self.drop = nn.Dropout(config.resid_dropout_p)  # on each sublayer, before the add

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        mask: Tensor | None = None,
        cache: Cache | None = None,
    ) -> Tensor:
        x = self.resid_pre(x)
        t2 = self.attn(self.ln1(x), positions, mask, cache, causal=self.causal)  # eq. 9.39-9.40
        t3 = self.resid_mid(x + self.drop(t2))  # eq. 9.41  residual add
        t5 = self.ffn(self.ln2(t3))  # eq. 9.42-9.43  FFN(LayerNorm(T3))
        return self.resid_post(t3 + self.drop(t5))  # eq. 9.44


class PostNormBlock(PreNormBlock):
    """The post-norm form of the original transformer (eq. 10.24-10.31): norm after the add."""

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        mask: Tensor | None = None,
        cache: Cache | None = None,
    ) -> Tensor:
        x = self.resid_pre(x)
        t1 = self.attn(x, positions, mask, cache, causal=self.causal)  # eq. 10.26
        t3 = self.resid_mid(self.ln1(x + self.drop(t1)))  # eq. 10.27-10.28
        t4 = self.ffn(t3)  # eq. 10.29
        return self.resid_post(self.ln2(t3 + self.drop(t4)))  # eq. 10.30-10.31


BLOCKS = {"pre": PreNormBlock, "post": PostNormBlock}
