"""Translation data: sentence pairs from two aligned files, tokenized and packed.

`prepare_pairs` reads a source file and a target file line by line (plain or `.gz`; line i
of one translates line i of the other), trains one byte-level BPE on both languages (the
shared vocabulary of Vaswani et al. §3.4) and writes, per split:

    OUT/{split}.src.bin, OUT/{split}.tgt.bin   each sentence's ids then <|endoftext|>
    OUT/{split}.src.idx, OUT/{split}.tgt.idx   int64 offsets: sentence i is [idx[i], idx[i+1])
    OUT/meta.json                              "task": "translate", counts, sources' sha256

A pair with an empty side is skipped and counted (meta.json "skipped"); files of
different lengths are refused, naming the line where they diverge. The validation split
is a second pair of files, or the last `val_fraction` of the pairs. `tokens.PairData`
reads the folder; `token_batches` groups pairs of similar length into batches of at most
`max_tokens` tokens a side (padding included).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

from tlm._version import __version__
from tlm.data.corpus import CorpusError
from tlm.data.tokens import SIDES, id_dtype
from tlm.io import atomic_path, check_replaceable, write_text_atomic
from tlm.tokenizer import KINDS, Tokenizer, load_tokenizer, train_tokenizer

FILES = ("meta.json", "tokenizer.json", "*.src.bin", "*.tgt.bin", "*.src.idx", "*.tgt.idx")


def read_pairs(src: str | Path, tgt: str | Path) -> tuple[list[str], list[str], int]:
    """The aligned lines of two files, less pairs with an empty side: (sources, targets,
    skipped). Files of different lengths are an error naming where they diverge."""
    sources, targets, skipped = [], [], 0
    for n, (x, y) in enumerate(zip_longest(read_lines(src), read_lines(tgt)), start=1):
        if x is None or y is None:  # one file ended before the other
            longer, shorter = (src, tgt) if y is None else (tgt, src)
            raise CorpusError(
                f"{longer} has more lines than {shorter}: the files diverge at line {n} "
                f"({shorter} ends after line {n - 1}); line i of one must translate line i "
                "of the other"
            )
        x, y = x.strip(), y.strip()
        if x and y:
            sources.append(x)
            targets.append(y)
        else:
            skipped += 1
    if not sources:
        raise CorpusError(f"{src} and {tgt} hold no pair with text on both sides")
    return sources, targets, skipped


def read_lines(path: str | Path) -> Iterator[str]:
    """A text file's lines (`.gz` decompressed), or a one-line error naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="\n") as f:
        try:
            yield from f
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{path}: not valid UTF-8 (byte {exc.start})") from None


def prepare_pairs(
    src: str,
    tgt: str,
    out: str | Path,
    val_src: str | None = None,
    val_tgt: str | None = None,
    val_fraction: float = 0.05,
    tokenizer: str = "bpe",
    vocab_size: int | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Tokenize the pairs of `src` and `tgt` into folder `out`; returns its meta.json."""
    out = Path(out)
    if (val_src is None) != (val_tgt is None):
        raise CorpusError("give both --val-src and --val-tgt, or neither")
    if out.exists() and not force:
        raise CorpusError(f"{out} already exists; pass --force to replace it")
    check_replaceable(out, FILES, "meta.json", "a folder written by tlm prepare")
    train = read_pairs(src, tgt)
    if val_src is not None:
        val = read_pairs(val_src, val_tgt)
    else:
        if not 0 < val_fraction < 1:
            raise CorpusError(f"--val-fraction must be in (0, 1), got {val_fraction}")
        cut = len(train[0]) - max(1, round(len(train[0]) * val_fraction))
        val = (train[0][cut:], train[1][cut:], 0)
        train = (train[0][:cut], train[1][:cut], train[2])
    if tokenizer in KINDS:
        tok = train_tokenizer(tokenizer, [*train[0], *train[1]], vocab_size)  # one vocabulary
    else:
        tok = load_tokenizer(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        tok.save(tmp / "tokenizer.json")
        splits = {}
        for name, (sources, targets, skipped) in {"train": train, "val": val}.items():
            splits[name] = {"pairs": len(sources), "skipped_empty": skipped}
            for side, texts in zip(SIDES, (sources, targets), strict=True):
                splits[name][f"{side}_tokens"] = _write_side(tmp, name, side, texts, tok)
        files = [f for f in (src, tgt, val_src, val_tgt) if f is not None]
        meta = {
            "task": "translate",
            "tokenizer": tok.kind,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "id_dtype": np.dtype(id_dtype(tok.vocab_size)).name,
            "splits": splits,
            "sources": [_describe(Path(f)) for f in files],
            "tlm": __version__,
        }
        write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def _write_side(folder: Path, split: str, side: str, texts: list[str], tok: Tokenizer) -> int:
    """Write one side of a split: the ids, <|endoftext|> after each sentence; returns the
    token count."""
    lengths, ids = [], []
    for encoded in tok.encode_batch(texts):
        ids += [*encoded, tok.eot_id]
        lengths.append(len(encoded) + 1)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.asarray(ids, dtype=id_dtype(tok.vocab_size)).tofile(folder / f"{split}.{side}.bin")
    offsets.tofile(folder / f"{split}.{side}.idx")
    return len(ids)


def _describe(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"name": str(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def token_batches(
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    max_tokens: int,
    seed: int | None = None,
) -> list[np.ndarray]:
    """Pair indices in batches of similar length, each at most `max_tokens` tokens a side
    counting padding (the longest sentence times the batch size).

    Pairs are sorted by length (ties in an order drawn from `seed`, or kept with None), cut
    into batches greedily, and with a seed the batches are shuffled: each epoch a new
    order and new neighbours, and little padding.
    """
    rng = None if seed is None else np.random.default_rng(seed)
    n = len(src_lengths)
    tie = np.arange(n) if rng is None else rng.permutation(n)
    order = np.lexsort((tie, src_lengths, tgt_lengths))  # by target length, then source
    batches, start, longest_src, longest_tgt = [], 0, 0, 0
    for k, i in enumerate(order):
        longest_src = max(longest_src, src_lengths[i])
        longest_tgt = max(longest_tgt, tgt_lengths[i])
        if max(longest_src, longest_tgt) * (k + 1 - start) > max_tokens and k > start:
            batches.append(order[start:k])
            start, longest_src, longest_tgt = k, src_lengths[i], tgt_lengths[i]
    batches.append(order[start:])
    if rng is not None:
        batches = [batches[j] for j in rng.permutation(len(batches))]
    return batches
