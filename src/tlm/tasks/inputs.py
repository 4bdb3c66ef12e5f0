"""Reading task inputs: texts (with gold labels) and multiple-choice items, one line each.

    FILE.jsonl   one JSON object per line: a text field (and a gold field)
    FILE.parquet one row each, the same fields as columns (or FILE.arrow)
    FILE.tsv     text<TAB>gold
    other / -    one text per line (stdin for -)

Blank lines are skipped; a line without what the task needs is an error naming the line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tlm.data.chat import file_records
from tlm.data.columnar import COLUMNAR
from tlm.tasks.score import TaskError


def _lines(path: str) -> list[tuple[int, str]]:
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TaskError(f"{path}: no such file") from None
        except UnicodeDecodeError as exc:
            raise TaskError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _record(path: str, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise TaskError(f"{path}:{number}: not valid JSON") from None
    if not isinstance(record, dict):
        raise TaskError(f"{path}:{number}: not a JSON object")
    return record


def read_examples(
    path: str, text_field: str = "text", gold_field: str | None = None
) -> list[tuple[str, str | None]]:
    """(text, gold or None) per line (a .parquet or .arrow file: per row, its
    `text_field` and `gold_field` columns)."""
    if Path(path).suffix in COLUMNAR:
        return _columnar(path, text_field, gold_field)
    examples = []
    for number, line in _lines(path):
        if path.endswith(".jsonl"):
            record = _record(path, number, line)
            wanted = [text_field] + ([gold_field] if gold_field else [])
            missing = [f for f in wanted if not isinstance(record.get(f), str)]
            if missing:
                raise TaskError(f"{path}:{number}: no string field {missing[0]!r}")
            examples.append((record[text_field], record.get(gold_field) if gold_field else None))
        elif path.endswith(".tsv"):
            text, _, gold = line.partition("\t")
            if gold_field and not gold.strip():
                raise TaskError(f"{path}:{number}: no gold label after a tab")
            examples.append((text, gold.strip() or None))
        else:
            examples.append((line, None))
    if not examples:
        raise TaskError(f"{path}: no input lines")
    return examples


def _columnar(path: str, text_field: str, gold_field: str | None) -> list[tuple[str, str | None]]:
    """(text, gold or None) of each row of a .parquet or .arrow file."""
    fields = (text_field,) if gold_field is None else (text_field, gold_field)
    examples = []
    for where, row in file_records(Path(path), fields):
        if not all(isinstance(row[f], str) for f in fields):
            raise TaskError(f"{where}: {' and '.join(map(repr, fields))} must be strings")
        examples.append((row[text_field], row.get(gold_field)))
    if not examples:
        raise TaskError(f"{path}: no input rows")
    return examples


def read_choices(path: str) -> list[dict]:
    """Multiple-choice items {"context": str, "choices": [str, ...], "gold": int} per line."""
    items = []
    for number, line in _lines(path):
        item = _record(path, number, line)
        choices = item.get("choices")
        if not isinstance(item.get("context"), str):
            raise TaskError(f"{path}:{number}: no string field 'context'")
        if not (isinstance(choices, list) and len(choices) >= 2):
            raise TaskError(f"{path}:{number}: 'choices' must be a list of two or more strings")
        if not all(isinstance(c, str) and c for c in choices):
            raise TaskError(f"{path}:{number}: every choice must be a non-empty string")
        gold = item.get("gold")
        if not (isinstance(gold, int) and 0 <= gold < len(choices)):
            raise TaskError(
                f"{path}:{number}: 'gold' must be an index into the {len(choices)} choices"
            )
        items.append(item)
    if not items:
        raise TaskError(f"{path}: no items")
    return items
