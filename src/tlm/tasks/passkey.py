"""Passkey retrieval (Mohtashami & Jaggi 2023): a number hidden at a chosen depth of filler
text, asked for at the end. A model that reads its whole context finds it at any length
and depth; one whose positions past its trained context mean nothing, or that cannot see
that far, does not.

The prompt is the filler line repeated, the needle ("The pass key is 48213. Remember it.
48213 is the pass key.") after `depth` of the filler lines (0: first, 1: last), then the
question "What is the pass key? The pass key is"; the answer is " 48213". A prompt is
scored in one forward pass over prompt and answer: it is retrieved when the model's
likeliest token at every answer position is the answer's (what greedy decoding would
write).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from tlm.device import placement
from tlm.tokenizer import Tokenizer

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"


@dataclass
class Passkey:
    ids: list[int]  # the prompt's tokens
    answer: list[int]  # the key's, " 48213"
    key: str
    needle_at: int  # the needle's first token


def passkey_text(key: str, before: int, after: int) -> tuple[str, str]:
    """(prompt, answer) with `before` filler lines above the needle and `after` below."""
    return FILLER * before + NEEDLE.format(key=key) + FILLER * after + QUESTION, f" {key}"


def passkey_prompt(tokenizer: Tokenizer, length: int, depth: float, key: str) -> Passkey:
    """The longest passkey prompt whose tokens and answer fit in `length`, the needle after
    `depth` (0…1) of its filler lines."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    filler, needle = tokenizer.encode(FILLER), tokenizer.encode(NEEDLE.format(key=key))
    question, answer = tokenizer.encode(QUESTION), tokenizer.encode(f" {key}")
    lines = (length - len(needle) - len(question) - len(answer)) // len(filler)
    if lines < 0:
        raise ValueError(f"a passkey prompt needs more than {length} tokens")
    before = round(depth * lines)
    ids = filler * before + needle + filler * (lines - before) + question
    return Passkey(ids, answer, key, len(filler) * before)


def random_key(rng: random.Random) -> str:
    return str(rng.randrange(10_000, 100_000))


def passkey_documents(
    count: int, most_lines: int, seed: int = 0, least_lines: int = 0
) -> list[str]:
    """`count` training texts: prompt and answer, `least_lines`…`most_lines` filler lines,
    the needle at a random depth, a random 5-digit key."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        lines = rng.randint(least_lines, most_lines)
        before = rng.randint(0, lines)
        prompt, answer = passkey_text(random_key(rng), before, lines - before)
        texts.append(prompt + answer + ".")
    return texts


@torch.no_grad()
def passkey_accuracy(
    model: nn.Module,
    tokenizer: Tokenizer,
    length: int,
    depth: float,
    trials: int = 10,
    seed: int = 0,
) -> float:
    """The share of `trials` prompts of at most `length` tokens, needle at `depth`, whose
    key the model retrieves (module doc)."""
    rng, device = random.Random(seed), placement(model)[0]
    found = 0
    for _ in range(trials):
        task = passkey_prompt(tokenizer, length, depth, random_key(rng))
        ids = torch.tensor([task.ids + task.answer], device=device)
        likeliest = model(ids)[0].argmax(dim=-1).tolist()  # position t predicts token t + 1
        start = len(task.ids) - 1
        found += likeliest[start : start + len(task.answer)] == task.answer
    return found / trials
