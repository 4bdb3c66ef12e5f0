"""The three structured-output libraries `bench/structured.py` compares, behind one shape:
`start()` a row's matcher, `allowed(rows)` the [B,V] bool of the tokens each row may take,
`accept(row, token)`. llguidance goes through tlm's own `Grammar` and `Matcher`; xgrammar
and outlines-core as their documentation shows, asked for compact JSON."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager

import numpy as np
import torch

from tlm.generate import GenerationError
from tlm.generate.constrain import Grammar


@contextmanager
def stderr_into(notes: list[str]):
    """What native code writes to stderr (fd 2) meanwhile, as lines added to `notes`
    (xgrammar's warnings), so that the table stays whole."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            said = file.read().decode(errors="replace").splitlines()
            notes += [line.split("Warning: ")[-1] for line in said if line.strip()]


def unpack(words: torch.Tensor, size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 bitmask (token i: bit i % 32 of word i // 32) -> [B,V] bool."""
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :size].astype(bool))


class Llguidance:
    """tlm's own path: `Grammar.json_schema` once, a `Matcher` per row, `Matcher.allowed`."""

    name = "llguidance"

    def __init__(self, schema: dict, tokenizer) -> None:
        self.grammar, self.size = Grammar.json_schema(schema, tokenizer), tokenizer.vocab_size

    def start(self):
        return self.grammar.start()

    def allowed(self, rows: list) -> torch.Tensor:
        return torch.stack([self._row(matcher) for matcher in rows])  # as `allowed_rows`

    def _row(self, matcher) -> torch.Tensor:
        try:
            return matcher.allowed(self.size)
        except GenerationError:  # no token can continue: the walk is stuck
            return torch.zeros(self.size, dtype=torch.bool)

    def accept(self, matcher, token: int) -> None:
        matcher.accept(token)


class XGrammar:
    """The vocabulary as raw bytes, one `GrammarMatcher` per row, the batch's bitmask filled
    by `BatchGrammarMatcher` (as many threads as torch's)."""

    name = "xgrammar"

    def __init__(self, schema: dict, tokenizer) -> None:
        import xgrammar as xg

        self.xg, self.size, threads = xg, tokenizer.vocab_size, torch.get_num_threads()
        info = xg.TokenizerInfo(
            tokenizer.pieces(), xg.VocabType.RAW, vocab_size=self.size,
            stop_token_ids=[tokenizer.eot_id],
        )  # fmt: skip
        compiler = xg.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        self.batch = xg.BatchGrammarMatcher(max_threads=threads)

    def start(self):
        return self.xg.GrammarMatcher(self.compiled)

    def allowed(self, rows: list) -> torch.Tensor:
        words = self.xg.allocate_token_bitmask(len(rows), self.size)
        if len(rows) == 1:
            rows[0].fill_next_token_bitmask(words, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(rows, words)
        return unpack(words, self.size)

    def accept(self, matcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise ValueError(f"xgrammar refused token {token}")


class OutlinesCore:
    """The schema as one regular expression (no whitespace between tokens), its `Index`
    over the vocabulary (bytes -> token ids, the end token apart), one `Guide` per row."""

    name = "outlines-core"

    def __init__(self, schema: dict, tokenizer) -> None:
        import outlines_core

        self.oc, self.size, eos = outlines_core, tokenizer.vocab_size, tokenizer.eot_id
        ids: dict[bytes, list[int]] = {}
        for i, piece in enumerate(tokenizer.pieces()):
            if i != eos:
                ids.setdefault(piece, []).append(i)
        build = outlines_core.json_schema.build_regex_from_schema
        regex = build(json.dumps(schema), whitespace_pattern="")
        self.index = outlines_core.Index(regex, outlines_core.Vocabulary(eos, ids))

    def start(self):
        return self.oc.Guide(self.index)

    def allowed(self, rows: list) -> torch.Tensor:
        words = torch.zeros(len(rows), (self.size + 31) // 32, dtype=torch.int32)
        for r, guide in enumerate(rows):
            guide.write_mask_into(words[r].data_ptr(), words.shape[1], 4)
        return unpack(words, self.size)

    def accept(self, guide, token: int) -> None:
        guide.advance(token)
