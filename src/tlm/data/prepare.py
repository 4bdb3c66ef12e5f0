"""`prepare`: sources -> a tokenizer and packed token files (J&M §10.9.1).

Two streaming passes over the sources: the first trains the tokenizer, the second encodes
every document, appends `<|endoftext|>` and writes the ids to disk as they come. The stream
is then cut into a training split and a held-out validation split (its last
`val_fraction`). The output folder:

    OUT/tokenizer.json
    OUT/train.bin, OUT/val.bin   raw token ids, uint16 when V <= 65535 else uint32
    OUT/meta.json                tokenizer, counts, bytes, sha256 of every source

It is built under a temporary name and renamed at the end, so a failure leaves nothing.
`force` replaces an existing folder only if `prepare` wrote it and it holds nothing else.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tlm._version import __version__
from tlm.data.canaries import as_planted, plant, secrets, spelled
from tlm.data.clean import CleanConfig, Cleaner
from tlm.data.corpus import CorpusError, Piece, Source, resolve_sources
from tlm.data.encode import encoded, segments
from tlm.data.pii import Scanner, scanned
from tlm.data.shards import write_shards
from tlm.data.tokens import SPLITS, id_dtype, meta_id_dtype
from tlm.io import atomic_path, check_replaceable, write_text_atomic
from tlm.tokenizer import KINDS, Tokenizer, TokenizerError, load_tokenizer, train_tokenizer

FILES = ("meta.json", "tokenizer.json", "train.bin", "val.bin", "train-*.bin", "val-*.bin")
FILES += (".tlm-demo",)
EMPTY = "corpus is empty: no document has any text"


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bpe",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    line_docs: bool = False,
    force: bool = False,
    text_field: str = "text",
    progress: bool = True,
    clean: CleanConfig | None = None,
    shard_tokens: int | None = None,
    workers: int = 1,
    canary_repeats: list[int] | None = None,
    canary_seed: int = 0,
    pii: str | None = None,
    pii_region: str = "US",
) -> dict[str, Any]:
    """Tokenize `inputs` into folder `out`; returns (and writes) its meta.json.

    With `clean`, each document passes a `Cleaner` first (§10.9.2: quality filters, exact
    and near deduplication). It decides on the first pass over the sources, and the second
    pass replays its decisions; what it removed is counted in meta.json's "cleaning". A
    document is held whole in memory while it is judged. With `canary_repeats`, one random
    secret per count is planted that many times in the training split (`canaries.py`). With
    `pii` ("report" or "mask"), personal data is counted, or masked, before the tokenizer
    sees the text (`pii.py`)."""
    out = Path(out)
    if not 0 <= val_fraction < 1:
        raise CorpusError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if workers < 1:
        raise CorpusError(f"--workers must be at least 1, got {workers}")
    if shard_tokens is not None and shard_tokens < 1:
        raise CorpusError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if out.exists() and not force:
        raise CorpusError(f"{out} already exists; pass --force to replace it")
    check_replaceable(out, FILES, "meta.json", "a folder written by tlm prepare")
    sources = resolve_sources(inputs, line_docs, text_field)
    total_bytes = sum(s.path.stat().st_size for s in sources if s.path is not None)
    scanner = None if pii is None else Scanner(pii, pii_region)
    documents = _Documents(sources, Cleaner(clean) if clean else None, scanner)
    canaries = None if canary_repeats is None else secrets(canary_repeats, canary_seed)
    if tokenizer in KINDS:  # trained on the training split as planted
        planted = as_planted(canaries, tokenizer)
        tok = _train_tokenizer(tokenizer, documents, vocab_size, progress, total_bytes, planted)
    elif vocab_size is not None:
        raise CorpusError("--vocab-size applies when training a tokenizer (bpe)")
    else:  # an existing tokenizer, e.g. the one of the model to fine-tune
        tok = load_tokenizer(_existing_tokenizer(tokenizer))
    if canaries:  # refused before the corpus is read again
        spelled(canaries, tok, id_dtype(tok.vocab_size))
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        meta = _write_tokens(
            tmp, documents, tok, val_fraction, progress, total_bytes, workers, canaries, canary_seed
        )
        if shard_tokens is not None:
            _shard(tmp, meta, shard_tokens)
        if meta["documents"] == 0:
            raise CorpusError(EMPTY if clean is None else f"{EMPTY} after cleaning")
        if clean is not None:
            meta["cleaning"] = {"config": asdict(clean), "counts": documents.cleaner.counts}
        if scanner is not None:
            meta["pii"] = scanner.describe()
        write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def _train_tokenizer(
    kind: str,
    documents: _Documents,
    vocab_size: int | None,
    progress: bool,
    total_bytes: int,
    planted: list[str],
) -> Tokenizer:
    """A tokenizer of `kind` trained on the documents, then the `planted` texts."""
    bar = _bar(progress, total_bytes, "training tokenizer")
    texts = _Texts(documents, bar)
    try:
        tok = train_tokenizer(kind, itertools.chain(texts, planted), vocab_size)
    except TokenizerError:
        if texts.documents == 0:  # say why the tokenizer found nothing to learn
            raise CorpusError(EMPTY) from None
        raise
    finally:
        bar.close()
    if texts.documents == 0:
        raise CorpusError(EMPTY)
    return tok


def _existing_tokenizer(name: str) -> Path:
    path = Path(name)
    if not path.exists():
        raise TokenizerError(
            f"unknown tokenizer {name!r}: give {' or '.join(KINDS)}, or the path of a "
            "tokenizer.json (or of a run or data folder holding one)"
        )
    return path


class _Texts:
    """Iterate the pieces' texts (for tokenizer training), counting documents."""

    def __init__(self, documents: _Documents, bar: tqdm) -> None:
        self.source, self.bar, self.documents = documents, bar, 0

    def __iter__(self) -> Iterator[str]:
        for piece in self.source.pieces(self.bar):
            self.documents += piece.ends_document
            if piece.text:
                yield from segments(piece.text)


class _Documents:
    """The sources' pieces, each pass over them, less the documents a cleaner removes. The
    cleaner judges each whole document on the first pass; later passes replay its verdicts
    (it remembers what it has seen, so judging again would call everything a duplicate)."""

    def __init__(
        self, sources: list[Source], cleaner: Cleaner | None, scanner: Scanner | None = None
    ) -> None:
        self.sources, self.cleaner, self.verdicts = sources, cleaner, bytearray()
        self.scanner, self.passes = scanner, 0

    def pieces(self, bar: tqdm) -> Iterator[Piece]:
        """The kept pieces, with personal data counted or masked (each pass counts anew)."""
        pieces = self._kept(bar)
        if self.scanner is None:
            return pieces
        self.scanner.counts = dict.fromkeys(self.scanner.counts, 0)
        return scanned(pieces, self.scanner)

    def _kept(self, bar: tqdm) -> Iterator[Piece]:
        pieces = _pieces(self.sources, bar)
        self.passes += 1
        if self.cleaner is None:
            yield from pieces
            return
        judge = self.passes == 1
        verdicts = iter(self.verdicts)
        document: list[Piece] = []
        for piece in pieces:
            document.append(piece)
            if piece.ends_document:
                if judge:
                    self.verdicts.append(self.cleaner.keep("".join(p.text for p in document)))
                if self.verdicts[-1] if judge else next(verdicts):
                    yield from document
                document = []
        yield from document  # text after the last document's end (none from a corpus)


def _pieces(sources: list[Source], bar: tqdm) -> Iterator[Piece]:
    for source in sources:
        before = 0
        for piece in source.pieces():
            bar.update(source.bytes - before)
            before = source.bytes
            yield piece


def _write_tokens(
    folder: Path,
    source: _Documents,
    tok: Tokenizer,
    val_fraction: float,
    progress: bool,
    total_bytes: int,
    workers: int = 1,
    canaries: list[dict] | None = None,
    canary_seed: int = 0,
) -> dict[str, Any]:
    ids_as = id_dtype(tok.vocab_size)
    tok.save(folder / "tokenizer.json")  # for the workers (and the folder)
    stream = folder / "tokens.bin"
    bar = _bar(progress, total_bytes, "encoding")
    documents = 0
    with open(stream, "wb") as f:
        for ids, ended in encoded(source.pieces(bar), tok, workers, folder / "tokenizer.json"):
            np.asarray(ids, dtype=ids_as).tofile(f)
            documents += ended
    bar.close()
    n_total = stream.stat().st_size // np.dtype(ids_as).itemsize
    n_val = round(n_total * val_fraction)  # of the corpus: the canaries go to train only
    if canaries and documents:
        n_total += plant(stream, n_total - n_val, canaries, tok, canary_seed, ids_as)
    _cut(stream, n_total - n_val, folder / "train.bin", folder / "val.bin", ids_as)
    token_bytes = tok.token_bytes()
    splits = {}
    for name in SPLITS:
        path = folder / f"{name}.bin"
        n = n_total - n_val if name == "train" else n_val
        splits[name] = {"file": path.name, "tokens": n, "bytes": _bytes(path, ids_as, token_bytes)}
    planted = {"canaries": canaries, "canary_seed": canary_seed} if canaries else {}
    return {
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "id_dtype": np.dtype(ids_as).name,
        "documents": documents,
        "val_fraction": val_fraction,
        "splits": splits,
        "sources": [s.describe() for s in source.sources],
        **planted,
        "tlm": __version__,
    }


def _shard(folder: Path, meta: dict[str, Any], shard_tokens: int) -> None:
    """Replace train.bin and val.bin by shards of at most `shard_tokens` tokens, indexed in
    meta["splits"][name]["shards"] (the concatenation is the same stream)."""
    for name in SPLITS:
        info = meta["splits"][name]
        path = folder / info.pop("file")
        with open(path, "rb") as stream:
            info["shards"] = write_shards(
                stream, info["tokens"], meta_id_dtype(meta), shard_tokens, name, folder
            )
        path.unlink()


def _cut(stream: Path, n_train: int, train: Path, val: Path, ids_as: type) -> None:
    """Move the stream's tail (from token `n_train`) into `val`, the head becomes `train`."""
    offset = n_train * np.dtype(ids_as).itemsize
    with open(stream, "r+b") as src, open(val, "wb") as dst:
        src.seek(offset)
        shutil.copyfileobj(src, dst, 1 << 24)
        src.truncate(offset)
    stream.rename(train)


def _bytes(path: Path, ids_as: type, token_bytes: np.ndarray) -> int:
    """UTF-8 bytes the tokens of file `path` spell (<|endoftext|> spells none), read a
    million tokens at a time: memory stays a few MB whatever the corpus (a memory map of
    the split, and a 16M-token slice of it, once cost hundreds)."""
    counts = np.zeros(len(token_bytes), dtype=np.int64)
    with open(path, "rb") as f:
        while (chunk := np.fromfile(f, dtype=ids_as, count=1 << 20)).size:
            counts += np.bincount(chunk, minlength=len(token_bytes))
    return int(counts @ token_bytes)


def _bar(progress: bool, total: int, what: str) -> tqdm:
    return tqdm(
        total=total or None, desc=what, unit="B", unit_scale=True, disable=not progress, leave=False
    )
