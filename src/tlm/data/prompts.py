"""Prompts with answers a verifier checks: what RL on verifiable rewards samples from (J&M ch. 12).

`prepare_prompts` reads JSONL files (one record a line) and Parquet or Arrow files (one a
row) of `{prompt, answer}`: `prompt` the user's message as a string, or messages ending with
the user's turn; `answer` what the verifier compares a reply with (a number, a pattern, a
JSON schema: any JSON value). Each prompt is rendered with the chat template up to the
assistant's marker (`chat.render(..., generation=True)`), the ids a reply is sampled after.
The first record that breaks a rule stops everything with one line naming its file, line
(or row) and rule; nothing is written.

The folder is a `ChatData` folder of prompts (`OUT/{split}.bin`, `.mask` all 0s, `.idx`)
with each prompt's answer as one JSON value a line in `OUT/{split}.answers.jsonl`;
meta.json says "task": "prompts" and the count of prompts. `tokens.PromptData` reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tlm.chat import ChatError, check, render
from tlm.data.arithmetic import arithmetic_prompts
from tlm.data.chat import (
    FILES,
    checked_as,
    file_records,
    gather,
    start_folder,
    template_tokenizer,
    write_folder,
    write_sequences,
)

Record = tuple[str, list[dict[str, str]], Any]  # (where it was read, the prompt, the answer)
BUILTIN_PROMPTS = {"arithmetic": arithmetic_prompts}


def as_prompt(record: Any) -> tuple[list[dict[str, str]], Any]:
    """(prompt messages, answer) of one record, or a ChatError naming the rule it breaks."""
    if not isinstance(record, dict) or "prompt" not in record or "answer" not in record:
        raise ChatError("a record is an object with a prompt and an answer")
    prompt, answer = record["prompt"], record["answer"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if answer is None or answer == "":
        raise ChatError("the answer is empty: nothing to verify a reply against")
    return check(prompt, generation=True), answer


def read_prompts(path: Path) -> Iterator[Record]:
    """The checked records of one file, each with where it was read ("file:line")."""
    for where, record in file_records(path, ("prompt", "answer")):
        yield _checked(record, where)


def _checked(record: Any, where: str) -> Record:
    return checked_as(as_prompt, record, where)


def prepare_prompts(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bpe",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    force: bool = False,
) -> dict[str, Any]:
    """Render the prompts of `inputs` into folder `out`, their answers beside them; returns
    its meta.json. `tokenizer` is a run's to reuse (the run RL starts from), or a kind to
    train on the prompts' text; either way with the chat template's tokens."""
    out = start_folder(out, force, (*FILES, "*.answers.jsonl"))
    train, val, sources = gather(inputs, BUILTIN_PROMPTS, read_prompts, val_fraction, _checked)
    texts = (m["content"] for _, messages, _ in train for m in messages)
    tok = template_tokenizer(tokenizer, texts, vocab_size)

    def write_splits(folder: Path) -> dict[str, Any]:
        splits = {}
        for split, part in (("train", train), ("val", val)):
            rendering = (
                (where, lambda m=messages: _prompt_ids(m, tok)) for where, messages, _ in part
            )
            tokens, _ = write_sequences(folder, split, rendering, tok.vocab_size)
            answers = "".join(json.dumps(answer) + "\n" for _, _, answer in part)
            (folder / f"{split}.answers.jsonl").write_text(answers, encoding="utf-8")
            splits[split] = {"file": f"{split}.bin", "prompts": len(part), "tokens": tokens}
            splits[split] |= {"conversations": len(part), "supervised": 0}
        return splits

    return write_folder(out, "prompts", tok, write_splits, len(train) + len(val), sources)


def _prompt_ids(messages: list[dict[str, str]], tok) -> tuple[list[int], list[int]]:
    """The prompt's ids up to the assistant's marker, nothing learned."""
    ids, _ = render(messages, tok, generation=True)
    return ids, [0] * len(ids)
