"""A fine-tuned encoder at work (J&M §11.4): a classifier's label for a text, a tagger's tag
for each word, and either scored on labeled examples (accuracy and F1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlm.data.labeled import Example, encode_example
from tlm.device import placement
from tlm.errors import UserError
from tlm.evaluate import labeled_scores, padded
from tlm.model import Encoder
from tlm.tokenizer import Tokenizer


def _check(model: Encoder, task: str) -> None:
    if model.config.task != task:
        has = model.config.task or "a masked-LM head (tlm fill-mask)"
        raise UserError(f"this run is not fine-tuned to {task}: it has {has}")


@dataclass(frozen=True)
class Classified:
    """A classifier's answer: the most probable label and every label's probability."""

    label: str
    probabilities: dict[str, float]


@torch.no_grad()
def classify_text(
    model: Encoder, tokenizer: Tokenizer, text: str, second: str | None = None
) -> Classified:
    """The label of `text` (or of the pair `text`, `second`) by the classifier's head."""
    _check(model, "classify")
    example = Example("text", text, second, 0)
    encoded = encode_example(example, tokenizer, "classify", model.config.context_length)
    ids, segments, mask, _ = (t.to(placement(model)[0]) for t in padded([encoded], 0))
    p = torch.softmax(model(ids, segments, mask)[0].float(), -1).tolist()
    names = model.config.labels
    return Classified(
        names[max(range(len(p)), key=p.__getitem__)], dict(zip(names, p, strict=True))
    )


@torch.no_grad()
def tag_words(model: Encoder, tokenizer: Tokenizer, words: list[str]) -> list[tuple[str, str]]:
    """(word, tag) for each word, the tag read at the word's first token (a word past the
    context the model reads is tagged O)."""
    _check(model, "tag")
    if not words:
        raise UserError("there is no word to tag")
    example = Example("text", tuple(words), None, (0,) * len(words))
    encoded = encode_example(example, tokenizer, "tag", model.config.context_length)
    ids, segments, mask, labels = (t.to(placement(model)[0]) for t in padded([encoded], 0))
    best = model(ids, segments, mask)[0].argmax(-1)[labels[0] >= 0].tolist()
    tags = [model.config.labels[t] for t in best] + ["O"] * (len(words) - len(best))
    return list(zip(words, tags, strict=True))


def evaluate_labeled(model: Encoder, tokenizer: Tokenizer, examples: list[Example]) -> dict:
    """{accuracy, f1, n} of a fine-tuned run on labeled examples (`labeled_examples`)."""
    if model.config.task is None:
        raise UserError("this encoder has a masked-LM head; tlm eval --data FILE scores a task run")
    T, task = model.config.context_length, model.config.task
    encoded = [encode_example(e, tokenizer, task, T) for e in examples]
    pad = tokenizer.special_id("[PAD]")
    scores = labeled_scores(model, encoded, task, model.config.labels, pad, placement(model)[0])
    return {**scores, "n": len(examples)}
