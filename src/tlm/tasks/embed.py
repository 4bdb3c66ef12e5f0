"""Contextual embeddings from an encoder (J&M §11.3): a text as one vector, and how
anisotropic the vectors of a layer are.

    embedding(text)  mean over the text's positions of H (every token, [CLS] and [SEP] too,
                     padding not: as sentence-transformers pools), or H at [CLS]
    anisotropy(l)    the mean cosine between the layer-l vectors of two random words in
                     two different texts (Ethayarajh 2019): near 0 for vectors spread in
                     every direction, near 1 when they all point one way

The layers are the input (`embed`, after its LayerNorm) and each block's output
(`blocks.{l}.resid_post`), read at their hook points.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from tlm.data.labeled import Example, encode_example
from tlm.device import placement
from tlm.errors import UserError
from tlm.evaluate import padded
from tlm.interpret import run_with_cache
from tlm.model import Encoder
from tlm.tokenizer import Tokenizer

POOLS = ("mean", "cls")


def _batches(model: Encoder, tokenizer: Tokenizer, texts: list[str], batch_size: int):
    """(ids, segments, mask) of `[CLS] text [SEP]` batches, each text cut to the context."""
    if not texts:
        raise UserError("there is no text to embed")
    T, pad = model.config.context_length, tokenizer.special_id("[PAD]")
    device = placement(model)[0]
    for i in range(0, len(texts), batch_size):
        encoded = [encode_example(Example("", t, None, 0), tokenizer, "classify", T)
                   for t in texts[i : i + batch_size]]  # fmt: skip
        ids, segments, mask, _ = (t.to(device) for t in padded(encoded, pad))
        yield ids, segments, mask


@torch.no_grad()
def embed_texts(
    model: Encoder, tokenizer: Tokenizer, texts: list[str], pool: str = "mean", batch_size: int = 32
) -> np.ndarray:
    """[N, d] float32: each text's embedding, mean-pooled or at [CLS]."""
    if pool not in POOLS:
        raise UserError(f"pool must be one of {', '.join(POOLS)}; got {pool!r}")
    rows = []
    for ids, segments, mask in _batches(model, tokenizer, texts, batch_size):
        h = model.hidden(ids, segments, mask).float()  # [B,T,d]
        if pool == "cls":
            rows.append(h[:, 0])
        else:
            weights = mask[..., None].float()  # [B,T,1]
            rows.append((h * weights).sum(1) / weights.sum(1))
    return torch.cat(rows).cpu().numpy()


def mean_cosine(vectors: Tensor, texts: Tensor, pairs: int, generator: torch.Generator) -> float:
    """The mean cosine over `pairs` random pairs of rows of `vectors` [M,d] (drawn with
    replacement), of those whose `texts` [M] differ: two words of one text are left out."""
    first = torch.randint(0, len(vectors), (pairs,), generator=generator)
    second = torch.randint(0, len(vectors), (pairs,), generator=generator)
    keep = texts[first] != texts[second]
    a, b = vectors[first[keep]], vectors[second[keep]]
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()


@torch.no_grad()
def anisotropy(
    model: Encoder, tokenizer: Tokenizer, texts: list[str], pairs: int = 2000, seed: int = 0
) -> list[float]:
    """The mean cosine between random words' vectors at each layer: the input, then each
    block's output ([CLS], [SEP] and padding left out)."""
    if len(texts) < 2:
        raise UserError("anisotropy compares words of different texts: give at least two")
    names = ["embed", *(f"blocks.{b}.resid_post" for b in range(model.config.n_layers))]
    layers: list[list[Tensor]] = [[] for _ in names]
    owners = []
    n = 0
    for ids, segments, mask in _batches(model, tokenizer, texts, 32):
        _, cache = run_with_cache(model, ids, names, segments=segments, attention_mask=mask)
        words = mask.bool() & (ids != tokenizer.special_id("[CLS]"))
        words &= ids != tokenizer.special_id("[SEP]")  # [B,T]
        for k, name in enumerate(names):
            layers[k].append(cache[name][words].float().cpu())
        owners.append(
            (torch.arange(len(ids), device=ids.device)[:, None] + n).expand_as(ids)[words].cpu()
        )
        n += len(ids)
    texts_of = torch.cat(owners)
    generator = torch.Generator().manual_seed(seed)
    return [mean_cosine(torch.cat(v), texts_of, pairs, generator) for v in layers]
