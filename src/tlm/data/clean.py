"""Corpus cleaning before pretraining: quality filters, then exact and near deduplication.

Pretraining corpora are filtered for quality and deduplicated before tokenization (J&M
§10.9.2): boilerplate, junk and repeated text waste training compute, and text seen many times
is memorized and regurgitated. The Pile (Gao et al., 2020) removed near duplicates from its web
components with MinHash LSH; datasketch and datatrove's MinHash stage are the usual tools for
it. `Cleaner.keep` decides one document at a time, in stream order, cheapest check first; the
first of a set of duplicates is kept:

    too_short         fewer than `min_chars` characters once runs of whitespace count as one
    non_text          more than `max_non_text` of its characters are not text (`non_text_fraction`)
    blocklisted       contains a word or phrase of the `blocklist` file, on word boundaries
    exact_duplicates  its normalized text (whitespace collapsed, lowercased) was seen before
    near_duplicates   it shares most of its word 5-grams with a document kept before

Near duplicates. A document is the set of its word `shingle`-grams. Two sets A, B are alike to
the degree of their Jaccard similarity J = |A ∩ B| / |A ∪ B|. MinHash (Broder, 1997) hashes each
set to `num_perm` minima under random permutations h_i, and P[min h_i(A) = min h_i(B)] = J, so
the fraction of equal minima estimates J (`MinHash.jaccard`). Comparing a document with every
earlier one is quadratic; locality-sensitive hashing cuts the signature into b bands of r rows
and makes a pair a candidate when any band matches, with probability 1 - (1 - J^r)^b: more
rows per band means fewer false candidates but more missed duplicates. datasketch picks b and r
for the threshold (at 0.8 with 128 permutations, b=9, r=13: a pair with J = 0.8 is a candidate
with probability 0.40, J = 0.9 with 0.93, J = 0.95 with 0.998, J = 0.5 with 0.001), so the
duplicates caught are mostly those well above the threshold. A candidate is a duplicate when its
estimated J >= `threshold`.

Memory grows with the documents: the exact filter holds a 16-byte BLAKE2b digest of each,
never its text (about 150 bytes with Python's set overhead); the near filter holds what
datasketch's LSH index holds (b band keys per kept document) and each kept document's signature
(`num_perm` uint32 values), about 4 KB per kept document at the defaults (tracemalloc, 200-word
documents).
"""

from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass
from pathlib import Path

from tlm.data.corpus import CorpusError

# text characters besides letters, digits and whitespace: ASCII punctuation and the typographic
# quotes, dashes and marks of ordinary prose
PUNCTUATION = frozenset(string.punctuation + "‘’‚“”„–—…«»‹›¡¿·•°§¶")
REASONS = ("too_short", "non_text", "blocklisted", "exact_duplicates", "near_duplicates")


@dataclass(frozen=True)
class CleanConfig:
    """Which filters run, with their settings; the flag `tlm prepare` gives each is in brackets.

    exact         drop documents whose normalized text was seen before
    near          drop near duplicates (MinHash LSH over word shingles)
    threshold     [--near-threshold] Jaccard similarity from which a document is a near duplicate
    num_perm      [--num-perm] MinHash permutations; more estimate J better and cost more
    shingle       [--shingle] words per shingle
    min_chars     [--min-chars] drop documents shorter than this
    max_non_text  [--max-non-text] drop documents with a larger fraction of non-text characters
    blocklist     [--blocklist] UTF-8 file, one word or phrase a line; blank and # lines ignored
    seed          [--minhash-seed] picks the MinHash permutations
    """

    exact: bool = True
    near: bool = True
    threshold: float = 0.8
    num_perm: int = 128
    shingle: int = 5
    min_chars: int = 0
    max_non_text: float = 1.0
    blocklist: str | None = None
    seed: int = 1

    def __post_init__(self) -> None:
        # flag: (valid, what is allowed, value given)
        checks = {
            "--near-threshold": (0 < self.threshold <= 1, "in (0, 1]", self.threshold),
            # datasketch's LSH needs at least 2 permutations
            "--num-perm": (self.num_perm >= 2, "at least 2", self.num_perm),
            "--shingle": (self.shingle > 0, "positive", self.shingle),
            "--min-chars": (self.min_chars >= 0, ">= 0", self.min_chars),
            "--max-non-text": (0 <= self.max_non_text <= 1, "in [0, 1]", self.max_non_text),
            # numpy's RandomState draws the permutations from this seed
            "--minhash-seed": (0 <= self.seed < 2**32, "in [0, 2**32)", self.seed),
        }
        for flag, (valid, allowed, value) in checks.items():
            if not valid:
                raise CorpusError(f"{flag} must be {allowed}, got {value}")
        if self.blocklist is not None and not Path(self.blocklist).is_file():
            raise CorpusError(f"--blocklist: no such file: {self.blocklist}")


def non_text_fraction(text: str) -> float:
    """Fraction of characters that are not text; 0 for an empty document.

    Text is letters and numbers of any script (`str.isalnum`: Unicode categories L and N),
    whitespace (`str.isspace`) and `PUNCTUATION`. Everything else is not: control characters,
    U+FFFD left by undecodable bytes, symbols, box drawing, emoji, private-use characters.
    """
    if not text:
        return 0.0
    junk = sum(1 for c in text if not (c.isalnum() or c.isspace() or c in PUNCTUATION))
    return junk / len(text)


def shingles(words: list[str], k: int) -> list[bytes]:
    """The document's word k-grams; a document of fewer than k words is one shingle."""
    if len(words) < k:
        return [" ".join(words).encode()]
    return [" ".join(words[i : i + k]).encode() for i in range(len(words) - k + 1)]


def read_blocklist(path: str | Path) -> re.Pattern[str] | None:
    """One pattern matching any listed word or phrase, case-insensitive, on word boundaries.

    Lookarounds rather than `\\b`, so that entries starting or ending with punctuation ("c++")
    still match; the words of a phrase may be separated by any whitespace.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"--blocklist: cannot read {path}: {e}") from None
    entries = [s for s in map(str.strip, lines) if s and not s.startswith("#")]
    if not entries:
        return None
    alternatives = "|".join(r"\s+".join(map(re.escape, entry.split())) for entry in entries)
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)


class Cleaner:
    """Decides, document by document, what a corpus keeps; `counts` says why the rest went.

    Reads the blocklist file once, here. Not thread-safe: `keep` updates the indexes.
    """

    def __init__(self, config: CleanConfig) -> None:
        # imported here: datasketch takes ~0.5 s to import (scipy), which no other command needs
        from datasketch import LeanMinHash, MinHash, MinHashLSH

        self.config = config
        self._lean = LeanMinHash
        self._blocklist = read_blocklist(config.blocklist) if config.blocklist else None
        self._digests: set[bytes] = set()
        self._signatures: list = []  # LeanMinHash of kept documents; position = LSH key
        self._lsh = None
        if config.near:
            try:
                self._lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
            except ValueError as e:  # a threshold so high that datasketch picks one band
                raise CorpusError(
                    f"--near-threshold {config.threshold} is too high for --num-perm "
                    f"{config.num_perm} ({e}); exact deduplication removes identical documents"
                ) from None
        # copying an empty MinHash reuses its permutations, drawn once from the seed
        self._empty = MinHash(num_perm=config.num_perm, seed=config.seed)
        self._counts = dict.fromkeys(("documents", "kept", *REASONS), 0)

    @property
    def counts(self) -> dict[str, int]:
        """Documents seen and kept, and how many each filter removed; they add up."""
        return dict(self._counts)

    def keep(self, text: str) -> bool:
        """True if the document stays; of a set of duplicates, the first one seen stays."""
        reason = self._reason_to_drop(text)
        self._counts["documents"] += 1
        self._counts[reason or "kept"] += 1
        return reason is None

    def _reason_to_drop(self, text: str) -> str | None:
        config = self.config
        collapsed = " ".join(text.split())
        if len(collapsed) < config.min_chars:
            return "too_short"
        if non_text_fraction(text) > config.max_non_text:
            return "non_text"
        if self._blocklist is not None and self._blocklist.search(text):
            return "blocklisted"
        normalized = collapsed.lower()
        if config.exact:
            digest = hashlib.blake2b(normalized.encode(), digest_size=16).digest()
            if digest in self._digests:
                return "exact_duplicates"
            self._digests.add(digest)
        if config.near and self._near_duplicate(normalized):
            return "near_duplicates"
        return None

    def _near_duplicate(self, normalized: str) -> bool:
        """True if a kept document is a near duplicate; if none is, index this one as kept."""
        minhash = self._empty.copy()
        minhash.update_batch(shingles(normalized.split(), self.config.shingle))
        for key in self._lsh.query(minhash):
            if minhash.jaccard(self._signatures[key]) >= self.config.threshold:
                return True
        self._lsh.insert(len(self._signatures), minhash)
        self._signatures.append(self._lean(minhash))
        return False
