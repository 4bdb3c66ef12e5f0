"""Reading prepared folders: meta.json, the memory-mapped token files, translation pairs.

`prepare.py` and `pairs.py` write the folders; everything that reads them (training,
evaluation, the scaling sweeps, translation) reads through this module. A token file holds
raw ids in the narrowest unsigned integers that fit the vocabulary (`id_dtype`: uint16 when
V <= 65535, else uint32), named in meta.json as "id_dtype" ("dtype" in folders written
before it was renamed, which read as well).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from tlm.data.corpus import CorpusError
from tlm.data.shards import ShardedTokens

SPLITS = ("train", "val")
SIDES = ("src", "tgt")


def id_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The integer type a token file stores ids of a `vocab_size` vocabulary in."""
    return np.uint16 if vocab_size <= 65535 else np.uint32


def meta_id_dtype(meta: dict[str, Any]) -> np.dtype:
    """The ids' integer type a meta.json names (its older key "dtype" too)."""
    return np.dtype(meta.get("id_dtype", meta.get("dtype")))


def read_meta(folder: Path) -> dict[str, Any]:
    path = folder / "meta.json"
    if not path.is_file():
        raise CorpusError(f"{folder} is not a prepared data folder (no meta.json); run tlm prepare")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{path} is not valid JSON: {exc}") from None


class TokenData:
    """A folder written by `prepare`: its meta, tokenizer and memory-mapped splits."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.meta = read_meta(self.folder)
        if self.meta.get("task") == "translate":
            raise CorpusError(
                f"{folder} holds sentence pairs (tlm prepare --task translate), not one text "
                "stream: train an encoder-decoder on it, or translate with it"
            )
        self.vocab_size: int = self.meta["vocab_size"]
        self.id_dtype = meta_id_dtype(self.meta)

    def fingerprint(self) -> dict[str, Any]:
        """What the tokens are made of: each source's size and sha256, the tokenizer (its
        file's sha256) and the token counts. A run records it; a resume compares it."""
        tokens = {name: self.meta["splits"][name]["tokens"] for name in SPLITS}
        return fingerprint(self.folder, self.meta, self.meta["documents"], tokens)

    def split(self, name: str) -> np.ndarray:
        """The token ids of split `name` ("train" or "val"), memory-mapped read-only."""
        if name not in SPLITS:
            raise CorpusError(f"unknown split {name!r}; choose train or val")
        info = self.meta["splits"][name]
        if "shards" in info:
            return ShardedTokens([self._file(s["file"], s["tokens"]) for s in info["shards"]])
        return self._file(info["file"], info["tokens"])

    def _file(self, name: str, tokens: int) -> np.ndarray:
        path = self.folder / name
        if tokens and not path.is_file():
            raise CorpusError(f"{path} is missing; prepare the data again")
        if tokens and path.stat().st_size != tokens * self.id_dtype.itemsize:
            raise CorpusError(
                f"{path} holds {path.stat().st_size:,} bytes, not the {tokens:,} tokens "
                "meta.json lists; prepare the data again"
            )
        return read_tokens(path, self.id_dtype, tokens)


def fingerprint(folder: Path, meta: dict[str, Any], documents: Any, tokens: Any) -> dict[str, Any]:
    """What a prepared folder's tokens are made of (`TokenData.fingerprint`)."""
    tokenizer = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    return {
        "sources": [{k: s[k] for k in ("name", "bytes", "sha256")} for s in meta["sources"]],
        "tokenizer": meta["tokenizer"],
        "tokenizer_sha256": tokenizer,
        "vocab_size": meta["vocab_size"],
        "documents": documents,
        "tokens": tokens,
    }


def fingerprint_differences(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the data behind two fingerprints differ, one phrase each ("" when they agree)."""
    if len(then["sources"]) != len(now["sources"]):
        return [f"{len(then['sources'])} sources then, {len(now['sources'])} now"]
    found = []
    for i, (a, b) in enumerate(zip(then["sources"], now["sources"], strict=True)):
        for key in ("bytes", "sha256"):
            if a[key] != b[key]:
                old, new = _short(a[key]), _short(b[key])
                found.append(f"source {i + 1} ({b['name']}) {key} {old} then, {new} now")
    for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "documents", "tokens"):
        if then[key] != now[key]:
            found.append(f"{key} {_short(then[key])} then, {_short(now[key])} now")
    return found


def _short(value: Any) -> str:
    return f"{value[:12]}…" if isinstance(value, str) and len(value) == 64 else f"{value}"


def read_tokens(path: Path, id_dtype: np.dtype | type, n: int) -> np.ndarray:
    """`n` token ids from `path`, memory-mapped read-only (an empty array when n is 0)."""
    if n == 0:
        return np.empty(0, dtype=id_dtype)
    return np.memmap(path, dtype=id_dtype, mode="r", shape=(n,))


class Pairs:
    """One split: sentence i's source and target ids (each ending in <|endoftext|>)."""

    def __init__(self, folder: Path, split: str, id_dtype: np.dtype) -> None:
        self.ids, self.offsets = {}, {}
        for side in SIDES:
            offsets = np.fromfile(folder / f"{split}.{side}.idx", dtype=np.int64)
            ids = np.fromfile(folder / f"{split}.{side}.bin", dtype=id_dtype)
            if len(offsets) == 0 or offsets[-1] != len(ids):
                raise CorpusError(f"{folder}: {split}.{side} files disagree; prepare again")
            self.ids[side], self.offsets[side] = ids, offsets
        if len(self.offsets["src"]) != len(self.offsets["tgt"]):
            raise CorpusError(f"{folder}: {split} sides hold different pair counts")

    def __len__(self) -> int:
        return len(self.offsets["src"]) - 1

    def lengths(self, side: str) -> np.ndarray:
        return np.diff(self.offsets[side])

    def sentence(self, side: str, i: int) -> np.ndarray:
        o = self.offsets[side]
        return self.ids[side][o[i] : o[i + 1]]


class ChatData(TokenData):
    """A folder written by `prepare_chat` (`chat.py`): each split's rendered conversations
    as one token stream (`split`), with the loss mask beside it (`mask`) and where each
    conversation starts (`offsets`)."""

    def mask(self, name: str) -> np.ndarray:
        """One byte per token of split `name`: 1 where training learns the token."""
        tokens = self.meta["splits"][name]["tokens"]
        mask = read_tokens(self.folder / f"{name}.mask", np.uint8, tokens)
        if len(mask) != len(self.split(name)):
            raise CorpusError(f"{self.folder}: {name}.mask and {name}.bin disagree; prepare again")
        return mask

    def offsets(self, name: str) -> np.ndarray:
        """int64 [conversations + 1]: conversation i is tokens [offsets[i], offsets[i+1])."""
        offsets = np.fromfile(self.folder / f"{name}.idx", dtype=np.int64)
        if len(offsets) == 0 or offsets[-1] != self.meta["splits"][name]["tokens"]:
            raise CorpusError(f"{self.folder}: {name}.idx and {name}.bin disagree; prepare again")
        return offsets


class PreferenceData(ChatData):
    """A folder written by `prepare_preference` (`preference.py`): sequences in twos, 2i
    pair i's chosen answer and 2i + 1 its rejected one, each with its loss mask."""

    def pairs(self, name: str) -> int:
        return self.meta["splits"][name]["pairs"]


class PromptData(ChatData):
    """A folder written by `prepare_prompts` (`prompts.py`): each split's rendered prompts
    (up to the assistant's marker) and, line for line, the answers a verifier checks."""

    def answers(self, name: str) -> list:
        path = self.folder / f"{name}.answers.jsonl"
        answers = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if len(answers) != self.meta["splits"][name]["prompts"]:
            raise CorpusError(f"{self.folder}: {name}.answers.jsonl and {name}.bin disagree")
        return answers

    def prompt(self, name: str, i: int) -> list[int]:
        """Prompt i's ids."""
        offsets = self.offsets(name)
        return self.split(name)[offsets[i] : offsets[i + 1]].astype(np.int64).tolist()

    def prompts(self, name: str) -> list[list[int]]:
        """Every prompt's ids, the split read once."""
        offsets, ids = self.offsets(name), self.split(name).astype(np.int64).tolist()
        return [ids[start:end] for start, end in zip(offsets[:-1], offsets[1:], strict=True)]


class PairData:
    """A folder written by `prepare_pairs`: its meta, tokenizer and splits."""

    def __init__(self, folder: str | Path, meta: dict[str, Any]) -> None:
        self.folder, self.meta = Path(folder), meta
        self.vocab_size: int = meta["vocab_size"]
        self.id_dtype = meta_id_dtype(meta)

    def split(self, name: str) -> Pairs:
        if name not in ("train", "val"):
            raise CorpusError(f"unknown split {name!r}; choose train or val")
        return Pairs(self.folder, name, self.id_dtype)

    def fingerprint(self) -> dict[str, Any]:
        """As `TokenData.fingerprint`: what a run records and a resume compares."""
        splits = self.meta["splits"]
        pairs = {name: splits[name]["pairs"] for name in splits}
        tokens = {name: splits[name]["src_tokens"] + splits[name]["tgt_tokens"] for name in splits}
        return fingerprint(self.folder, self.meta, pairs, tokens)
