"""Evaluation: cross-entropy, perplexity and bits per byte of a model on tokens or text.

loss        mean negative log-likelihood per predicted token, in nats (eq. 10.51)
perplexity  exp(loss)
bits_per_byte  total nats / ln 2 / UTF-8 bytes of the predicted text; tokens that spell no
            bytes (<|endoftext|>) count in neither sum, so tokenizers can be compared

and of a fine-tuned encoder (J&M §11.4) on labeled examples: loss, accuracy and F1 (a
classifier's, or over a tagger's BIO chunks), which training's validation and `tlm eval`
both report (`labeled_scores`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from tlm.data import CorpusError, count_eval_chunks, eval_windows, strided_windows
from tlm.data.labeled import IGNORED, Encoded
from tlm.model.loss import window_nll
from tlm.tokenizer import Tokenizer, document_ids


def evaluate_tokens(
    model: nn.Module,
    tokens: np.ndarray,
    token_bytes: np.ndarray,
    batch_size: int = 32,
    max_tokens: int | None = None,
    progress: bool = False,
    stride: int | None = None,
) -> dict[str, float]:
    """Score every token of `tokens` after the first: in non-overlapping context windows, or
    with `stride` S in rolling windows that give each token at least T − S tokens of context
    (S is capped at the context length T; `data.strided_windows`)."""
    nll_sum, byte_nll_sum, n_tokens, n_bytes = 0.0, 0.0, 0, 0
    for nll, targets in _scored(model, tokens, batch_size, max_tokens, progress, stride):
        spelled = torch.from_numpy(token_bytes[targets])  # bytes of each target
        nll_sum += nll.sum().item()
        n_tokens += nll.numel()
        byte_nll_sum += nll[spelled > 0].sum().item()
        n_bytes += int(spelled.sum())
    loss = nll_sum / n_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": byte_nll_sum / math.log(2) / n_bytes if n_bytes else float("nan"),
        "tokens": n_tokens,
        "bytes": n_bytes,
    }


def _scored(model, tokens, batch_size, max_tokens, progress, stride) -> Iterator[tuple]:
    """(nll [n] float64, target ids [n]) for every scored token, chunk by chunk."""
    T = model.config.context_length
    if stride is not None and stride < T:
        yield from _strided(model, tokens, T, stride, batch_size, progress)
        return
    scored = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    chunks = tqdm(
        eval_windows(tokens, T, max_tokens),
        total=count_eval_chunks(scored, T),
        desc="evaluating",
        disable=not progress,
        leave=False,
    )
    for windows in chunks:
        nll = window_nll(model, windows, batch_size).double()  # [N, T]
        yield nll.flatten(), windows[:, 1:].flatten().numpy()


def _strided(model, tokens, T, stride, batch_size, progress) -> Iterator[tuple]:
    windows = strided_windows(len(tokens), T, stride)
    bar = tqdm(total=len(windows), desc="evaluating", disable=not progress, leave=False)
    for first in range(0, len(windows), batch_size):
        group = windows[first : first + batch_size]
        for length in sorted({w[1] for w in group}):  # the last window may be shorter
            same = [w for w in group if w[1] == length]
            batch = torch.from_numpy(np.stack([tokens[s : s + length] for s, _, _ in same]))
            nll = window_nll(model, batch.long(), batch_size).double()  # [n, length - 1]
            for row, (start, _, offset) in enumerate(same):
                targets = np.asarray(tokens[start + 1 + offset : start + length])
                yield nll[row, offset:], targets.astype(np.int64)
        bar.update(len(group))
    bar.close()


def evaluate_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    text: str | list[str],
    batch_size: int = 32,
    progress: bool = False,
    stride: int | None = None,
) -> dict[str, float]:
    """Score raw text, one document or several: each document follows <|endoftext|>, as
    `prepare` separates them, so every token of every document is predicted (and so is the
    end of each document but the last). Documents are encoded one by one, as `prepare` does."""
    documents = [text] if isinstance(text, str) else text
    ids = [i for doc in documents for i in document_ids(tokenizer, doc)]
    tokens = np.array(ids, dtype=np.int64)
    if len(tokens) - len(documents) < 2:
        n = len(tokens) - len(documents)
        raise CorpusError(f"the text has {n} token{'s' * (n != 1)}; at least 2 are needed")
    token_bytes = tokenizer.token_bytes()
    return evaluate_tokens(model, tokens, token_bytes, batch_size, None, progress, stride)


def accuracy_f1(gold: list[int], predicted: list[int], n_labels: int) -> dict[str, float]:
    """A classifier's accuracy and F1: the positive class's (label 1) with two labels, as
    scikit-learn's `f1_score` does by default; else the mean of each label's (macro)."""
    right = sum(g == p for g, p in zip(gold, predicted, strict=True))
    scores = []
    for label in range(1, 2) if n_labels == 2 else range(n_labels):
        tp = sum(g == p == label for g, p in zip(gold, predicted, strict=True))
        wanted, said = gold.count(label), predicted.count(label)
        scores.append(2 * tp / (wanted + said) if wanted + said else 0.0)
    return {"accuracy": right / max(1, len(gold)), "f1": sum(scores) / len(scores)}


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """The chunks of a BIO-tagged sequence as (type, first, last), as conlleval (and
    seqeval's default mode) reads them: a chunk starts at B-X, or at I-X after anything but
    a chunk of type X, and runs while I-X follows."""
    found, start, kind = set(), None, None
    for i, tag in enumerate([*tags, "O"]):
        prefix, _, name = tag.partition("-")
        continues = prefix == "I" and kind == name
        if start is not None and not continues:  # the open chunk ends before i
            found.add((kind, start, i - 1))
            start, kind = None, None
        if prefix in ("B", "I") and not continues:
            start, kind = i, name
    return found


def entity_f1(gold: list[list[str]], predicted: list[list[str]]) -> dict[str, float]:
    """A tagger's accuracy (per word) and F1 over chunks (micro: every chunk of every type
    counted once; seqeval's `f1_score`): a predicted chunk is right when its type and both
    ends are."""
    right = total = hits = wanted = said = 0
    for g, p in zip(gold, predicted, strict=True):
        right, total = right + sum(a == b for a, b in zip(g, p, strict=True)), total + len(g)
        true, guess = entities(g), entities(p)
        hits, wanted, said = hits + len(true & guess), wanted + len(true), said + len(guess)
    f1 = 2 * hits / (wanted + said) if wanted + said else 0.0
    return {"accuracy": right / max(1, total), "f1": f1}


def padded(batch: list[Encoded], pad: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(ids, segments, attention_mask, labels) of encoded examples, right-padded with `pad`
    to the longest: labels [B] of a classifier's, [B,T] of a tagger's (IGNORED on padding)."""
    T = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), T), pad)
    segments, mask = torch.zeros(len(batch), T, dtype=torch.long), torch.zeros(len(batch), T)
    tags = torch.full((len(batch), T), IGNORED)
    for i, e in enumerate(batch):
        n = len(e.ids)
        ids[i, :n], segments[i, :n], mask[i, :n] = torch.tensor(e.ids), torch.tensor(e.segments), 1
        if isinstance(e.label, list):
            tags[i, :n] = torch.tensor(e.label)
    labels = tags if isinstance(batch[0].label, list) else torch.tensor([e.label for e in batch])
    return ids, segments, mask.long(), labels


def task_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """The mean cross-entropy of the scored labels: [B,n] against [B], or [B,T,n] against
    [B,T] (IGNORED positions left out)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORED)


def predictions(logits: Tensor, labels: Tensor) -> list:
    """The most probable label of each example (a tagger's: of each word, at its first
    token, where `labels` is not IGNORED)."""
    best = logits.argmax(-1)  # [B] or [B,T]
    if best.dim() == 1:
        return best.tolist()
    return [row[gold != IGNORED].tolist() for row, gold in zip(best, labels, strict=True)]


def labeled_scores(
    model, examples: list[Encoded], task: str, names: tuple[str, ...], pad: int, device
) -> dict:
    """{loss, accuracy, f1} of a fine-tuned encoder on encoded examples of `task`, whose
    labels are `names`: one pass, in batches of examples of similar length (sorted, so
    little of each batch is padding)."""
    examples = sorted(examples, key=lambda e: len(e.ids))
    guesses, total, scored = [], 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), 32):
            ids, segments, mask, labels = (t.to(device) for t in padded(examples[i : i + 32], pad))
            logits = model(ids, segments, mask)
            n = int((labels != IGNORED).sum())
            total, scored = total + task_loss(logits, labels).item() * n, scored + n
            guesses += predictions(logits, labels)
    loss = {"loss": total / max(scored, 1)}
    if task == "classify":
        return loss | accuracy_f1([e.label for e in examples], guesses, len(names))
    gold = [[names[t] for t in e.label if t != IGNORED] for e in examples]
    return loss | entity_f1(gold, [[names[t] for t in row] for row in guesses])
