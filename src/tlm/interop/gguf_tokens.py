"""tlm's tokenizers as llama.cpp's `gpt2` tokenizer model (GGUF's `tokenizer.ggml.*` keys),
and back.

llama.cpp's `gpt2` model is a byte-level BPE: text is split by GPT-2's pattern (`pre`
"gpt-2"), each piece's UTF-8 bytes are spelled with one printable character per byte
(`BYTE_CHARS`), and the merges are applied by rank. tlm's BPE is exactly that scheme, so
its tokens and merges go over as they are.

A character tokenizer goes over too: each character becomes the byte-level spelling of its
UTF-8 bytes, and a character of several bytes gets the merges that join its bytes back
(rank order: the first two bytes, then that pair with the third, ...). Pieces never cross
a character, so every text the character tokenizer encodes is encoded to the same ids. The
intermediate pieces are not tokens: llama.cpp looks a piece up only once no merge applies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tlm.chat import END, speaks
from tlm.errors import UserError
from tlm.tokenizer import (
    BYTE_CHARS,
    CHAR_BYTES,
    EOT,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    TokenizerError,
)


class GGUFError(UserError):
    """A model GGUF cannot express, or a GGUF file tlm cannot read."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError("GGUF needs the gguf package: pip install 'tlm[gguf]'") from None
    return gguf


def open_gguf(path: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    """(the gguf module, a reader of `path`, its key-value fields as Python values)."""
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise GGUFError(f"cannot read {path} as GGUF: {exc}") from None
    return gguf, reader, {name: field.contents() for name, field in reader.fields.items()}


def read_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file (`tokenizer.ggml.*`), without reading its tensors."""
    return tokenizer_of(open_gguf(path)[2], path)


def tokenizer_of(fields: dict[str, Any], path: str | Path) -> Tokenizer:
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2" or "tokenizer.ggml.tokens" not in fields:
        raise GGUFError(f"{path}: tokenizer model {model!r}: tlm reads llama.cpp's gpt2 (BPE)")
    tokens = fields["tokenizer.ggml.tokens"]
    return tokenizer_from_fields(
        tokens,
        fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens),
        fields.get("tokenizer.ggml.merges", []),
        fields.get("tlm.tokenizer", "bpe"),
    )


NORMAL, CONTROL, UNUSED = 1, 3, 5  # llama.cpp's token types


def spelled(text: str) -> str:
    """`text` as byte-level BPE spells it: one alphabet character per UTF-8 byte."""
    return "".join(BYTE_CHARS[b] for b in text.encode("utf-8"))


def unspelled(token: str) -> str:
    """A byte-level token back to its text (a character tokenizer's tokens are whole)."""
    return bytes(CHAR_BYTES[c] for c in token).decode("utf-8")


def vocab_fields(tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """The `tokenizer.ggml.*` values for `tokenizer` in a model of `vocab_size` rows: tokens
    and their types (special tokens are llama.cpp's control tokens; rows past the
    tokenizer's are unused padding), merges, the end-of-text id (bos, and eos unless the run
    is made for chat: then `<|end|>` is eos and eot), and tlm's own kind so a reader
    rebuilds the same tokenizer."""
    if isinstance(tokenizer, CharTokenizer):
        spellings = [spelled(c) for c in tokenizer.chars]
        tokens, specials = spellings + tokenizer.specials, set(tokenizer.specials)
        merges = []
        for token in spellings:
            for end in range(2, len(token) + 1):  # join a character's bytes, left to right
                merges.append(f"{token[: end - 1]} {token[end - 1]}")
        merges = list(dict.fromkeys(merges))  # characters that share their first bytes
    else:
        by_id = {i: t for t, i in tokenizer.tokenizer.get_vocab(with_added_tokens=True).items()}
        tokens = [by_id[i] for i in range(tokenizer.vocab_size)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in _bpe_model(tokenizer)["merges"]]
        specials = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values()}
    types = [CONTROL if t in specials else NORMAL for t in tokens]  # <|endoftext|>, <|end|>...
    padding = vocab_size - len(tokens)
    return {
        "tokens": tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab_size)],
        "types": types + [UNUSED] * padding,
        "merges": merges,
        "eot_id": tokenizer.eot_id,
        "end_id": tokenizer.special_id(END) if speaks(tokenizer) else None,  # a chat run's
        "kind": tokenizer.kind,
    }


def _bpe_model(tokenizer: BPETokenizer) -> dict[str, Any]:
    data = json.loads(tokenizer.to_json())
    if not isinstance(tokenizer.tokenizer.decoder, decoders.ByteLevel):
        raise TokenizerError(
            "llama.cpp's gpt2 tokenizer is byte-level: this BPE vocabulary is not "
            "(a character run exported through tlm export-hf); export the run itself"
        )
    return data["model"]


def tokenizer_from_fields(
    tokens: list[str], types: list[int], merges: list[str], kind: str
) -> Tokenizer:
    """The tokenizer GGUF's fields describe: tlm's character tokenizer when `kind` is "char",
    else the byte-level BPE of `tokens` and `merges` (padding rows dropped)."""
    used = [t for t, kind_of in zip(tokens, types, strict=True) if kind_of != UNUSED]
    if kind == "char":
        if EOT not in used:
            raise TokenizerError(f"a character vocabulary ends with {EOT} and its specials")
        first = used.index(EOT)  # the characters, then <|endoftext|> and any other specials
        return CharTokenizer((unspelled(t) for t in used[:first]), used[first + 1 :])
    vocab = {t: i for i, t in enumerate(used)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = [t for t, kind_of in zip(tokens, types, strict=False) if kind_of == CONTROL]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return BPETokenizer(hf)
