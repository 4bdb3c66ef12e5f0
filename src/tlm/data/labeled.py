"""Labeled examples for fine-tuning an encoder (J&M §11.4): sentences with a class, or
words with a tag each.

    classify   {"text": ..., "label": ...}, or {"text_a": ..., "text_b": ..., "label": ...}
               for a pair of sentences (what BERT's segments tell apart)
    tag        {"tokens": [word, ...], "tags": [tag, ...]}, BIO tags (B-X, I-X, O)

read from JSONL or Parquet. `--data` names one file, of which a tenth (chosen by each
example's hash, so the same examples whatever their order) is held out, a folder with
`train.jsonl` and `val.jsonl` (or `.parquet`), or a built-in set made from the standard
library (`stdlib-family` to classify, `stdlib-identifiers` to tag: `data/stdlib_labels.py`).
Labels are strings (a number label is its text); a classifier's are sorted, a tagger's with
`O` first. A record that breaks a rule is one line naming its file and line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tlm.data.chat import described, file_records
from tlm.data.corpus import CorpusError
from tlm.data.stdlib_labels import BUILTIN, builtin_labeled
from tlm.tokenizer import TokenizerError

TASKS = ("classify", "tag")
FIELDS = {"classify": ("text", "text_a", "text_b", "label"), "tag": ("tokens", "tags")}
SPLIT_FILES = ("train", "val")


@dataclass(frozen=True)
class Example:
    """One labeled example: a text (and a second one, for a pair) and its label's index,
    or a tagger's words and their tags' indices."""

    where: str  # "file:line", for messages
    first: str | tuple[str, ...]
    second: str | None
    label: int | tuple[int, ...]


@dataclass(frozen=True)
class LabeledData:
    """A task's examples, split, with the label names in the order of the head's outputs."""

    task: str
    labels: tuple[str, ...]
    train: list[Example]
    val: list[Example]
    sources: list[dict[str, Any]] = field(default_factory=list)
    folder: str = ""  # the path the examples were read from

    def fingerprint(self) -> dict[str, Any]:
        """What config.json records of the data (a resumed run must find it again)."""
        return {
            "sources": self.sources,
            "task": self.task,
            "labels": list(self.labels),
            "examples": {"train": len(self.train), "val": len(self.val)},
        }


def read_labeled(path: str | Path, task: str) -> LabeledData:
    """The examples of `task` at `path` (a file, or a folder of train and val files)."""
    if str(path) in BUILTIN:
        return _builtin(str(path), task)
    path = Path(path)
    if path.is_dir():
        files = [_split_file(path, name) for name in SPLIT_FILES]
        train, val = ([_parse(w, r, task) for w, r in _records(f, task)] for f in files)
        sources = [described(str(f), f.read_bytes()) for f in files]
    else:
        records = [_parse(w, r, task) for w, r in _records(path, task)]
        val = [r for r in records if _held_out(r)]
        train = [r for r in records if not _held_out(r)]
        sources = [described(str(path), path.read_bytes())]
    return _labeled(train, val, task, sources, str(path))


def _builtin(name: str, task: str) -> LabeledData:
    wanted = {"stdlib-family": "classify", "stdlib-identifiers": "tag"}[name]
    if task != wanted:
        raise CorpusError(f"{name} is labeled to {wanted}, not to {task}")
    train, val, text = builtin_labeled(name)
    parse = [[_parse(w, r, task) for w, r in part] for part in (train, val)]
    return _labeled(*parse, task, [described(name, text)], name)


def _labeled(train: list, val: list, task: str, sources: list, folder: str) -> LabeledData:
    """The examples with their labels as indices, the names ordered from the training ones."""
    if not train:
        raise CorpusError(f"{folder}: no training examples")
    labels = _label_names(train, task)
    index = {name: i for i, name in enumerate(labels)}
    train, val = ([_indexed(r, index, task) for r in part] for part in (train, val))
    return LabeledData(task, labels, train, val, sources, folder)


def labeled_examples(
    path: str | Path, task: str, labels: tuple[str, ...], split: str = "val"
) -> list[Example]:
    """Every example of a file (or of a folder's `split` file), its labels indexed as
    `labels` orders them (a fine-tuned run's): what `tlm eval` scores a run on."""
    index = {name: i for i, name in enumerate(labels)}
    if str(path) in BUILTIN:
        train, val, _ = builtin_labeled(str(path))
        file, records = str(path), train if split == "train" else val
    else:
        file = _split_file(Path(path), split) if Path(path).is_dir() else Path(path)
        records = _records(file, task)
    examples = [_indexed(_parse(w, r, task), index, task) for w, r in records]
    if not examples:
        raise CorpusError(f"{file}: no examples")
    return examples


def _split_file(folder: Path, name: str) -> Path:
    for suffix in (".jsonl", ".parquet"):
        if (folder / f"{name}{suffix}").is_file():
            return folder / f"{name}{suffix}"
    raise CorpusError(f"{folder}: a folder of labeled data holds {name}.jsonl or {name}.parquet")


def _records(path: Path, task: str):
    if path.suffix == ".parquet":  # the columns the file has of the task's fields
        import pyarrow.parquet as pq

        names = [n for n in FIELDS[task] if n in pq.read_schema(path).names]
        return file_records(path, tuple(names))
    return file_records(path, FIELDS[task])


def _parse(where: str, record: Any, task: str) -> tuple[str, Any, Any, Any]:
    """(where, first, second, label names) of a record, or one line naming what is wrong."""
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: a labeled example is a JSON object")
    if task == "tag":
        words, tags = record.get("tokens"), record.get("tags")
        if not _strings(words) or not _strings(tags) or not words:
            raise CorpusError(
                f"{where}: a tagged example has 'tokens' and 'tags', lists of strings"
            )
        if len(words) != len(tags):
            raise CorpusError(f"{where}: {len(words)} tokens but {len(tags)} tags")
        if "" in words:
            raise CorpusError(f"{where}: token {words.index('')} is empty: a tagged word has text")
        return where, tuple(words), None, tuple(tags)
    first = record.get("text", record.get("text_a"))
    second = None if "text" in record else record.get("text_b")
    if not isinstance(first, str) or not (second is None or isinstance(second, str)):
        raise CorpusError(f"{where}: a classified example has 'text' (or 'text_a' and 'text_b')")
    label = record.get("label")
    if not isinstance(label, str | int) or isinstance(label, bool):
        raise CorpusError(f"{where}: 'label' must be a string or an integer, got {label!r}")
    return where, first, second, str(label)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _held_out(parsed: tuple) -> bool:
    """A tenth of a file's examples, by the hash of the example itself."""
    text = json.dumps(parsed[1:], sort_keys=True).encode()
    return hashlib.sha256(text).digest()[0] % 10 == 0


def _label_names(train: list[tuple], task: str) -> tuple[str, ...]:
    if task == "tag":
        tags = {t for _, _, _, row in train for t in row}
        return tuple(["O"] * ("O" in tags) + sorted(tags - {"O"}))
    names = {label for *_, label in train}
    numeric = all(name.lstrip("-").isdigit() for name in names)
    return tuple(sorted(names, key=int if numeric else str))


def _indexed(parsed: tuple, index: dict[str, int], task: str) -> Example:
    where, first, second, label = parsed
    names = label if task == "tag" else (label,)
    unknown = next((name for name in names if name not in index), None)
    if unknown is not None:
        raise CorpusError(f"{where}: label {unknown!r} is not one of {', '.join(index)}")
    ids = tuple(index[name] for name in names)
    return Example(where, first, second, ids if task == "tag" else ids[0])


IGNORED = -100  # a position whose label is not scored (cross_entropy's ignore_index)


@dataclass(frozen=True)
class Encoded:
    """An example as the encoder reads it: ids, segments, and the label (a classifier's
    index; a tagger's per position, IGNORED but on each word's first token)."""

    ids: list[int]
    segments: list[int]
    label: int | list[int]
    cut: bool  # whether the example was longer than the model reads, and cut


def encode_example(example: Example, tokenizer, task: str, limit: int) -> Encoded:
    """`[CLS] first [SEP]` (`[CLS] first [SEP] second [SEP]`, segments 0 then 1), cut to
    `limit` tokens as BERT's tokenizer truncates (the longer text first); for a tagger, each
    word encoded on its own (after a space, but the first), its tag on its first token. A
    text the tokenizer cannot spell (a character model's unknown character) is one line
    naming the example."""
    try:
        return _encode(example, tokenizer, task, limit)
    except TokenizerError as exc:
        raise CorpusError(f"{example.where}: {exc}") from None


def _encode(example: Example, tokenizer, task: str, limit: int) -> Encoded:
    cls, sep = tokenizer.special_id("[CLS]"), tokenizer.special_id("[SEP]")
    if task == "tag":
        ids, labels = [cls], [IGNORED]
        for i, (word, tag) in enumerate(zip(example.first, example.label, strict=True)):
            pieces = tokenizer.encode(word if i == 0 else " " + word)
            ids += pieces
            labels += [tag] + [IGNORED] * (len(pieces) - 1)
        cut = len(ids) + 1 > limit
        ids, labels = [*ids[: limit - 1], sep], [*labels[: limit - 1], IGNORED]
        return Encoded(ids, [0] * len(ids), labels, cut)
    a = tokenizer.encode(example.first)
    b = None if example.second is None else tokenizer.encode(example.second)
    room = limit - (2 if b is None else 3)
    cut = len(a) + len(b or []) > room
    while len(a) + len(b or []) > room:  # longest first, one token at a time
        if b is not None and len(b) > len(a):
            b.pop()
        else:
            a.pop()
    ids, segments = [cls, *a, sep], [0] * (len(a) + 2)
    if b is not None:
        ids, segments = ids + [*b, sep], segments + [1] * (len(b) + 1)
    return Encoded(ids, segments, example.label, cut)
