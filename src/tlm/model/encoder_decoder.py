"""The encoder-decoder transformer of Vaswani et al. 2017 ("Attention Is All You Need", Fig. 1).

J&M §9.5 calls the decoder-only LM "roughly half" of this model. The other half is an
encoder: the same blocks with bidirectional self-attention (`causal=False`) that read the
source sentence once. Each decoder block adds a third sublayer between its causal
self-attention and its FFN, cross-attention, whose queries come from the target and whose
keys and values come from the encoder's output (§3.2.3):

    H_enc = Encoder(E[src]·√d + P)                       every source position sees all
    t1 = SelfAttention(Y)            causal, over the target so far
    t2 = CrossAttention(t1, H_enc)   Q from the target, K and V from the source
    out = FFN(t2)                    each with its residual add and LayerNorm

One vocabulary serves both languages: E embeds the source and the target tokens and, as
the head, scores the next target token (§3.4, weight tying), and embeddings are scaled by
√d_model. Source padding (`source_mask` [B,S], 1 for tokens, 0 for padding) is hidden from
the encoder's and the cross-attention's keys; targets are right-padded, so causal
attention never reaches their padding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tlm.config import ModelConfig
from tlm.model.attention import CrossAttention, MultiHeadAttention
from tlm.model.hooks import HookPoint, name_hook_points
from tlm.model.kv_cache import KVCache
from tlm.model.layers import BLOCKS, Embedding, FeedForward, LayerNorm


def key_mask(source_mask: Tensor | None) -> Tensor | None:
    """[B,S] with 1 for tokens -> bool [B,1,1,S]: which keys every query may attend to."""
    return None if source_mask is None else source_mask.bool()[:, None, None, :]


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the source, FFN; pre- or post-norm.

    Hook points (for layer l): `decoder.l.resid_pre`, `.attn.*`, `.resid_mid` (after the
    self-attention's add), `.cross.*` (its `pattern` says which source token each target
    position reads), `.resid_cross`, `.mlp.*`, `.resid_post`.
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, eps, bias = config.d_model, config.layer_norm_eps, config.bias
        self.pre_norm = config.norm == "pre"
        self.resid_pre = HookPoint()
        self.ln1 = LayerNorm(d, eps, bias)
        self.attn = MultiHeadAttention(config, layer)
        self.resid_mid = HookPoint()
        self.ln_cross = LayerNorm(d, eps, bias)
        self.cross = CrossAttention(config, layer)
        self.resid_cross = HookPoint()
        self.ln2 = LayerNorm(d, eps, bias)
        self.ffn = FeedForward(config)
        self.resid_post = HookPoint()
        self.drop = nn.Dropout(config.resid_dropout_p)  # on each sublayer, before the add

    def forward(
        self,
        y: Tensor,
        positions: Tensor,
        memory: Tensor,
        memory_mask: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        y = self.resid_pre(y)
        if self.pre_norm:  # x + Sublayer(LayerNorm(x)), as eq. 9.37-9.44
            t1 = self.resid_mid(y + self.drop(self.attn(self.ln1(y), positions, None, cache)))
            read = self.cross(self.ln_cross(t1), memory, memory_mask, cache)
            t2 = self.resid_cross(t1 + self.drop(read))
            return self.resid_post(t2 + self.drop(self.ffn(self.ln2(t2))))
        # LayerNorm(x + Sublayer(x)), the paper's form (eq. 10.24-10.31 with a third sublayer)
        t1 = self.resid_mid(self.ln1(y + self.drop(self.attn(y, positions, None, cache))))
        read = self.cross(t1, memory, memory_mask, cache)
        t2 = self.resid_cross(self.ln_cross(t1 + self.drop(read)))
        return self.resid_post(self.ln2(t2 + self.drop(self.ffn(t2))))


class EncoderDecoder(nn.Module):
    """source_ids [B,S], target_ids [B,T] -> logits [B,T,V] for the next target token."""

    def __init__(self, config: ModelConfig, init: bool = True) -> None:
        """`init=False` leaves the weights unset, for a loader that fills every one of them."""
        super().__init__()
        if config.model_type != "encoder-decoder":
            raise ValueError(f"EncoderDecoder needs model_type='encoder-decoder', got {config}")
        self.config = config
        self.embedding = Embedding(config, scale=math.sqrt(config.d_model))  # §3.4
        self.drop = nn.Dropout(config.embd_dropout_p)  # on the scaled embedding + P
        self.embed_source, self.embed_target = HookPoint(), HookPoint()
        encoder_block = BLOCKS[config.norm]
        self.encoder = nn.ModuleList(
            encoder_block(config, layer, causal=False) for layer in range(config.n_encoder_layers)
        )
        self.decoder = nn.ModuleList(DecoderBlock(config, i) for i in range(config.n_layers))
        pre = config.norm == "pre"  # a pre-norm stack ends with a LayerNorm (post-norm: normed)
        d, eps = config.d_model, config.layer_norm_eps
        self.ln_enc = LayerNorm(d, eps, config.bias) if pre else nn.Identity()
        self.ln_f = LayerNorm(d, eps, config.bias) if pre else nn.Identity()
        self.memory, self.final = HookPoint(), HookPoint()
        untied = not config.tie_embeddings
        self.W_U = nn.Parameter(torch.empty(d, config.vocab_size)) if untied else None
        self.logits = HookPoint()
        name_hook_points(self)
        if init:
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """E and W_U ~ N(0, 1/d), so that E[w]·√d has unit scale beside the sinusoids; the
        other matrices Glorot-uniform (the paper's code); biases and β 0, γ 1."""
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        d = self.config.d_model
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            with torch.no_grad():
                if leaf in ("E", "W_U"):
                    param.normal_(0.0, d**-0.5, generator=generator)
                elif leaf == "P":
                    param.normal_(0.0, 0.02, generator=generator)
                elif leaf.startswith("W_"):
                    bound = math.sqrt(6.0 / (param.shape[0] + param.shape[1]))
                    param.uniform_(-bound, bound, generator=generator)
                elif leaf == "gamma":
                    param.fill_(1.0)
                else:  # b_*, beta
                    param.zero_()

    def encode(self, source_ids: Tensor, source_mask: Tensor | None = None) -> Tensor:
        """source_ids [B,S] -> the encoder's output H_enc [B,S,d] (its padding rows are
        computed but never read)."""
        S = source_ids.shape[1]
        self._check_length(S, "source")
        positions = torch.arange(S, device=source_ids.device)
        x = self.embed_source(self.drop(self.embedding(source_ids, positions)))
        mask = key_mask(source_mask)
        for block in self.encoder:
            x = block(x, positions, mask)  # bidirectional: no causal mask, padding hidden
        return self.memory(self.ln_enc(x))

    def decode(
        self,
        target_ids: Tensor,
        memory: Tensor,
        source_mask: Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """target_ids [B,T] (after `cache.length` cached positions) -> logits [B,T,V]."""
        start = 0 if cache is None else cache.length
        T = target_ids.shape[1]
        self._check_length(start + T, "target")
        positions = torch.arange(start, start + T, device=target_ids.device)
        y = self.embed_target(self.drop(self.embedding(target_ids, positions)))
        mask = key_mask(source_mask)
        for block in self.decoder:
            y = block(y, positions, memory, mask, cache)
        if cache is not None:
            cache.advance(T)
        if last_only:
            y = y[:, -1:]
        h = self.final(self.ln_f(y))
        head = self.embedding.E.t() if self.W_U is None else self.W_U
        return self.logits(h @ head)  # the tied head: u = h E^T (§3.4)

    def forward(
        self, source_ids: Tensor, target_ids: Tensor, source_mask: Tensor | None = None
    ) -> Tensor:
        """Teacher forcing: every target position at once -> logits [B,T,V]."""
        return self.decode(target_ids, self.encode(source_ids, source_mask), source_mask)

    def _check_length(self, n: int, side: str) -> None:
        if n > self.config.context_length:
            raise ValueError(
                f"{side} has {n} tokens; context_length is {self.config.context_length}"
            )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
