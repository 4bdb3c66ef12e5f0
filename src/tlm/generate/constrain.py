"""Structured outputs: decoding held to a grammar (a JSON schema, a regular expression or a
Lark grammar).

At every step the grammar's matcher says which tokens can continue a valid output; the
others get logit -inf before anything else touches the logits (step 0 of
`sampling.choose`), so greedy decoding, sampling, top-k and top-p all choose among valid
tokens only, and the chosen token advances the matcher. Once the output is complete the
only valid token is `<|endoftext|>`, so a row ends by itself; a row cut by `max_new_tokens`
ends with finish reason "length". The log-probability reported for a token stays the
model's own, before the mask.

The matching itself is llguidance's (the `structured` extra: `pip install
'tlm[structured]'`), chosen by measurement (docs/benchmarks-history.md, `bench/structured.py`):
of llguidance, xgrammar and outlines-core it was the only one whose outputs of random
walks all validated, at 0.15-0.25 ms per masked row over a 50,257-token vocabulary. JSON is
written compact (no whitespace between its tokens); `maxLength`, `minimum`/`maximum`,
`maxItems` and `enum` are enforced, so a schema whose values are bounded in length (strings
with maxLength, integers with bounds, enums, arrays with maxItems) always finishes; a
`number` can take any count of fraction digits, so it is not bounded in length.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tlm.generate.errors import GenerationError
from tlm.tokenizer import Tokenizer

KINDS = ("json_schema", "regex", "lark")
EXTRA = "structured outputs need llguidance: pip install 'tlm[structured]'"


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GenerationError(EXTRA) from None
    return llguidance


class Grammar:
    """What a valid output is, over one tokenizer's vocabulary. A `GenerationConfig`
    setting (`grammar=`); every row decoded with it gets its own `Matcher` (`start`)."""

    def __init__(self, kind: str, source: str, tokenizer: Tokenizer) -> None:
        if kind not in KINDS:
            raise GenerationError(f"a grammar is one of {', '.join(KINDS)}, got {kind!r}")
        ll = _llguidance()
        self.kind, self.source, self.eos_id = kind, source, tokenizer.eot_id
        self.vocab_size = tokenizer.vocab_size
        if kind == "json_schema":
            # compact JSON: no whitespace between tokens, unless the schema's own
            # x-guidance options ask for it
            text = ll.LLMatcher.grammar_from_json_schema(
                source, defaults={"whitespace_flexible": False}
            )
        elif kind == "regex":
            text = ll.LLMatcher.grammar_from_regex(source)
        else:
            text = ll.LLMatcher.grammar_from_lark(source)
        self._first = ll.LLMatcher(_ll_tokenizer(tokenizer), text, log_level=0)
        if self._first.is_error():
            raise GenerationError(f"invalid {kind.replace('_', ' ')}: {_line(self._first)}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | None, tokenizer: Tokenizer) -> Grammar:
        """Outputs that are JSON valid against `schema` (a dict or its text); None: any JSON
        object (OpenAI's `json_object` format)."""
        if schema is None:
            schema = {"type": "object"}
        return cls(
            "json_schema", schema if isinstance(schema, str) else json.dumps(schema), tokenizer
        )

    @classmethod
    def regex(cls, pattern: str, tokenizer: Tokenizer) -> Grammar:
        """Outputs that match `pattern` whole (Rust regex syntax, as Python's for the usual)."""
        return cls("regex", pattern, tokenizer)

    @classmethod
    def lark(cls, grammar: str, tokenizer: Tokenizer) -> Grammar:
        """Outputs of a context-free grammar in Lark's notation (its rule `start`)."""
        return cls("lark", grammar, tokenizer)

    def start(self) -> Matcher:
        """A matcher at the start of an output (a copy: the grammar is compiled once)."""
        return Matcher(self._first.deep_copy(), self.vocab_size)

    def __repr__(self) -> str:
        return f"Grammar.{self.kind}({self.source[:60]!r})"


class Matcher:
    """Where one row's output stands in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self, size: int) -> Tensor:
        """[size] bool: the tokens that can come next (ids past the tokenizer's vocabulary,
        a model's padding rows, never can). A model with fewer rows than the tokenizer has
        tokens cannot be held to the grammar: an error."""
        if size < self.vocab_size:
            raise GenerationError(
                f"the grammar's tokenizer has {self.vocab_size} tokens; the model has {size}"
            )
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        # numpy, not torch: torch would hand each of these small [V] operations to its
        # thread pool, which on a busy host waits milliseconds for a core (bench/structured.py)
        allowed = np.zeros(size, dtype=bool)
        known = self.vocab_size
        allowed[:known] = np.unpackbits(self.words.view(np.uint8), count=known, bitorder="little")
        if self.matcher.is_error() or not allowed.any():
            raise GenerationError(NO_TOKEN if not allowed.any() else _failed(self.matcher))
        return torch.from_numpy(allowed)

    def accept(self, token: int) -> None:
        """Advance past `token` (one the mask allowed; llguidance refuses any other)."""
        if not self.matcher.consume_token(token):
            raise GenerationError(_failed(self.matcher))


NO_TOKEN = "structured output: no token of this vocabulary can continue the output"


def _failed(matcher) -> str:
    """The error of a matcher that failed mid-output: its vocabulary cannot write what the
    grammar needs next (a character vocabulary without "{"), or llguidance's own report."""
    return f"structured output failed (can the vocabulary spell the grammar?): {_line(matcher)}"


def _line(matcher) -> str:
    """llguidance's error (a parser's report, several lines) as one line."""
    report = matcher.get_error().split("<state>")[0]  # not the parser's state and grammar
    lines = [line.strip() for line in report.splitlines()]
    return " ".join(line for line in lines if line and not re.match(r"\^|\d* *\|", line))


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Tokenizer):
    """llguidance's view of a tlm tokenizer: each token's bytes, the end token, and the
    tokenizer itself for text the grammar holds literally. Built once per tokenizer."""
    ll = _llguidance()
    known = set(getattr(tokenizer, "chars", ()))

    class Wrapped:
        eos_token_id, bos_token_id = tokenizer.eot_id, None
        tokens = tokenizer.pieces()
        special_token_ids = [tokenizer.eot_id]

        def __call__(self, text: bytes) -> list[int]:
            text = text.decode("utf-8", errors="replace")
            if tokenizer.kind == "char":  # a character it lacks cannot be written at all
                text = "".join(c for c in text if c in known)
            return tokenizer.encode(text)

    return ll.LLTokenizer(ll.TokenizerWrapper(Wrapped()))
