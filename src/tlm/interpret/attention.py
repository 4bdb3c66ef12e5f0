"""Attention patterns α (eq. 9.12) of every layer and head, and an encoder-decoder's
cross-attention: which source token each target position reads; and one head step by step,
from q·k to what each source position adds to a query's output."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tlm.interpret.hooks import check_head, run_with_cache
from tlm.model import EncoderDecoder, TransformerLM
from tlm.tokenizer import Tokenizer, document_ids


def attention_patterns(model: TransformerLM, input_ids: Tensor) -> Tensor:
    """α for input_ids [1, T] -> [L, H, T, T], row i = how much position i attends to each j.

    Listening to `attn.pattern` makes this forward pass form α (the written-out path).
    """
    names = [f"blocks.{layer}.attn.pattern" for layer in range(model.config.n_layers)]
    _, cache = run_with_cache(model, input_ids, names)
    return torch.stack([cache[name][0] for name in names])  # L x [H,T,T] -> [L,H,T,T]


def cross_attention_patterns(
    model: EncoderDecoder, source_ids: Tensor, target_ids: Tensor
) -> Tensor:
    """Cross-attention α of the decoder reading target_ids [1, T] (teacher forcing) over
    source_ids [1, S] -> [L, H, T, S]: row t = how much target position t reads each source
    token (Vaswani et al. §3.2.3; the alignment Bahdanau et al. drew)."""
    names = [f"decoder.{layer}.cross.pattern" for layer in range(model.config.n_layers)]
    _, cache = run_with_cache(model, source_ids, names, target_ids=target_ids)
    return torch.stack([cache[name][0] for name in names])  # L x [H,T,S] -> [L,H,T,S]


@torch.no_grad()
def cross_attention_of(
    model: EncoderDecoder, tokenizer: Tokenizer, source: str, translation: str
) -> tuple[Tensor, list[str], list[str]]:
    """The cross-attention [L, H, T, S] of the decoder reading <|endoftext|> + `translation`
    over `source` (as training fed them), with the target tokens (rows: row t read these,
    predicting token t+1) and the source tokens (columns)."""
    source_ids = [*tokenizer.encode(source), tokenizer.eot_id]
    target_ids = document_ids(tokenizer, translation)
    patterns = cross_attention_patterns(
        model, torch.tensor([source_ids]), torch.tensor([target_ids])
    )
    rows = [tokenizer.decode([i]) for i in target_ids]
    return patterns, rows, [tokenizer.decode([i]) for i in source_ids]


@torch.no_grad()
def attention_steps(
    model: TransformerLM, input_ids: Tensor, layer: int, head: int | None = None
) -> dict[str, Tensor]:
    """One head's attention on input_ids [1, T], step by step (eq. 9.10-9.14), each [T, T]
    (with `head` None, every head's: [H, T, T]):

    - `scores`: q_i · k_j / √d_k for every pair, before the mask (eq. 9.11);
    - `masked`: the same with -inf where j > i (Fig. 9.9), as `attn.scores` holds it;
    - `pattern`: α = softmax of each masked row (eq. 9.12), as `attn.pattern` holds it;
    - `contrib`: ‖α_ij v_j‖ = α_ij ‖v_j‖, what source j adds to query i's output (eq. 9.13);

    and `value_norms` [T] (or [H, T]), each ‖v_j‖.
    """
    check_head(model, layer, head)
    names = [f"blocks.{layer}.attn.{name}" for name in ("q", "k", "v", "scores", "pattern")]
    _, cache = run_with_cache(model, input_ids, names)
    pick = slice(None) if head is None else head
    q, k, v, masked, pattern = (cache[name][0, pick].float() for name in names)
    norms = v.norm(dim=-1)  # [..., T]
    return {
        "scores": q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]),  # eq. 9.11, every pair
        "masked": masked,
        "pattern": pattern,
        "contrib": pattern * norms.unsqueeze(-2),  # [..., T, T] * [..., 1, T] over columns j
        "value_norms": norms,
    }
