"""The decoder-only transformer language model (J&M Fig. 9.15) and its initialisation."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tlm import upcalls
from tlm.config import ModelConfig
from tlm.model.attention import document_mask, padding_mask
from tlm.model.counts import flops_per_token, parameter_counts
from tlm.model.functional import linear
from tlm.model.hooks import HookPoint, name_hook_points
from tlm.model.kv_cache import Cache
from tlm.model.layers import BLOCKS, Embedding, LayerNorm
from tlm.model.positions import document_positions


class TransformerLM(nn.Module):
    """input_ids [B,T] -> logits [B,T,V]: embed, L blocks, (final LayerNorm), unembed.

    Every activation is readable at a named hook point (`embed`, `blocks.{l}.resid_pre`,
    `blocks.{l}.attn.pattern`, ..., `final`, `logits`; the list is in `model/hooks.py`).
    """

    def __init__(self, config: ModelConfig, init: bool = True) -> None:
        """`init=False` leaves the weights unset, for a loader that fills every one of them."""
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.drop = nn.Dropout(config.embd_dropout_p)  # on X = E[w] + P[pos]
        self.embed = HookPoint()
        block = BLOCKS[config.norm]
        self.blocks = nn.ModuleList(block(config, layer) for layer in range(config.n_layers))
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
        self.logits = HookPoint()
        name_hook_points(self)
        if init:
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

    def forward(
        self,
        input_ids: Tensor,
        cache: Cache | None = None,
        attention_mask: Tensor | None = None,
        last_only: bool = False,
        documents: Tensor | None = None,
    ) -> Tensor:
        """input_ids [B,T] -> logits [B,T,V] ([B,1,V] with `last_only`).

        With a `cache` (`model/kv_cache.py`), input_ids are the positions after the ones it
        holds, and their keys and values are added to it; `last_only` then gives each row's
        last position (a cache of `tlm.inference.SlotCache` feeds many rows' tokens as one
        sequence [1,N] and gives [1,rows,V]). `attention_mask` [B, cached + T] is 1 for
        tokens and 0 for left padding: padding is never attended to, and positions count
        tokens only. `documents` [B,T] (no cache) numbers the document of each position of
        windows that hold several side by side (instruction tuning's packing): a token
        attends within its document only, and its position counts from the document's start.
        """
        T = input_ids.shape[1]
        self.check_context(T if cache is None else cache.end(T))
        mask = None
        if documents is not None:  # packed windows: each document as if it were alone
            positions, mask = document_positions(documents), document_mask(documents)
        elif attention_mask is not None:  # the mask covers the cached positions and these T
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -T:]  # [B,T]
            mask = padding_mask(T, attention_mask)
        elif cache is None:
            positions = torch.arange(T, device=input_ids.device)  # [T]
        else:
            positions = cache.positions(T, input_ids.device)
        x = self.embed(self.drop(self.embedding(input_ids, positions)))  # X [B,T,d]
        for block in self.blocks:
            x = block(x, positions, mask, cache)  # H^l [B,T,d], the residual stream
        if cache is not None:
            cache.advance(T)
        if last_only:  # only the last position (of each row) predicts the next token
            x = x[:, -1:] if cache is None else cache.last(x)
        return self.logits(self.unembed(self.final(self.ln_f(x))))

    def check_context(self, end: int) -> None:
        """Refuse a pass after which the longest row would hold `end` > N tokens, but for a
        model with an attention window, which reads on (each query sees W keys)."""
        if end > self.config.context_length and self.config.attention_window is None:
            raise ValueError(
                f"input has {end} tokens; context_length is {self.config.context_length}"
            )

    def unembed(self, h: Tensor) -> Tensor:
        """u = h E^T (eq. 9.45), or h W_U untied: [B,T,d] -> [B,T,V]."""
        return linear(h, self.unembedding(), None)  # tied: E^T is a view, never a copy

    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int = 100,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        num_beams: int = 1,
        eos_token_id: int | tuple[int, ...] | None = None,
        seed: int | None = None,
        use_cache: bool = True,
        attention_mask: Tensor | None = None,
        **settings,
    ) -> Tensor:
        """input_ids [B,T] -> [B*n, T + new], as Hugging Face's `generate` names things.

        A convenience over `tlm.generate` (which yields the tokens step by step): rows
        that end early are padded with their end token. More settings (repetition_penalty,
        length_penalty, num_return_sequences, frequency_penalty, presence_penalty,
        logit_bias, best_of) pass through `settings`; with `best_of` m, m samples are drawn
        per prompt and the n of highest total log-probability returned, best first; a
        `tlm.inference.Decoder` of this model to decode with, as `decoder`. The decoding
        policy is `tlm.generate`'s (`generate/sequences.py`), which the math does not
        import: the package's root provides it (`tlm/upcalls.py`).
        """
        return upcalls.generate_sequences(
            self, input_ids, attention_mask, max_new_tokens=max_new_tokens, do_sample=do_sample,
            temperature=temperature, top_k=top_k, top_p=top_p, num_beams=num_beams,
            eos_token_id=eos_token_id, seed=seed, use_cache=use_cache, **settings,
        )  # fmt: skip

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
