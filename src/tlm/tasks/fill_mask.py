"""Filling masks with a bidirectional encoder (J&M §11.2.1): the MLM head's distribution at
each [MASK] of a text, read with the whole text around it, left and right."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlm.device import placement
from tlm.errors import UserError
from tlm.model import Encoder
from tlm.tokenizer import Tokenizer, within


@dataclass(frozen=True)
class Filled:
    """One candidate for one [MASK]: the token, its text and its probability."""

    token_id: int
    token: str
    probability: float


@torch.no_grad()
def fill_mask(
    model: Encoder, tokenizer: Tokenizer, text: str, top_k: int = 5
) -> list[list[Filled]]:
    """For each [MASK] in `text`, in order, its `top_k` most probable tokens. The text is
    read as `[CLS] text [SEP]`, every mask at once (each one's distribution given the others
    still masked), as BERT's fill-mask does."""
    if model.config.task is not None:
        raise UserError(f"this encoder is fine-tuned to {model.config.task}: its MLM head is gone")
    mask, cls, sep = (tokenizer.special_id(n) for n in ("[MASK]", "[CLS]", "[SEP]"))
    if mask is None:
        raise UserError(
            "this tokenizer has no [MASK] token: is the run an encoder (--objective mlm)?"
        )
    ids = [cls, *tokenizer.encode(text), sep]
    within(ids, model.config.context_length, "the text")
    where = [i for i, t in enumerate(ids) if t == mask]
    if not where:
        raise UserError("the text has no [MASK] to fill")
    device = placement(model)[0]
    logits = model(torch.tensor([ids], device=device))[0, where].float()  # [masks, V]
    probabilities = torch.softmax(logits, dim=-1)
    top = probabilities.topk(min(top_k, probabilities.shape[-1]), dim=-1)
    return [
        [
            Filled(i, tokenizer.decode([i]), p)
            for p, i in zip(ps.tolist(), ids_.tolist(), strict=True)
        ]
        for ps, ids_ in zip(top.values, top.indices, strict=True)
    ]
