"""Translation pairs: reading two aligned files, packing them, batching by token count."""

import gzip
import json

import numpy as np
import pytest

from tlm.data import CorpusError, TokenData, open_data, prepare_pairs
from tlm.data.pairs import read_pairs, token_batches
from tlm.tokenizer import load_tokenizer

EN = ["A man rides a bike.", "Two dogs play.", "", "A girl reads a book.", "The sun is up."]
DE = ["Ein Mann fährt Rad.", "Zwei Hunde spielen.", "Leer.", "Ein Mädchen liest.", "Sonne."]


def write(path, lines, gz=False):
    text = "".join(f"{line}\n" for line in lines)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_pairs_keep_their_alignment_and_empty_sides_are_counted(tmp_path):
    src, tgt = write(tmp_path / "a.en", EN), write(tmp_path / "a.de.gz", DE, gz=True)
    sources, targets, skipped = read_pairs(src, tgt)
    assert skipped == 1  # line 3 has no English
    assert sources == [EN[i] for i in (0, 1, 3, 4)] and targets == [DE[i] for i in (0, 1, 3, 4)]


def test_files_of_different_lengths_name_where_they_diverge(tmp_path):
    src, tgt = write(tmp_path / "a.en", EN), write(tmp_path / "a.de", DE[:3])
    with pytest.raises(CorpusError, match=r"a.en has more lines than .*a.de: .* diverge at line 4"):
        read_pairs(src, tgt)
    with pytest.raises(CorpusError, match=r"a.de has more lines than .*b.en: .* at line 3"):
        read_pairs(tgt.with_name("a.de"), write(tmp_path / "b.en", EN[:2]))


def test_prepared_pairs_decode_to_their_lines(tmp_path):
    src, tgt = write(tmp_path / "a.en", EN * 20), write(tmp_path / "a.de", DE * 20)
    meta = prepare_pairs(str(src), str(tgt), tmp_path / "data", val_fraction=0.1, vocab_size=300)
    assert meta["task"] == "translate" and meta["splits"]["train"]["skipped_empty"] == 20
    assert meta["splits"]["train"]["pairs"] + meta["splits"]["val"]["pairs"] == 80
    data = open_data(tmp_path / "data")
    tok = load_tokenizer(tmp_path / "data")
    train = data.split("train")
    kept = [i for i in range(100) if EN[i % 5]]
    for n in (0, 1, 2, 3, 10):
        i = kept[n]
        assert tok.decode(train.sentence("src", n)) == EN[i % 5] + "<|endoftext|>"
        assert tok.decode(train.sentence("tgt", n)) == DE[i % 5] + "<|endoftext|>"
    assert train.lengths("src").sum() == meta["splits"]["train"]["src_tokens"]
    with pytest.raises(CorpusError, match="holds sentence pairs"):
        TokenData(tmp_path / "data")
    old = {k if k != "id_dtype" else "dtype": v for k, v in meta.items()}  # an older folder
    (tmp_path / "data" / "meta.json").write_text(json.dumps(old))
    again = open_data(tmp_path / "data").split("train")
    assert again.sentence("tgt", 10).tolist() == train.sentence("tgt", 10).tolist()


def test_token_batches_hold_every_pair_once_within_the_budget():
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 40, 500), rng.integers(1, 40, 500)
    batches = token_batches(src, tgt, max_tokens=200, seed=3)
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))
    for b in batches:
        assert max(src[b].max(), tgt[b].max()) * len(b) <= 200
    again = token_batches(src, tgt, max_tokens=200, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again, strict=True))
    other = token_batches(src, tgt, max_tokens=200, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(batches, other, strict=False))
    lonely = token_batches(np.array([300, 2]), np.array([5, 2]), max_tokens=200)
    assert [b.tolist() for b in lonely] == [[1], [0]]  # too long for any batch: alone
