"""Conversations for instruction tuning: read, checked, rendered with the chat template, packed.

`prepare_chat` reads JSONL files (one conversation per line) and Parquet or Arrow files (one
per row), in either shape the field uses: `{"messages": [{"role", "content"}, ...]}` (OpenAI's
and TRL's) or ShareGPT's `{"conversations": [{"from", "value"}, ...]}` (`human`, `gpt`,
`system`). Each conversation passes `chat.check` (`tlm/chat.py`); the first that breaks a
rule stops everything with one line naming its file, line (or row) and rule, and nothing is
written. Conversations are rendered by `chat.render` and written back to back, per split:

    OUT/{split}.bin    the rendered ids, uint16 when V <= 65535 else uint32 (no padding)
    OUT/{split}.mask   one byte a token: 1 where training learns it (the assistant's turns)
    OUT/{split}.idx    int64 offsets: conversation i is [idx[i], idx[i+1])
    OUT/meta.json      "task": "chat", counts (conversations, tokens, supervised), sources

The validation split is the last `val_fraction` of the conversations, or the built-in
`python-qa`'s own held-out split. `tokens.ChatData` reads the folder; packing into windows
happens when training or evaluation reads it (`packing.py`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tlm._version import __version__
from tlm.chat import ChatError, chat_tokenizer, check, render
from tlm.data.arithmetic import arithmetic_chat
from tlm.data.columnar import COLUMNAR, column_values
from tlm.data.corpus import CorpusError
from tlm.data.python_qa import python_qa
from tlm.data.tokens import id_dtype
from tlm.io import atomic_path, check_replaceable, write_text_atomic
from tlm.tokenizer import KINDS, Tokenizer, TokenizerError, load_tokenizer, train_tokenizer

FILES = ("meta.json", "tokenizer.json", "*.bin", "*.mask", "*.idx")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
BUILTIN_CHAT = {"python-qa": python_qa, "arithmetic": arithmetic_chat}

Conversation = tuple[str, list[dict[str, str]]]  # (where it was read, its messages)


def as_messages(record: Any) -> list[Any]:
    """A record's messages in OpenAI's shape: its `messages`, or ShareGPT's `conversations`
    ({from, value} turns) renamed. A record may be the list itself (a columnar row)."""
    if isinstance(record, dict):
        if "messages" in record:
            return record["messages"]
        if "conversations" not in record:
            raise ChatError("no messages (or conversations) list")
        record = record["conversations"]
    if not isinstance(record, list):
        raise ChatError("not a list of messages")
    if not record or not isinstance(record[0], dict) or "from" not in record[0]:
        return record  # OpenAI's shape: chat.check judges it
    messages = []
    for n, turn in enumerate(record, start=1):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise ChatError(f"turn {n} is not an object with a from and a value")
        if turn["from"] not in SHAREGPT_ROLES:
            known = ", ".join(SHAREGPT_ROLES)
            raise ChatError(f"turn {n} has unknown role {turn['from']!r} (from: {known})")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages


def read_conversations(path: Path) -> Iterator[Conversation]:
    """The checked conversations of one file, each with where it was read ("file:line")."""
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    if path.suffix in COLUMNAR:
        rows = column_values(path, str(path), ("messages", "conversations"))
        for row, turns in enumerate(rows, start=1):
            yield _checked(turns, f"{path} row {row}")
        return
    for where, record in jsonl_records(path):
        yield _checked(record, where)


def jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """Each non-empty line of a JSONL file as (where it was read, "file:line"; its value);
    a line that is not JSON, or a file that is not UTF-8, is one line naming it."""
    with open(path, encoding="utf-8") as f:
        try:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CorpusError(f"{path}:{n}: not JSON ({exc.msg})") from None
                yield f"{path}:{n}", record
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{path}: not valid UTF-8 (byte {exc.start})") from None


def file_records(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """Each record of a JSONL file, or each row of a columnar one (Parquet, Arrow) as a
    dict of its `fields`, with where it was read ("file:line", "file row N")."""
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    if path.suffix not in COLUMNAR:
        yield from jsonl_records(path)
        return
    columns = [list(column_values(path, str(path), name)) for name in fields]
    if len({len(column) for column in columns}) > 1:
        raise CorpusError(f"{path}: some rows lack a value of {', '.join(fields)}")
    for row, values in enumerate(zip(*columns, strict=True), start=1):
        yield f"{path} row {row}", dict(zip(fields, values, strict=True))


def checked_as(parse: Callable[[Any], tuple], record: Any, where: str) -> tuple:
    """(where, *parse(record)): a record that breaks a rule is one line naming where."""
    try:
        return (where, *parse(record))
    except ChatError as exc:
        raise CorpusError(f"{where}: {exc}") from None


def _checked(record: Any, where: str) -> Conversation:
    try:
        return where, check(as_messages(record))
    except ChatError as exc:
        raise CorpusError(f"{where}: {exc}") from None


def prepare_chat(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bpe",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    force: bool = False,
) -> dict[str, Any]:
    """Render the conversations of `inputs` (files, or the built-in `python-qa`) into folder
    `out`; returns its meta.json. `tokenizer` is a kind to train on the conversations'
    text, or a tokenizer to reuse (a run, a data folder, a tokenizer.json); either way the
    chat template's special tokens are added to it."""
    out = start_folder(out, force)
    train, val, sources = gather(inputs, BUILTIN_CHAT, read_conversations, val_fraction)
    texts = (m["content"] for _, messages in train for m in messages)
    tok = template_tokenizer(tokenizer, texts, vocab_size)

    def write_splits(folder: Path) -> dict[str, Any]:
        return {
            split: _write_split(folder, split, part, tok)
            for split, part in (("train", train), ("val", val))
        }

    return write_folder(out, "chat", tok, write_splits, len(train) + len(val), sources)


def start_folder(out: str | Path, force: bool, files: tuple[str, ...] = FILES) -> Path:
    """`out` as a folder that may be written: new, or (with `force`) one tlm prepare wrote."""
    out = Path(out)
    if out.exists() and not force:
        raise CorpusError(f"{out} already exists; pass --force to replace it")
    check_replaceable(out, files, "meta.json", "a folder written by tlm prepare")
    return out


def write_folder(
    out: Path, task: str, tok: Tokenizer, write_splits, documents: int, sources
) -> dict[str, Any]:
    """A prepared folder of the chat template's tokens, in one atomic rename: its
    tokenizer.json, the splits `write_splits(folder)` writes (their counts returned) and its
    meta.json (`task`, the tokenizer, the counts, the sources); returns the meta."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        tok.save(tmp / "tokenizer.json")
        meta = {
            "task": task,
            "template": "tlm",
            "tokenizer": tok.kind,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "id_dtype": np.dtype(id_dtype(tok.vocab_size)).name,
            "documents": documents,
            "splits": write_splits(tmp),
            "sources": sources,
            "tlm": __version__,
        }
        write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def gather(inputs: list[str], corpora: dict, read, val_fraction: float, check=None):
    """(train, val, sources): a built-in corpus of `corpora` named alone, with its own
    split (each item passed through `check(item, where)` when given), or the items `read`
    yields from each file, the last `val_fraction` held out."""
    if not inputs:
        raise CorpusError(
            f"give the files to prepare (.jsonl/.parquet/.arrow) or one of {', '.join(corpora)}"
        )
    if any(name in corpora for name in inputs):
        train, val, sources = builtin(inputs, corpora)
        if check is not None:
            train, val = ([check(item, where) for where, item in part] for part in (train, val))
        return train, val, sources
    items, sources = [], []
    for name in inputs:
        items += read(Path(name))
        sources.append(described(name, Path(name).read_bytes()))
    if not items:
        raise CorpusError(f"{', '.join(inputs)}: nothing to prepare")
    cut = held_out(len(items), val_fraction)
    return items[:cut], items[cut:], sources


def builtin(inputs: list[str], corpora: dict) -> tuple[list, list, list[dict[str, Any]]]:
    """(train, val, sources) of a built-in corpus named alone in `inputs`: its own split,
    (where, item) each, and its text described as a source."""
    name = next(name for name in inputs if name in corpora)
    if len(inputs) > 1:
        raise CorpusError(f"{name} is a whole corpus with its own split; give it alone")
    train, val, text = corpora[name]()
    return train, val, [described(name, text.encode())]


def template_tokenizer(tokenizer: str, texts: Iterable[str], vocab_size: int | None) -> Tokenizer:
    """A tokenizer of kind `tokenizer` trained on `texts`, or the one at `tokenizer` (a
    run, a data folder, a tokenizer.json) reused; either way with the chat template's
    special tokens added."""
    if tokenizer in KINDS:
        return chat_tokenizer(train_tokenizer(tokenizer, texts, vocab_size))
    if vocab_size is not None:
        raise CorpusError("--vocab-size trains a new tokenizer; this one is reused as it is")
    return chat_tokenizer(load_tokenizer(tokenizer))


def held_out(count: int, val_fraction: float) -> int:
    """Where the held-out split starts among `count` items: the last `val_fraction` of
    them, at least one when a fraction is asked and there are two or more."""
    if not 0 <= val_fraction < 1:
        raise CorpusError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    cut = count - (round(count * val_fraction) if val_fraction else 0)
    if val_fraction and cut == count and count > 1:
        cut -= 1
    return cut


def _write_split(folder: Path, split: str, conversations: list[Conversation], tok: Tokenizer):
    """Render and write one split, a conversation at a time; returns its counts."""
    rendering = ((where, lambda m=messages: render(m, tok)) for where, messages in conversations)
    tokens, supervised = write_sequences(folder, split, rendering, tok.vocab_size)
    return {
        "file": f"{split}.bin",
        "conversations": len(conversations),
        "tokens": tokens,
        "supervised": supervised,
    }


def write_sequences(
    folder: Path,
    split: str,
    sequences: Iterable[tuple[str, Callable[[], tuple[list[int], list[int]]]]],
    vocab_size: int,
) -> tuple[int, int]:
    """Write rendered sequences back to back as {split}.bin, .mask and .idx: each is (where
    it was read, a call that renders it to (ids, mask)); a rendering that fails stops with
    one line naming where. Returns (tokens, learned tokens)."""
    dtype, tokens, supervised, offsets = id_dtype(vocab_size), 0, 0, [0]
    with (
        open(folder / f"{split}.bin", "wb") as ids_file,
        open(folder / f"{split}.mask", "wb") as mask_file,
    ):
        for where, rendering in sequences:
            try:
                ids, mask = rendering()
            except (ChatError, TokenizerError) as exc:
                raise CorpusError(f"{where}: {exc}") from None
            ids_file.write(np.asarray(ids, dtype=dtype).tobytes())
            mask_file.write(np.asarray(mask, dtype=np.uint8).tobytes())
            tokens, supervised = tokens + len(ids), supervised + sum(mask)
            offsets.append(tokens)
    np.asarray(offsets, dtype=np.int64).tofile(folder / f"{split}.idx")
    return tokens, supervised


def described(name: str, data: bytes) -> dict[str, Any]:
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
