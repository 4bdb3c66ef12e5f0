"""Corpus cleaning (J&M §10.9.2): each filter removes what it should, counts it, and keeps the rest.

Documents are generated from a seeded list of made-up words, so distinct documents (almost
surely) share no 5-gram and every overlap in a test is one the test planted.
"""

import random
import re
import string

import pytest

from tlm.data.clean import CleanConfig, Cleaner, non_text_fraction, shingles
from tlm.data.corpus import CorpusError

RNG = random.Random(0)
WORDS = sorted(
    {"".join(RNG.choices(string.ascii_lowercase, k=RNG.randint(3, 9))) for _ in range(3000)}
)
DOCS = [RNG.choices(WORDS, k=300) for _ in range(300)]  # 300 documents of 300 words


def jaccard(a: list[str], b: list[str], k: int = 5) -> float:
    """The exact Jaccard similarity of two documents' word k-gram sets."""
    A, B = set(shingles(a, k)), set(shingles(b, k))
    return len(A & B) / len(A | B)


def kept(cleaner: Cleaner, texts: list[str]) -> list[str]:
    return [t for t in texts if cleaner.keep(t)]


def test_exact_duplicates_differing_in_case_or_whitespace_are_removed():
    texts = [" ".join(d) for d in DOCS[:50]]
    first = texts[3].upper()  # this copy comes first, so it is the one kept
    stream = [first, *texts, texts[7].replace(" ", "\n\t  ") + "\n", texts[9]]
    cleaner = Cleaner(CleanConfig())
    assert kept(cleaner, stream) == [first, *texts[:3], *texts[4:]]
    # exact runs before near, so these are counted as exact duplicates
    assert cleaner.counts["exact_duplicates"] == 3
    assert cleaner.counts["near_duplicates"] == 0


def plant(doc: list[str], i: int) -> list[str]:
    """A near duplicate of `doc`: one of four small edits, none touching more than 8 shingles."""
    d = list(doc)
    edit = i % 4
    if edit == 0:  # one word replaced
        d[100] = "replaced"
    elif edit == 1:  # three words in a row replaced
        d[200:203] = ["three", "new", "words"]
    elif edit == 2:  # one word deleted
        del d[50]
    else:  # a few words appended
        d += ["and", "a", "short", "ending"]
    return d


def test_near_duplicates_are_removed_and_partial_overlaps_kept():
    distinct, planted, partial = DOCS[:200], [], []
    for i in range(40):
        planted.append(plant(distinct[5 * i], i))
        assert jaccard(distinct[5 * i], planted[-1]) > 0.95  # well above the 0.8 threshold
    for i in range(20):  # keep a quarter to three quarters of a document, the rest new
        n = 75 * (1 + i % 3)
        partial.append(DOCS[200 + i][:n] + DOCS[250 + i][n:])
        assert jaccard(DOCS[200 + i], partial[-1]) < 0.65
    originals = [DOCS[200 + i] for i in range(20)]
    stream = [" ".join(d) for d in distinct + originals + planted + partial]
    cleaner = Cleaner(CleanConfig(exact=False))
    assert kept(cleaner, stream) == stream[:220] + stream[260:]  # every planted one caught
    assert cleaner.counts["near_duplicates"] == 40


def test_deduplication_can_be_turned_off():
    text = " ".join(DOCS[0])
    stream = [text, text.upper(), " ".join(plant(DOCS[0], 0))]
    assert kept(Cleaner(CleanConfig(exact=False, near=False)), stream) == stream


def test_documents_shorter_than_a_shingle_are_one_shingle():
    cleaner = Cleaner(CleanConfig(exact=False))
    assert kept(cleaner, ["a b c", "A  b c", "a b d", "a b"]) == ["a b c", "a b d", "a b"]


def test_threshold_is_inclusive():
    """Estimated J equal to the threshold is a near duplicate; just below it is not.

    With 4 permutations at threshold 0.25, datasketch's LSH has 4 bands of 1 row, so a pair
    with one equal minimum is sure to be a candidate and the comparison alone decides.
    """
    a = "the quick brown fox jumps over the lazy dog"
    b = "the quick brown fox jumps over a lazy dog"  # J = 2/8; estimated 1/4 with seed 1
    for threshold, dropped in [(0.25, True), (0.26, False)]:
        cleaner = Cleaner(CleanConfig(exact=False, num_perm=4, threshold=threshold))
        assert cleaner.keep(a)
        assert cleaner.keep(b) is not dropped


def test_min_chars_counts_collapsed_whitespace():
    cleaner = Cleaner(CleanConfig(min_chars=10))
    stream = ["too short", "  a    b    c   ", "long enough", "0123456789"]
    assert kept(cleaner, stream) == ["long enough", "0123456789"]
    assert cleaner.counts["too_short"] == 2


def test_max_non_text_removes_binary_like_documents():
    prose = "“Quotes” — dashes… and (brackets); 42% of naïve Ελληνικά, русский: fine!"
    binary = "\x00\x01\ufffd■□▲◆\x7f\x1b" * 30 + "a few letters"
    mixed = "ok text " + "■" * 2  # 2 / 10 characters are not text
    assert non_text_fraction(prose) == 0
    assert non_text_fraction(mixed) == pytest.approx(0.2)
    assert non_text_fraction("") == 0
    cleaner = Cleaner(CleanConfig(max_non_text=0.2))
    assert kept(cleaner, [prose, binary, mixed]) == [prose, mixed]
    assert cleaner.counts["non_text"] == 1


def test_blocklist_matches_whole_words_case_insensitively(tmp_path):
    path = tmp_path / "blocklist.txt"
    path.write_text("# words we do not want\n\nclass\nbad phrase\nc++\n", encoding="utf-8")
    stream = [
        "a classic novel",
        "subclass it",
        "The CLASS met.",
        "a bad\n  phrase here",
        "written in C++, mostly",
        "# words we do not want",  # the comment line is no entry
        "a bad phrasebook",
    ]
    cleaner = Cleaner(CleanConfig(blocklist=str(path)))
    assert kept(cleaner, stream) == [stream[0], stream[1], stream[5], stream[6]]
    assert cleaner.counts["blocklisted"] == 3


def test_counts_add_up(tmp_path):
    path = tmp_path / "blocklist.txt"
    path.write_text("forbidden\n", encoding="utf-8")
    texts = [" ".join(d) for d in DOCS[:20]]
    stream = [
        *texts,
        "tiny",
        "■" * 50,
        "a forbidden word " + texts[0],
        texts[1].upper(),
        " ".join(plant(DOCS[2], 0)),
    ]
    cleaner = Cleaner(CleanConfig(min_chars=5, max_non_text=0.5, blocklist=str(path)))
    kept(cleaner, stream)
    counts = cleaner.counts
    assert counts == {
        "documents": 25,
        "kept": 20,
        "too_short": 1,
        "non_text": 1,
        "blocklisted": 1,
        "exact_duplicates": 1,
        "near_duplicates": 1,
    }
    assert sum(v for k, v in counts.items() if k != "documents") == counts["documents"]


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("threshold", 0.0, "--near-threshold"),
        ("threshold", 1.5, "--near-threshold"),
        ("num_perm", 0, "--num-perm"),
        ("shingle", 0, "--shingle"),
        ("min_chars", -1, "--min-chars"),
        ("max_non_text", 1.5, "--max-non-text"),
        ("max_non_text", -0.1, "--max-non-text"),
        ("seed", -1, "--minhash-seed"),
        ("blocklist", "no/such/file.txt", "--blocklist"),
    ],
)
def test_bad_config_names_the_flag(field, value, flag):
    with pytest.raises(CorpusError, match=re.escape(flag)):
        CleanConfig(**{field: value})


def test_threshold_too_high_for_lsh_names_the_flag():
    with pytest.raises(CorpusError, match="--near-threshold"):
        Cleaner(CleanConfig(threshold=0.99))
    Cleaner(CleanConfig(threshold=0.99, near=False))  # no LSH, no limit
