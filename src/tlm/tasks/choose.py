"""Tasks as word prediction (§10.7): classification by label probability, multiple choice.

Each option is a continuation of the context; the model's choice is the likeliest one,
ranked three ways, as lm-evaluation-harness reports them:

    acc             by the sum of the option's token log-probabilities
    acc_per_token   by that sum divided by the option's tokens
    acc_norm        by that sum divided by the option's UTF-8 bytes (long options are not
                    penalised for being long)

Accuracies come with a standard error, sqrt(p(1 − p) / (n − 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tlm.model import TransformerLM
from tlm.tasks.score import Scored, TaskError, encode_pair, score
from tlm.tokenizer import Tokenizer

NORMS = {  # metric name -> how an option is ranked
    "acc": lambda s: s.logprob,
    "acc_per_token": lambda s: s.logprob / len(s.tokens),
    "acc_norm": lambda s: s.logprob / max(1, s.bytes),
}


def best(options: list[Scored]) -> dict[str, int]:
    """The index of the chosen option under each ranking."""
    return {
        name: max(range(len(options)), key=lambda i: rank(options[i]))
        for name, rank in NORMS.items()
    }


def accuracy(correct: list[bool]) -> tuple[float, float]:
    """(mean, standard error of the mean) of a list of right/wrong answers."""
    n = len(correct)
    p = sum(correct) / n
    return p, math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


@dataclass
class Classified:
    text: str
    label: str  # chosen by the sum of log-probabilities (acc)
    label_norm: str  # chosen per byte (acc_norm)
    probabilities: dict[str, float]  # softmax of the labels' summed log-probabilities
    options: list[Scored]


def check_labels(tokenizer: Tokenizer, labels: list[str], template: str) -> None:
    if "{text}" not in template:
        raise TaskError("the template has no {text} for the input to go into")
    if len(labels) < 2:
        raise TaskError(f"give at least two labels, got {labels!r}")
    seen: dict[tuple[int, ...], str] = {}
    after = template.rsplit("{text}", 1)[1]  # what a label follows: the template's end
    for label in labels:
        ids = tuple(encode_pair(tokenizer, after, " " + label)[1]) if label.strip() else ()
        if not ids:
            raise TaskError(f"label {label!r} tokenizes to nothing")
        if ids in seen:
            raise TaskError(f"labels {seen[ids]!r} and {label!r} tokenize to the same tokens")
        seen[ids] = label


@torch.no_grad()
def classify(
    model: TransformerLM, tokenizer: Tokenizer, texts: list[str], labels: list[str], template: str
) -> list[Classified]:
    """Each text put into `template` ("{text}" is replaced); each label, after a space, is a
    continuation; the likeliest label wins (§10.7: P(positive | ...) vs P(negative | ...))."""
    check_labels(tokenizer, labels, template)
    out = []
    for text in texts:
        context = template.replace("{text}", text)
        options = score(model, tokenizer, context, [" " + label for label in labels])
        chosen = best(options)
        probs = torch.tensor([o.logprob for o in options]).softmax(dim=0).tolist()
        out.append(
            Classified(
                text,
                labels[chosen["acc"]],
                labels[chosen["acc_norm"]],
                dict(zip(labels, probs, strict=True)),
                options,
            )
        )
    return out


def confusion_matrix(gold: list[str], predicted: list[str], labels: list[str]) -> list[list[int]]:
    """matrix[i][j]: inputs whose gold label is labels[i] and which were classified labels[j]."""
    index = {label: i for i, label in enumerate(labels)}
    matrix = [[0] * len(labels) for _ in labels]
    for g, p in zip(gold, predicted, strict=True):
        if g not in index:
            raise TaskError(f"gold label {g!r} is not one of the labels {', '.join(labels)}")
        matrix[index[g]][index[p]] += 1
    return matrix


@torch.no_grad()
def multiple_choice(
    model: TransformerLM, tokenizer: Tokenizer, items: list[dict]
) -> dict[str, object]:
    """Items {"context", "choices", "gold"} -> acc, acc_per_token, acc_norm (each with its
    standard error) and the choices made. A choice is appended to the context as written."""
    picks = [best(score(model, tokenizer, it["context"], it["choices"])) for it in items]
    results: dict[str, object] = {"n": len(items)}
    for name in NORMS:
        mean, stderr = accuracy([p[name] == it["gold"] for p, it in zip(picks, items, strict=True)])
        results[name], results[f"{name}_stderr"] = mean, stderr
    results["chance"] = sum(1 / len(it["choices"]) for it in items) / len(items)
    results["picks"] = [p["acc"] for p in picks]
    return results
