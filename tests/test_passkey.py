"""Passkey retrieval (tlm/tasks/passkey.py): prompts of the asked length and depth, and an
accuracy that tells a model that reads its whole context from one that sees a window."""

import pytest
import torch
from torch import nn

from tlm.generate.drafts import prompt_lookup
from tlm.tasks.passkey import (
    FILLER,
    passkey_accuracy,
    passkey_documents,
    passkey_prompt,
)
from tlm.tokenizer import CharTokenizer

CHARS = CharTokenizer(sorted(set(FILLER + "What is the pass key? Remember it.0123456789")))


class Copier(nn.Module):
    """Predicts, at each position, the token that followed the latest earlier occurrence of
    the longest of its last 16 tokens that occurred before (an induction head that never
    misses), seeing at most `window` tokens."""

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window, self.unused = window, nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        V, row = CHARS.vocab_size, ids[0].tolist()
        logits = torch.zeros(1, len(row), V)
        for t in range(len(row)):
            seen = row[max(0, t + 1 - self.window) if self.window else 0 : t + 1]
            guess = prompt_lookup(seen, 16, 1)
            logits[0, t, guess[0] if guess else 0] = 1.0
        return logits


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_a_prompt_has_the_length_and_depth_asked(depth):
    task = passkey_prompt(CHARS, 600, depth, "48213")
    filler = len(CHARS.encode(FILLER))
    assert 600 - filler < len(task.ids) + len(task.answer) <= 600
    assert CHARS.decode(task.answer) == " 48213"
    text, above = CHARS.decode(task.ids), CHARS.decode(task.ids[: task.needle_at])
    assert text[len(above) :].startswith("The pass key is 48213. Remember it.")
    assert above.count(FILLER) == round(depth * text.count(FILLER)) and text.count(FILLER) == 5
    with pytest.raises(ValueError, match="needs more than 40 tokens"):
        passkey_prompt(CHARS, 40, depth, "48213")


def test_accuracy_tells_a_whole_context_from_a_window():
    assert passkey_accuracy(Copier(), CHARS, 500, 0.0, trials=3) == 1.0
    assert passkey_accuracy(Copier(window=150), CHARS, 500, 0.0, trials=3) == 0.0  # too far
    assert passkey_accuracy(Copier(window=150), CHARS, 500, 1.0, trials=3) == 1.0  # near


def test_training_documents_vary_the_depth_and_key():
    texts = passkey_documents(50, 3, seed=1)
    assert len(set(texts)) == 50 and all(t.endswith(".") for t in texts)
    assert {t.count(FILLER) for t in texts} == {0, 1, 2, 3}
    assert passkey_documents(5, 3, seed=1) == texts[:5]
    longer = passkey_documents(50, 6, seed=1, least_lines=4)  # a fine-tune's far needles
    assert {t.count(FILLER) for t in longer} == {4, 5, 6}
