"""Corpora: where text comes from, read as a stream of documents.

A source is a `.txt` file (one document, or one per line with `line_docs`), a `.jsonl` file
(one document per line, in its `text` field, or the field `text_field` names), a `.parquet`
or `.arrow` file (one document per row of that column; `columnar.py`), or a built-in corpus:
one read from the running Python (`python-docs`, the topics of `pydoc_data.topics`;
`python-stdlib`, the standard library's docstrings and those topics; see `python_corpora`),
or one of the text files shipped gzip-compressed in `tlm/data/corpora/` (`tinyshakespeare`,
`names`), read exactly as the `.txt` file it came from. Folders contribute their files of
those kinds (so a `datasets.save_to_disk` folder gives its Arrow files); globs are expanded.
Every source is read in pieces of about `CHUNK_BYTES`, so a corpus larger than
memory streams through; a piece never splits a BPE pre-token (see `_safe_split`), so the
tokens do not depend on the chunk size.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from tlm.data.columnar import COLUMNAR, column_texts
from tlm.data.python_corpora import python_docs, python_stdlib
from tlm.errors import UserError

# built-in corpora read from the running Python: name -> its documents
BUILTIN_PYTHON = {"python-docs": python_docs, "python-stdlib": python_stdlib}
# built-in text corpora: name -> gzip file in tlm/data/corpora/ (origins in its README.md)
BUILTIN_TEXT = {"tinyshakespeare": "tinyshakespeare.txt.gz", "names": "names.txt.gz"}
BUILTIN = (*BUILTIN_PYTHON, *BUILTIN_TEXT)
SUFFIXES = (".txt", ".jsonl", *COLUMNAR)
CHUNK_BYTES = 1 << 22  # 4 MiB per read


class CorpusError(UserError):
    """Input text that cannot be used; the message names the file (and line)."""


@dataclass
class Piece:
    """A run of text; `ends_document` marks the last piece of a document."""

    text: str
    ends_document: bool = True


@dataclass
class Source:
    """One input: `name` as the user gave it, `path` None for a built-in corpus.

    `bytes` and `sha256` describe the raw input (a built-in's decompressed text) and are
    filled in as it is read.
    """

    name: str
    path: Path | None
    line_docs: bool = False
    text_field: str = "text"
    bytes: int = 0
    sha256: str = ""
    _hash: object = field(default=None, repr=False)

    def pieces(self) -> Iterator[Piece]:
        """Yield the source's text piece by piece; documents never mix."""
        self._hash, self.bytes = hashlib.sha256(), 0
        if self.path is None and self.name in BUILTIN_PYTHON:
            yield from self._texts(BUILTIN_PYTHON[self.name]())
        elif self.path is not None and self.path.suffix == ".jsonl":
            yield from self._jsonl()
        elif self.path is not None and self.path.suffix in COLUMNAR:
            yield from self._columnar()
        elif self.line_docs:
            yield from self._lines()
        else:
            yield from self._whole()
        self.sha256 = self._hash.hexdigest()

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "bytes": self.bytes, "sha256": self.sha256}

    def _texts(self, texts: list[str]) -> Iterator[Piece]:
        """One document per text; blank texts are counted in `bytes` but give none."""
        for text in texts:
            self._count(text.encode("utf-8"))
            if text.strip():
                yield Piece(text)

    def _whole(self) -> Iterator[Piece]:
        """The whole file is one document; whitespace-only files contribute nothing."""
        started, pending = False, ""  # leading whitespace is held until text shows up
        for text in self._decoded_chunks():
            if not started:
                pending += text
                if not pending.strip():
                    continue
                text, pending, started = pending, "", True
            yield Piece(text, ends_document=False)
        if started:
            yield Piece("", ends_document=True)

    def _lines(self) -> Iterator[Piece]:
        for _, line in self._numbered_lines():
            line = line.rstrip("\r\n")
            if line.strip():
                yield Piece(line)

    def _jsonl(self) -> Iterator[Piece]:
        for number, line in self._numbered_lines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise CorpusError(f"{self.name}:{number}: not valid JSON") from None
            text = record.get(self.text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise CorpusError(f"{self.name}:{number}: no string field {self.text_field!r}")
            if text.strip():
                yield Piece(text)

    def _columnar(self) -> Iterator[Piece]:
        with open(self.path, "rb") as f:  # the file's own bytes describe it
            while raw := f.read(CHUNK_BYTES):
                self._count(raw)
        for text in column_texts(self.path, self.name, self.text_field):
            if text.strip():
                yield Piece(text)

    def _numbered_lines(self) -> Iterator[tuple[int, str]]:
        number, rest = 0, ""
        for text in self._decoded_chunks():
            lines = (rest + text).split("\n")
            rest = lines.pop()
            for line in lines:
                number += 1
                yield number, line
        if rest:
            yield number + 1, rest

    def _decoded_chunks(self) -> Iterator[str]:
        """UTF-8 text in pieces that end where a BPE pre-token ends; errors name the line."""
        lines_before, carry = 0, b""
        with self._open() as f:
            while raw := f.read(CHUNK_BYTES):
                self._count(raw)
                data, carry = _safe_split(carry + raw)
                if data:
                    yield self._decode(data, lines_before)
                    lines_before += data.count(b"\n")
        if carry:
            yield self._decode(carry, lines_before)

    @contextmanager
    def _open(self) -> Iterator[BinaryIO]:
        """The raw bytes: the file, or a built-in's text decompressed as it is read."""
        if self.path is not None:
            with open(self.path, "rb") as f:
                yield f
            return
        resource = resources.files("tlm.data") / "corpora" / BUILTIN_TEXT[self.name]
        with resource.open("rb") as compressed, gzip.GzipFile(fileobj=compressed) as f:
            yield f

    def _decode(self, data: bytes, lines_before: int) -> str:
        if b"\0" in data:
            raise CorpusError(f"{self.name} looks binary (it contains NUL bytes); give text files")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = lines_before + data[: exc.start].count(b"\n") + 1
            raise CorpusError(
                f"{self.name} is not valid UTF-8 at line {line} (byte {exc.start}); "
                "convert it to UTF-8 first"
            ) from None

    def _count(self, raw: bytes) -> None:
        self._hash.update(raw)
        self.bytes += len(raw)


def _safe_split(data: bytes) -> tuple[bytes, bytes]:
    """Split `data` after its last newline with a non-space character on both sides.

    GPT-2's pre-tokenizer always ends pre-tokens around such a newline (a lone newline
    before a letter, digit or symbol is its own pre-token, and only a plain space may lead
    a word), so tokenizing the two halves separately gives exactly the tokens of the whole.
    Whitespace before the newline would join it in a run ("\n\n", "\r\n") that a split
    would cut differently. A UTF-8 character never starts with a newline byte, so both
    halves decode.
    """
    end = len(data)
    while (i := data.rfind(b"\n", 0, end)) != -1:
        following = data[i + 1 : i + 5].decode("utf-8", errors="ignore")[:1]
        before_space = i == 0 or data[i - 1 : i].isspace()  # an ASCII byte check suffices
        if following and not following.isspace() and not before_space:
            return data[: i + 1], data[i + 1 :]
        end = i
    return b"", data


def resolve_sources(
    inputs: list[str], line_docs: bool = False, text_field: str = "text"
) -> list[Source]:
    """Files, folders (their .txt/.jsonl/.parquet/.arrow files, recursively), globs, or a
    built-in name."""
    sources: list[Source] = []
    for item in inputs:
        if item in BUILTIN:
            sources.append(Source(item, None, line_docs=line_docs, text_field=text_field))
            continue
        for path in _expand(item):
            sources.append(Source(str(path), path, line_docs=line_docs, text_field=text_field))
    if not sources:
        raise CorpusError("no input files were given")
    return sources


def _expand(item: str) -> list[Path]:
    path = Path(item)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise CorpusError(f"{item}: folder has no .txt, .jsonl, .parquet or .arrow files")
        return files
    if path.is_file():
        return [path]
    if glob.has_magic(item):
        files = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
        if not files:
            raise CorpusError(f"{item}: no files match")
        return files
    raise CorpusError(f"{item}: no such file, folder or built-in corpus ({', '.join(BUILTIN)})")


def documents(sources: list[Source]) -> Iterator[str]:
    """The text of each document, whole and in order: exactly the documents `prepare` writes.

    Documents with no text but whitespace are skipped, as `prepare` skips them; each document
    is held in memory whole while its pieces are joined.
    """
    parts: list[str] = []
    for source in sources:
        for piece in source.pieces():
            parts.append(piece.text)
            if piece.ends_document:
                yield "".join(parts)
                parts = []
