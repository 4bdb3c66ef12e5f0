"""Preference pairs for DPO (J&M ch. 12): a prompt, the answer preferred and the one rejected.

`prepare_preference` reads TRL's preference format from JSONL files (one pair a line) or
Parquet and Arrow files (one a row): `prompt` (a list of messages ending with the user's
turn, or a string: the user's message) with `chosen` and `rejected` (each the assistant's
answer: a string, or messages, as TRL writes it). Each pair is rendered twice with the chat
template (`tlm/chat.py: render`), the prompt followed by each answer, and only the answer's
tokens (its content and `<|end|>`) are learned. The first pair that breaks a rule stops
everything with one line naming its file, line (or row) and rule; nothing is written.

The folder is a `ChatData` folder whose sequences come in twos: sequence 2i is pair i's
chosen answer, 2i + 1 its rejected one (`OUT/{split}.bin`, `.mask`, `.idx`, `meta.json`
with "task": "preference" and the count of pairs). `tokens.PreferenceData` reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tlm.chat import ChatError, check, render
from tlm.data.arithmetic import arithmetic_pairs
from tlm.data.chat import (
    checked_as,
    file_records,
    gather,
    start_folder,
    template_tokenizer,
    write_folder,
    write_sequences,
)
from tlm.tokenizer import Tokenizer

FIELDS = ("prompt", "chosen", "rejected")
BUILTIN_PAIRS = {"arithmetic": arithmetic_pairs}

Pair = tuple[str, list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]


def as_pair(record: Any) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) of one record as checked messages, or a ChatError naming
    the rule it breaks."""
    if not isinstance(record, dict):
        raise ChatError("a preference pair is an object with prompt, chosen and rejected")
    missing = [name for name in FIELDS if name not in record]
    if missing:
        raise ChatError(f"no {missing[0]} (a pair has prompt, chosen and rejected)")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    prompt = check(prompt, generation=True)
    answers = []
    for name in ("chosen", "rejected"):
        answer = record[name]
        if isinstance(answer, str):
            answer = [{"role": "assistant", "content": answer}]
        one_turn = isinstance(answer, list) and len(answer) == 1 and isinstance(answer[0], dict)
        if not one_turn or answer[0].get("role") != "assistant":
            raise ChatError(f"{name} is not one assistant turn (a string, or one message)")
        answers.append(check([*prompt, *answer])[len(prompt) :])
    if answers[0] == answers[1]:
        raise ChatError("chosen and rejected are the same answer: nothing to prefer")
    return prompt, answers[0], answers[1]


def read_pairs(path: Path) -> Iterator[Pair]:
    """The checked pairs of one file, each with where it was read ("file:line")."""
    for where, record in file_records(path, FIELDS):
        yield _checked(record, where)


def _checked(record: Any, where: str) -> Pair:
    return checked_as(as_pair, record, where)


def rendered(prompt: list[dict], answer: list[dict], tok: Tokenizer) -> tuple[list[int], list[int]]:
    """(ids, mask) of the prompt followed by one answer: 1 on the answer's learned tokens
    only (an earlier assistant turn of the prompt is context, not learned)."""
    ids, mask = render([*prompt, *answer], tok)
    start = len(render(prompt, tok, generation=True)[0])  # after the answer's <|assistant|>
    return ids, [0] * start + mask[start:]


def prepare_preference(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bpe",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    force: bool = False,
) -> dict[str, Any]:
    """Render the preference pairs of `inputs` into folder `out`; returns its meta.json.
    `tokenizer` is a kind to train on the pairs' text, or a tokenizer to reuse (a run, a
    data folder, a tokenizer.json: the run DPO starts from); either way the chat template's
    special tokens are added to it."""
    out = start_folder(out, force)
    train, val, sources = gather(inputs, BUILTIN_PAIRS, read_pairs, val_fraction, _checked)
    texts = (m["content"] for pair in train for part in pair[1:] for m in part)
    tok = template_tokenizer(tokenizer, texts, vocab_size)

    def write_splits(folder: Path) -> dict[str, Any]:
        return {
            split: _write_split(folder, split, part, tok)
            for split, part in (("train", train), ("val", val))
        }

    return write_folder(out, "preference", tok, write_splits, 2 * (len(train) + len(val)), sources)


def _write_split(folder: Path, split: str, pairs: list[Pair], tok: Tokenizer) -> dict[str, Any]:
    """Render and write one split, chosen then rejected for each pair; its counts."""
    rendering = (
        (where, lambda p=prompt, a=answer: rendered(p, a, tok))
        for where, prompt, chosen, rejected in pairs
        for answer in (chosen, rejected)
    )
    tokens, supervised = write_sequences(folder, split, rendering, tok.vocab_size)
    return {
        "file": f"{split}.bin",
        "pairs": len(pairs),
        "conversations": 2 * len(pairs),
        "tokens": tokens,
        "supervised": supervised,
    }
