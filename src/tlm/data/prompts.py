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

import numpy as np

from tlm._version import __version__
from tlm.chat import ChatError, check, render
from tlm.data.arithmetic import arithmetic_prompts
from tlm.data.chat import (
    FILES,
    builtin,
    described,
    held_out,
    jsonl_records,
    template_tokenizer,
    write_sequences,
)
from tlm.data.columnar import COLUMNAR, column_values
from tlm.data.corpus import CorpusError
from tlm.data.tokens import id_dtype
from tlm.io import atomic_path, check_replaceable, write_text_atomic

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
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    if path.suffix in COLUMNAR:
        columns = [list(column_values(path, str(path), name)) for name in ("prompt", "answer")]
        if len(columns[0]) != len(columns[1]):
            raise CorpusError(f"{path}: some rows lack a prompt or an answer")
        records = (
            (f"{path} row {row}", {"prompt": p, "answer": a})
            for row, (p, a) in enumerate(zip(*columns, strict=True), start=1)
        )
    else:
        records = jsonl_records(path)
    for where, record in records:
        try:
            yield (where, *as_prompt(record))
        except ChatError as exc:
            raise CorpusError(f"{where}: {exc}") from None


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
    out = Path(out)
    if out.exists() and not force:
        raise CorpusError(f"{out} already exists; pass --force to replace it")
    check_replaceable(
        out, (*FILES, "*.answers.jsonl"), "meta.json", "a folder written by tlm prepare"
    )
    if not inputs:
        raise CorpusError("give the prompts to prepare: .jsonl/.parquet/.arrow files")
    if inputs[0] in BUILTIN_PROMPTS:  # a whole corpus with its own held-out split
        train, val, sources = builtin(inputs, BUILTIN_PROMPTS)
        records, cut = [], len(train)
        for where, record in train + val:
            try:
                records.append((where, *as_prompt(record)))
            except ChatError as exc:
                raise CorpusError(f"{where}: {exc}") from None
    else:
        records, sources = [], []
        for name in inputs:
            records += read_prompts(Path(name))
            sources.append(described(name, Path(name).read_bytes()))
        if not records:
            raise CorpusError(f"{', '.join(inputs)}: no prompts")
        cut = held_out(len(records), val_fraction)
    texts = (m["content"] for _, messages, _ in records[:cut] for m in messages)
    tok = template_tokenizer(tokenizer, texts, vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        tok.save(tmp / "tokenizer.json")
        splits = {}
        for split, part in (("train", records[:cut]), ("val", records[cut:])):
            rendering = (
                (where, lambda m=messages: _prompt_ids(m, tok)) for where, messages, _ in part
            )
            tokens, _ = write_sequences(tmp, split, rendering, tok.vocab_size)
            answers = "".join(json.dumps(answer) + "\n" for _, _, answer in part)
            (tmp / f"{split}.answers.jsonl").write_text(answers, encoding="utf-8")
            splits[split] = {"file": f"{split}.bin", "prompts": len(part), "tokens": tokens}
            splits[split] |= {"conversations": len(part), "supervised": 0}
        meta = {
            "task": "prompts",
            "template": "tlm",
            "tokenizer": tok.kind,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "id_dtype": np.dtype(id_dtype(tok.vocab_size)).name,
            "documents": len(records),
            "splits": splits,
            "sources": sources,
            "tlm": __version__,
        }
        write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def _prompt_ids(messages: list[dict[str, str]], tok) -> tuple[list[int], list[int]]:
    """The prompt's ids up to the assistant's marker, nothing learned."""
    ids, _ = render(messages, tok, generation=True)
    return ids, [0] * len(ids)
