"""Attention (J&M §9.1, §9.3): the equations written out, the fused kernel, and the module.

Shape legend: B batch, T query positions, S key positions, H heads, d model width,
d_head per-head width.

`attention_reference` computes softmax(mask(QKᵀ/√d_k))V step by step and returns the
pattern α; `attention_fused` calls `F.scaled_dot_product_attention`. They mean the same
thing and a test holds them equal. Each forward pass picks: the written-out path when
something listens to the hook points `attn.scores` or `attn.pattern`, the fused one otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tlm.config import ModelConfig
from tlm.model.functional import linear
from tlm.model.hooks import HookPoint
from tlm.model.kv_cache import Cache, KVCache
from tlm.model.positions import Rotary
from tlm.model.window import window_causal_mask


def causal_mask(T: int, S: int, device: torch.device | None = None) -> Tensor:
    """Boolean [T, S] mask, True where query i may attend to key j (Fig. 9.9).

    Queries are the last T of the S positions, so query i sits at absolute position
    S - T + i and sees keys j <= S - T + i. With T == S this is the lower triangle.
    """
    rows = torch.arange(T, device=device).unsqueeze(1) + (S - T)  # [T,1]
    cols = torch.arange(S, device=device).unsqueeze(0)  # [1,S]
    return cols <= rows


def simplified_attention(x: Tensor) -> tuple[Tensor, Tensor]:
    """The intuition of eq. 9.6-9.8: no projections, score(x_i, x_j) = x_i · x_j.

    x: [..., T, d] -> (a [..., T, d], alpha [..., T, T]).
    """
    T = x.shape[-2]
    scores = x @ x.transpose(-2, -1)  # eq. 9.7  [...,T,d] @ [...,d,T] -> [...,T,T]
    scores = scores.masked_fill(~causal_mask(T, T, x.device), float("-inf"))  # only j <= i
    alpha = torch.softmax(scores, dim=-1)  # eq. 9.8
    return alpha @ x, alpha  # eq. 9.6  a_i = sum_j alpha_ij x_j


def attention_scores(q: Tensor, k: Tensor, mask: Tensor | None = None) -> Tensor:
    """q·k/√d_k for every query and key, -inf where the mask forbids (eq. 9.11, Fig. 9.9).

    q: [B,H,T,d_head], k: [B,H,S,d_head]; mask: bool broadcastable to [B,H,T,S], True = may
    attend (None = attend everywhere). Returns [B,H,T,S].
    """
    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # eq. 9.11  [B,H,T,d_head] @ [B,H,d_head,S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf above the diagonal (Fig. 9.9)
    return scores


def attend(pattern: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """head_i = Σ_j α_ij v_j (eq. 9.13): [B,H,T,S] @ [B,H,S,d_head] -> [B,H,T,d_head]."""
    weights = F.dropout(pattern, dropout_p) if dropout_p > 0 else pattern
    return weights @ v


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention written out (eq. 9.11-9.13, 9.35).

    q: [B,H,T,d_head], k and v: [B,H,S,d_head]; mask as in `attention_scores`. Returns
    (heads [B,H,T,d_head], pattern α [B,H,T,S]).
    """
    pattern = torch.softmax(attention_scores(q, k, mask), dim=-1)  # eq. 9.12  rows sum to 1
    return attend(pattern, v, dropout_p), pattern


def attention_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    window: int | None = None,
) -> Tensor:
    """The same attention through PyTorch's fused kernel; the pattern is never materialised.

    `is_causal=True` (only with T == S and no mask) lets the kernel skip the masked half.
    `window` W (a causal pass over its own T positions): each query sees the W keys up to
    its own, the band given to the kernel as a mask (with `mask`, both).
    Under bf16 autocast on a CPU it runs in fp32 on the bf16-rounded q, k, v: PyTorch's CPU
    kernel is slower in bf16 than in fp32 (3.7x at d_head 32, T 64; docs/benchmarks-history.md), and
    the products around it still run in bf16. A bf16 training run on a CPU with AVX512_BF16
    runs tlm's own kernel instead where it applies (`use_attention_kernel`).
    """
    if window is not None and window < k.shape[-2]:
        band = window_causal_mask(q.shape[-2], k.shape[-2], window, q.device)
        mask, is_causal = (band if mask is None else mask & band), False
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), mask, dropout_p, is_causal
            )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
    )


def padding_mask(T: int, key_padding: Tensor) -> Tensor:
    """Causal attention of T new queries over S positions, never to a padding key.

    `key_padding` [B,S] is 1 for tokens, 0 for (left) padding; the queries are the last T of
    the S positions (Fig. 9.9). A padding query sees itself only, so no row is empty.
    Returns bool [B,1,T,S].
    """
    S, device = key_padding.shape[1], key_padding.device
    mask = causal_mask(T, S, device) & key_padding.bool()[:, None, None, :]  # [B,1,T,S]
    itself = torch.arange(S, device=device) == (torch.arange(T, device=device) + S - T)[:, None]
    return mask | itself  # [T,S]: the diagonal of each query's own position


def document_mask(documents: Tensor) -> Tensor:
    """Causal attention within documents packed side by side in a window (padding-free
    packing): `documents` [B,T] numbers the document of each position, and query i may
    attend to key j only if j <= i and both are in one document. Returns bool [B,1,T,T]."""
    T = documents.shape[1]
    same = documents[:, :, None] == documents[:, None, :]  # [B,T,T]
    return (causal_mask(T, T, documents.device) & same)[:, None]


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention, eq. 9.15-9.19 in the parallel form of eq. 9.34-9.36.

    Parameters are named after the equations: W_Q, W_K, W_V [d, H*d_head] and W_O
    [H*d_head, d], right-multiplied as in the book (x @ W_Q). The two products are methods
    (`project_qkv`, `project_out`): `tlm.inference` builds a model for decoding from
    subclasses that run them through faster kernels, on the same parameters.
    """

    fused = staticmethod(attention_fused)  # the fused path; `use_attention_kernel` sets another

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, d_attn = config.d_model, config.d_attn
        self.layer = layer  # its slot in a cache
        self.n_heads, self.d_head = config.n_heads, config.d_head
        self.dropout = config.attn_dropout_p  # on α only: residual dropout never reaches SDPA
        self.W_Q = nn.Parameter(torch.empty(d, d_attn))
        self.W_K = nn.Parameter(torch.empty(d, d_attn))
        self.W_V = nn.Parameter(torch.empty(d, d_attn))
        self.W_O = nn.Parameter(torch.empty(d_attn, d))
        if config.bias:
            self.b_Q = nn.Parameter(torch.zeros(d_attn))
            self.b_K = nn.Parameter(torch.zeros(d_attn))
            self.b_V = nn.Parameter(torch.zeros(d_attn))
            self.b_O = nn.Parameter(torch.zeros(d))
        else:
            self.b_Q = self.b_K = self.b_V = self.b_O = None
        self.rotary = Rotary(config) if config.position == "rope" else None
        self.window = config.attention_window  # each query sees at most W keys (or all)
        self.qk_norm = config.qk_norm
        self.q, self.k, self.v = HookPoint(), HookPoint(), HookPoint()  # [B,H,T,d_head]
        self.scores, self.pattern = HookPoint(), HookPoint()  # [B,H,T,S]
        self.z = HookPoint()  # each head's output before W_O  [B,T,H,d_head]
        self.out = HookPoint()  # after W_O  [B,T,d]

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q = XW^Q + b_Q, K = XW^K + b_K, V = XW^V + b_V (eq. 9.34): [B,T,d] -> 3 × [B,T,H*dh]."""
        return (
            linear(x, self.W_Q, self.b_Q),
            linear(x, self.W_K, self.b_K),
            linear(x, self.W_V, self.b_V),
        )

    def project_out(self, z: Tensor) -> Tensor:
        """(head_1 ⊕ ... ⊕ head_A) W^O + b_O (eq. 9.19): [B,T,H*dh] -> [B,T,d]."""
        return linear(z, self.W_O, self.b_O)

    def split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # [B,T,H*dh] -> [B,H,T,dh]

    def normed(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """With qk_norm, q and k at unit RMS per head: the logits stay bounded (not the book)."""
        if not self.qk_norm:
            return q, k
        return F.rms_norm(q, (q.shape[-1],)), F.rms_norm(k, (k.shape[-1],))

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        cache: Cache | None = None,
        causal: bool = True,
    ) -> Tensor:
        """x: [B,T,d] -> a: [B,T,d].

        `positions` [T] or [B,T] are absolute positions (for rope). Attention is causal; with
        a `cache` (`model/kv_cache.py`), x holds the new positions, the cache stores their
        keys and values, and each query also attends to the stored ones. `mask` (from
        `padding_mask`) replaces the causal mask where batch rows are left-padded.
        `causal=False` lets every query see every key (an encoder); `mask` then only hides
        padding. With an attention window W (`model/window.py`) a causal query sees the W
        keys up to its own position: the band is added here, or by the cache, which knows
        the positions of the keys it holds.
        """
        B, T, _ = x.shape
        q, k, v = map(self.split_heads, self.project_qkv(x))  # eq. 9.34  [B,H,T,dh] each
        q, k = self.normed(q, k)
        if self.rotary is not None:  # relative positions: rotate q and k, never v
            if positions is None:
                positions = torch.arange(T, device=q.device)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        q, k, v = self.q(q), self.k(k), self.v(v)
        if cache is None:  # the window's band (a cache gives the keys it holds their own)
            heads = self.attend(q, k, v, mask, causal, self.window if causal else None)
        else:  # the cache stores k, v and hands each query the keys it may see
            heads = cache.attend(self.layer, q, k, v, mask, self.attend)
        z = self.z(heads.transpose(1, 2))  # [B,H,T,dh] -> [B,T,H,dh]
        return self.out(self.project_out(z.reshape(B, T, -1)))  # concat, then W^O: eq. 9.19

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        causal: bool = True,
        window: int | None = None,
    ) -> Tensor:
        """Every head's output [B,H,T,d_head] from q [B,H,T,d_head] and k, v [B,H,S,d_head]
        (eq. 9.11-9.13): the last T of S positions query; without `causal`, `mask` alone says
        what a query may see. `window` W (a pass over its own positions, T == S): each query
        sees the W keys up to its own, the band on top of `mask`."""
        T, S = q.shape[2], k.shape[2]
        window = window if window is not None and window < S else None  # else all
        whole_window = causal and mask is None and 1 < T == S  # the kernel's causal mask
        if causal and mask is None and 1 < T < S:  # new queries after cached keys
            mask = causal_mask(T, S, q.device)
        dropout_p = self.dropout if self.training else 0.0
        if self.scores.listening or self.pattern.listening:  # α is wanted: write it out
            if whole_window:
                mask = causal_mask(T, S, q.device)
            if window is not None:  # Fig. 9.9's mask cut to a band of width W
                band = window_causal_mask(T, S, window, q.device)
                mask = band if mask is None else mask & band
            scores = self.scores(attention_scores(q, k, mask))  # eq. 9.11
            pattern = self.pattern(torch.softmax(scores, dim=-1))  # eq. 9.12
            return attend(pattern, v, dropout_p)  # eq. 9.13
        if window is None:
            return self.fused(q, k, v, mask, dropout_p, is_causal=whole_window)
        return self.fused(q, k, v, mask, dropout_p, is_causal=whole_window, window=window)


def use_attention_kernel(model: nn.Module, kernel: Callable[..., Tensor]) -> None:
    """Every attention layer of `model` runs its fused path through `kernel`, which takes
    `attention_fused`'s arguments and means the same (`train/opening.py` sets tlm's C kernel,
    `train/attention_kernel.py`, for training on a CPU). The written-out path is unchanged."""
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.fused = kernel


class CrossAttention(MultiHeadAttention):
    """Queries from one sequence, keys and values from another (Vaswani et al. §3.2.3: the
    decoder reads the encoder's output). The same parameters and hook points as
    self-attention; no positions are added (the source has its own)."""

    def project_kv(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """K = SW^K + b_K, V = SW^V + b_V from the source S: [B,S,d] -> 2 × [B,S,H*dh]."""
        return linear(source, self.W_K, self.b_K), linear(source, self.W_V, self.b_V)

    def forward(
        self,
        x: Tensor,
        source: Tensor,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x [B,T,d] reads source [B,S,d] -> [B,T,d]; `mask` hides the source's padding. With
        a cache the source's keys and values are projected once and kept (`KVCache.cross`)."""
        B, T, _ = x.shape
        if cache is None:
            k, v = self.project_kv(source)
        else:
            k, v = cache.cross(self.layer, lambda: self.project_kv(source))
        q = self.split_heads(linear(x, self.W_Q, self.b_Q))  # queries from the target
        q, k = self.normed(q, self.split_heads(k))
        q, k, v = self.q(q), self.k(k), self.v(self.split_heads(v))
        z = self.z(self.attend(q, k, v, mask, causal=False).transpose(1, 2))  # [B,T,H,dh]
        return self.out(self.project_out(z.reshape(B, T, -1)))
