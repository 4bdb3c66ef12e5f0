"""Contextual embeddings (§9.1, §10.2): a word's vector depends on the words around it.

Layer by layer the residual stream at a token mixes in its context, so the same word in
two sentences starts with one vector (the embedding E[w], plus its position) and drifts
apart: "bank" by a river and "bank" that lends money. `word_vectors` reads a word's vector
after the embedding and after every block; `cosine_across_contexts` compares them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tlm.device import placement
from tlm.interpret.hooks import HookError
from tlm.interpret.lens import residual_stream
from tlm.model import TransformerLM
from tlm.tokenizer import Tokenizer, document_ids


def word_position(tokenizer: Tokenizer, text: str, word: str) -> tuple[list[int], int]:
    """The ids of `text` after <|endoftext|>, and the position of the last token of the
    first occurrence of `word` (as the text up to the word's end tokenizes)."""
    at = text.find(word)
    if at < 0:
        raise HookError(f"{word!r} does not occur in {text!r}")
    ids = document_ids(tokenizer, text)
    return ids, len(tokenizer.encode(text[: at + len(word)]))  # eot shifts by one: last token


@torch.no_grad()
def word_vectors(model: TransformerLM, tokenizer: Tokenizer, text: str, word: str) -> Tensor:
    """The stream at `word`'s last token in `text`: [L+1, d] (after embed, after each block)."""
    ids, position = word_position(tokenizer, text, word)
    device = placement(model)[0]
    _, stream = residual_stream(model, torch.tensor([ids], device=device))
    return stream[:, position]


def cosine_across_contexts(
    model: TransformerLM, tokenizer: Tokenizer, word: str, contexts: list[str]
) -> Tensor:
    """Cosine similarity of `word`'s vectors in each pair of contexts: [L+1, n, n]."""
    vectors = torch.stack([word_vectors(model, tokenizer, c, word) for c in contexts], dim=1)
    unit = torch.nn.functional.normalize(vectors.float(), dim=-1)  # [L+1, n, d]
    return unit @ unit.transpose(1, 2)
