"""The decoder-only transformer language model (J&M Fig. 9.15) and its initialisation."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tlm.config import ModelConfig
from tlm.model.attention import padding_mask
from tlm.model.counts import flops_per_token, parameter_counts
from tlm.model.functional import linear
from tlm.model.hooks import HookPoint, name_hook_points
from tlm.model.kv_cache import KVCache
from tlm.model.layers import BLOCKS, Embedding, LayerNorm
from tlm.model.pack import pack_for_inference
from tlm.model.packed import can_prepack_float32, check_format
from tlm.model.slot_cache import Rows


class TransformerLM(nn.Module):
    """input_ids [B,T] -> logits [B,T,V]: embed, L blocks, (final LayerNorm), unembed.

    Every activation is readable at a named hook point (`embed`, `blocks.{l}.resid_pre`,
    `blocks.{l}.attn.pattern`, ..., `final`, `logits`; the list is in `model/hooks.py`).
    """

    inference_format: str | None = None  # set by `for_inference` once the products are packed

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
        if self.inference_format not in (None, "float32"):
            raise RuntimeError(f"the model keeps its weights in {self.inference_format} only")
        return self.embedding.E.t() if self.W_U is None else self.W_U

    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache | Rows | None = None,
        attention_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """input_ids [B,T] -> logits [B,T,V] ([B,1,V] with `last_only`).

        With a `cache`, input_ids are the positions after the ones it holds, and their keys
        and values are added to it. With a `SlotCache.rows(slots, counts)` cache, input_ids
        [1,N] are the new tokens of several rows, one row after another, each at its own
        length (`model/slot_cache.py`); `last_only` then gives [1,rows,V], each row's last.
        `attention_mask` [B, cached + T]
        is 1 for tokens and 0 for left padding: padding is never attended to, and positions
        count tokens only.
        """
        B, T = input_ids.shape
        rows = isinstance(cache, Rows)  # many rows' tokens in one sequence, each at its length
        start = 0 if cache is None or rows else cache.length
        end = cache.end if rows else start + T
        if end > self.config.context_length:
            raise ValueError(
                f"input has {end} tokens; context_length is {self.config.context_length}"
            )
        mask = None
        if rows:
            if attention_mask is not None:
                raise ValueError("rows of a SlotCache have no padding: give no attention_mask")
            positions = cache.positions  # [1,N]
        elif attention_mask is None:
            positions = torch.arange(start, start + T, device=input_ids.device)  # [T]
        else:
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B,T]
            mask = padding_mask(T, attention_mask)
        x = self.embed(self.drop(self.embedding(input_ids, positions)))  # X [B,T,d]
        for block in self.blocks:
            x = block(x, positions, mask, cache)  # H^l [B,T,d], the residual stream
        if cache is not None:
            cache.advance(T)
        if last_only:  # only the last position (of each row) predicts the next token
            x = x[:, cache.lasts] if rows else x[:, -1:]
        return self.logits(self.unembed(self.final(self.ln_f(x))))

    def unembed(self, h: Tensor) -> Tensor:
        """u = h E^T (eq. 9.45), or h W_U untied: [B,T,d] -> [B,T,V]."""
        return linear(h, self.unembedding(), None)  # tied: E^T is a view, never a copy

    def for_inference(self, dtype: str = "float32") -> TransformerLM:
        """Prepare the weights for fast generation and scoring (in place; no training after).

        On a CPU every weight matrix is prepared for a faster kernel: "float32" adds a oneDNN
        layout, made at the first decoding step of several rows (one row already reads the
        weights at the memory bandwidth, `model/blas.py`); "float16" and "int8" are
        compressed for fbgemm and "bfloat16" halved, and these release the fp32 matrices, so
        memory follows the format. The activations stay fp32. On a GPU "bfloat16" and
        "float16" cast the model and "float32" changes nothing. See `model/packed.py` and
        `model/pack.py`; `tlm.load_model(path, dtype=...)` does the same while reading, with
        a lower peak.
        """
        device = self.embedding.E.device
        check_format(dtype, device)
        self.eval()
        if device.type != "cpu" and dtype in ("bfloat16", "float16"):
            return self.to(getattr(torch, dtype))
        if dtype == "float32" and not can_prepack_float32(device):
            return self
        pack_for_inference(self, dtype)
        self.inference_format = dtype
        return self

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
        length_penalty, num_return_sequences) pass through `settings`.
        """
        from tlm.generate import GenerationConfig, beam_search, generate  # the layer above

        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            num_beams=num_beams,
            eos_token_id=eos_token_id,
            seed=seed,
            use_cache=use_cache,
            **settings,
        )
        if num_beams > 1:
            return beam_search(self, input_ids, config, attention_mask).sequences
        steps = [step.tokens for step in generate(self, input_ids, config, attention_mask)]
        prompts = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
        return torch.cat([prompts, torch.stack(steps, dim=1)], dim=1) if steps else prompts

    def train(self, mode: bool = True) -> TransformerLM:
        if mode and self.inference_format is not None:
            raise RuntimeError("this model was packed for inference (for_inference); reload it")
        return super().train(mode)

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
