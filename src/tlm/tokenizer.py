"""Tokenizers: byte-level BPE (trained with the `tokenizers` library) and characters.

Both save to and load from one `tokenizer.json` and share one interface: `encode(str) ->
list[int]`, `decode(list[int]) -> str`, `eot_id`, `vocab_size`, `token_bytes()` (the UTF-8
length of each token, for bits per byte) and `pieces()` (the bytes each token writes, for
constrained decoding). `<|endoftext|>` separates documents. Special tokens beyond it (the
chat template's role markers, `tlm/chat.py`) are added with `with_specials`; a special
token's name in a text encodes as that token, and it writes no text of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from tlm.errors import UserError
from tlm.io import write_text_atomic

EOT = "<|endoftext|>"
ENCODER_SPECIALS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")  # a bidirectional encoder's (BERT's)
KINDS = ("bpe", "char")


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable Latin-1 bytes stand for themselves, the
    others (control bytes, space, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


BYTE_CHARS = _byte_chars()
CHAR_BYTES = {c: b for b, c in enumerate(BYTE_CHARS)}


class TokenizerError(UserError):
    """A tokenizer that cannot be built or loaded, or text it cannot encode."""


class InputTooLong(TokenizerError):
    """A text with more tokens than the model reads at once."""


def within(ids: list[int], limit: int | None, name: str) -> list[int]:
    """`ids` if the model reads them whole. The one policy of every command for a longer
    input: it is refused, naming it, never cut short without a word."""
    if limit is not None and len(ids) > limit:
        raise InputTooLong(f"{name} has {len(ids)} tokens; the model reads at most {limit}")
    return ids


def document_ids(
    tokenizer: Tokenizer, text: str, limit: int | None = None, name: str = "the text"
) -> list[int]:
    """A document's ids as `prepare` wrote them for training: <|endoftext|>, then the text's
    tokens (so an empty text is a valid start); refused past `limit` tokens (`within`)."""
    return within([tokenizer.eot_id, *tokenizer.encode(text)], limit, name)


class CharTokenizer:
    """One id per character of the training corpus (sorted), then `<|endoftext|>`, then
    any other special tokens in the order they were added.

    Encoding a character the corpus never contained is an error: a character model has
    no way to spell it.
    """

    kind = "char"

    def __init__(self, chars: Iterable[str], specials: Iterable[str] = ()) -> None:
        self.chars = sorted(set(chars))
        self.eot_id = len(self.chars)
        self.specials = [EOT, *(s for s in specials if s != EOT)]  # ids eot_id, eot_id + 1, ...
        self.vocab_size = len(self.chars) + len(self.specials)
        self._codepoints = np.array([ord(c) for c in self.chars], dtype=np.int64)

    @classmethod
    def train(cls, texts: Iterable[str]) -> CharTokenizer:
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        if not seen:
            raise TokenizerError("corpus is empty: no characters to build a vocabulary from")
        return cls(seen)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Vectorised encode: code points -> positions in the sorted alphabet.

        A special token's name (`<|endoftext|>`, ...) is that token, as in the byte-level
        BPE tokenizer."""
        for i, name in enumerate(self.specials):
            if name in text:
                parts = [self.encode_array(part) for part in text.split(name)]
                special = np.array([self.eot_id + i], dtype=np.int64)
                return np.concatenate([p for part in parts for p in (special, part)][1:])
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.searchsorted(self._codepoints, points)
        ids = np.minimum(ids, len(self.chars) - 1)
        unknown = self._codepoints[ids] != points
        if unknown.any():
            bad = chr(points[np.argmax(unknown)])
            raise TokenizerError(f"character {bad!r} is not in the tokenizer's vocabulary")
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        n = len(self.chars)
        return "".join(self.chars[i] if i < n else self.specials[i - n] for i in ids)

    def special_id(self, name: str) -> int | None:
        """The id of special token `name`, or None if this vocabulary lacks it."""
        return self.eot_id + self.specials.index(name) if name in self.specials else None

    def token_bytes(self) -> np.ndarray:
        lengths = np.array([len(piece) for piece in self.pieces()], dtype=np.int64)
        lengths[self.eot_id :] = 0  # special tokens write no text
        return lengths

    def pieces(self) -> list[bytes]:
        """The UTF-8 bytes of each token; a special token (not text) as its name."""
        return [c.encode("utf-8") for c in self.chars] + [s.encode() for s in self.specials]

    def to_json(self) -> str:
        data = {"type": "char", "chars": "".join(self.chars), "eot": EOT}
        return json.dumps(data | ({"specials": self.specials[1:]} if self.specials[1:] else {}))

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())


class BPETokenizer:
    """Byte-level BPE (GPT-2's scheme): any Unicode string round-trips exactly."""

    kind = "bpe"

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        eot_id = tokenizer.token_to_id(EOT)
        if eot_id is None:
            raise TokenizerError(f"tokenizer has no {EOT} token")
        self.eot_id = eot_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        if vocab_size < 257:
            raise TokenizerError(f"BPE vocab size must be at least 257 (256 bytes + {EOT})")
        tokenizer = HFTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        made = tokenizer.get_vocab_size(with_added_tokens=True)
        if made < vocab_size:
            raise TokenizerError(
                f"vocab size {vocab_size} is more than this corpus can fill: BPE found only "
                f"{made} tokens; use --vocab-size {made} or less, or a larger corpus"
            )
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def special_id(self, name: str) -> int | None:
        """The id of special token `name`, or None if this vocabulary lacks it."""
        added = self.tokenizer.get_added_tokens_decoder()
        return next((i for i, t in added.items() if t.content == name and t.special), None)

    def token_bytes(self) -> np.ndarray:
        """Bytes per token (the length of its `pieces`); specials 0."""
        lengths = np.array([len(piece) for piece in self.pieces()], dtype=np.int64)
        lengths[list(self.tokenizer.get_added_tokens_decoder())] = 0  # keyed by id
        return lengths

    def pieces(self) -> list[bytes]:
        """The bytes each token writes (a byte-level token spells one byte per character;
        any other vocabulary, a character one exported through `tlm export-hf`, is text);
        a special token (not text) as its name."""
        byte_level = isinstance(self.tokenizer.decoder, decoders.ByteLevel)
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        pieces = [b""] * self.vocab_size
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if byte_level and token not in special:
                pieces[i] = bytes(CHAR_BYTES[c] for c in token)
            else:
                pieces[i] = token.encode("utf-8")
        return pieces

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())


Tokenizer = CharTokenizer | BPETokenizer


def encoder_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` with an encoder's special tokens (J&M §11.2): [CLS] opens every input,
    [SEP] ends each sentence, [MASK] stands for a hidden token, [PAD] fills a short row.
    A byte-level BPE's [MASK] takes the whitespace before it (as RoBERTa's `<mask>` does):
    a masked word was one token with its space, so "the [MASK] of" reads as it trained."""
    return with_specials(tokenizer, ENCODER_SPECIALS, lstrip=("[MASK]",))


def with_specials(
    tokenizer: Tokenizer, names: Iterable[str], lstrip: Iterable[str] = ()
) -> Tokenizer:
    """A copy of `tokenizer` that has every special token in `names` (those it lacks get
    the next ids, in order); the ids of every token it had stay as they were. A BPE's
    tokens in `lstrip` absorb the whitespace before them in a text."""
    missing = [n for n in dict.fromkeys(names) if tokenizer.special_id(n) is None]
    if not missing:
        return tokenizer
    if isinstance(tokenizer, CharTokenizer):
        return CharTokenizer(tokenizer.chars, [*tokenizer.specials, *missing])
    copy = HFTokenizer.from_str(tokenizer.to_json())
    copy.add_special_tokens(
        [AddedToken(n, special=True, normalized=False, lstrip=n in lstrip) for n in missing]
    )
    return BPETokenizer(copy)


class TextStream:
    """Token ids arriving one by one -> text, holding back a partly generated character.

    A byte-level token may carry only some bytes of a UTF-8 character; decoding tokens one
    at a time would print replacement characters. `push` returns only text that is final.
    Each push decodes only the tokens since the last text it gave (and the push before, as
    context for decoders that look at neighbours), never the whole output again.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids = tokenizer, []
        self.prefix = self.read = 0  # ids[prefix:read] were shown; ids[read:] are pending

    def push(self, ids: Iterable[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd"):  # the rest of a multi-byte character is still to come
            return ""
        return self._take(text)

    def flush(self) -> str:
        return self._take(self.tokenizer.decode(self.ids[self.prefix :]))

    def _take(self, text: str) -> str:
        shown = len(self.tokenizer.decode(self.ids[self.prefix : self.read]))
        self.prefix, self.read = self.read, len(self.ids)
        return text[shown:]


def train_tokenizer(
    kind: str, texts: Iterable[str], vocab_size: int | None = None, length: int | None = None
) -> Tokenizer:
    """Train a tokenizer of `kind` ("bpe" or "char") on an iterator of texts."""
    if kind == "char":
        if vocab_size is not None:
            raise TokenizerError("--vocab-size applies to bpe; a char vocabulary is the corpus's")
        return CharTokenizer.train(texts)
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size or 4096)
    raise TokenizerError(f"unknown tokenizer {kind!r}; choose one of {', '.join(KINDS)}")


def tokenizer_from_json(text: str) -> Tokenizer:
    data = json.loads(text)
    if data.get("type") == "char":
        return CharTokenizer(data["chars"], data.get("specials", ()))
    return BPETokenizer(HFTokenizer.from_str(text))


def gpt2_tokenizer(vocab: Path, merges: Path) -> BPETokenizer:
    """GPT-2's original files (`vocab.json` + `merges.txt`) -> the same byte-level BPE.

    The pieces are those GPT-2's tokenizer has always used: byte-level pre-tokenization
    without a prefix space, byte-level decoding, and `<|endoftext|>` as a special token.
    """
    try:
        tokenizer = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as exc:  # the tokenizers library's own parse errors
        raise TokenizerError(f"cannot read the GPT-2 tokenizer in {merges.parent}: {exc}") from None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    return BPETokenizer(tokenizer)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` from a file, a run directory, a prepared data directory or a
    Hugging Face directory (whose GPT-2 tokenizer may be `vocab.json` + `merges.txt`).
    `tlm.load_tokenizer` also reads a GGUF file's vocabulary."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if path.is_dir() and not file.is_file() and (path / "merges.txt").is_file():
        return gpt2_tokenizer(path / "vocab.json", path / "merges.txt")
    if not file.is_file():
        raise TokenizerError(f"no tokenizer at {path} (expected {file})")
    try:
        return tokenizer_from_json(file.read_text(encoding="utf-8"))
    except TokenizerError:
        raise
    except Exception as exc:  # json, KeyError, or the tokenizers library's own errors
        raise TokenizerError(f"{file} is not a tokenizer.json tlm can read: {exc}") from None
