"""Decoding (J&M §10.8): pure functions on logits, and the sampling loop.

The model never sees text: `generate` takes token ids and yields token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from tlm.tokenizer import TextStream, Tokenizer


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """y = softmax(u / τ) (eq. 10.49): τ < 1 sharpens, τ > 1 flattens; τ = 0 is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(-1, top, 0.0)
    return logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row; the rest become -inf."""
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {k}")
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """logits [B, V] -> next token ids [B]: temperature, then top-k, then a draw."""
    logits = apply_temperature(logits.float(), temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_token_id: int | None = None,
) -> Iterator[Tensor]:
    """Yield the next token ids [B] one step at a time (a full forward per step, no cache)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    generator = torch.Generator(device=input_ids.device)
    generator.manual_seed(seed if seed is not None else torch.seed())
    ids = input_ids
    N = model.config.context_length
    for _ in range(max_new_tokens):
        logits = model(ids[:, -N:])[:, -1]  # the last position predicts the next token
        next_ids = sample_next(logits, temperature, top_k, generator)
        yield next_ids
        ids = torch.cat([ids, next_ids.unsqueeze(-1)], dim=1)
        if eos_token_id is not None and bool((next_ids == eos_token_id).all()):
            return


def complete(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    on_truncate: Callable[[int, int], None] | None = None,
) -> Iterator[str]:
    """Continue `prompt` (after <|endoftext|>, as documents start in training); yield text.

    A prompt longer than the context keeps its last tokens; `on_truncate(n, kept)` is told.
    Generation stops early at <|endoftext|>.
    """
    ids = [tokenizer.eot_id, *tokenizer.encode(prompt)]
    N = model.config.context_length
    if len(ids) > N:
        if on_truncate is not None:
            on_truncate(len(ids), N)
        ids = ids[-N:]
    device = next(model.parameters()).device
    stream = TextStream(tokenizer)
    tokens = generate(
        model,
        torch.tensor([ids], device=device),
        max_new_tokens,
        temperature,
        top_k,
        seed,
        eos_token_id=tokenizer.eot_id,
    )
    for next_ids in tokens:
        if next_ids.item() == tokenizer.eot_id:
            break
        yield stream.push(next_ids.tolist())
    yield stream.flush()
