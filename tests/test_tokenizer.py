import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tlm.data.corpus import Source
from tlm.tokenizer import (
    EOT,
    BPETokenizer,
    CharTokenizer,
    TextStream,
    TokenizerError,
    load_tokenizer,
    train_tokenizer,
)

PYTHON_DOCS = [p.text for p in Source("python-docs", None).pieces()]
UNICODE = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer("bpe", PYTHON_DOCS[:30], vocab_size=600)


@pytest.fixture(scope="module")
def char():
    return train_tokenizer("char", ["hello world\n", "ünïcode ✓ 漢字"])


def test_bpe_has_the_asked_vocabulary_and_eot(bpe):
    assert bpe.vocab_size == 600
    assert bpe.decode([bpe.eot_id]) == EOT
    assert bpe.encode(EOT) == [bpe.eot_id]


@settings(max_examples=200, deadline=None)
@given(text=UNICODE)
def test_bpe_round_trips_any_unicode(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    if EOT not in text:  # a literal <|endoftext|> becomes the separator, which spells no bytes
        assert bpe.token_bytes()[ids].sum() == len(text.encode("utf-8"))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_char_round_trips_its_alphabet(char, data):
    text = data.draw(st.text(st.sampled_from(char.chars), max_size=200))
    ids = char.encode(text)
    assert char.decode(ids) == text
    assert char.token_bytes()[ids].sum() == len(text.encode("utf-8"))


def test_char_ids_are_sorted_characters_then_eot(char):
    assert char.chars == sorted(char.chars)
    assert char.encode("e") == [char.chars.index("e")]
    assert char.eot_id == len(char.chars) == char.vocab_size - 1
    assert char.decode([char.eot_id]) == EOT
    assert char.encode(f"e{EOT}e") == [*char.encode("e"), char.eot_id, *char.encode("e")]


def test_char_refuses_unknown_characters(char):
    with pytest.raises(TokenizerError, match="'Z'"):
        char.encode("hello Z")


@pytest.mark.parametrize("name", ["bpe", "char"])
def test_save_and_load_one_tokenizer_json(tmp_path, request, name):
    tok = request.getfixturevalue(name)
    tok.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path)  # a folder holding tokenizer.json
    assert type(loaded) is type(tok)
    text = "hello world" if name == "char" else "def f(x):\n    return x ✓"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.eot_id == tok.eot_id and loaded.vocab_size == tok.vocab_size


def test_bpe_vocab_the_corpus_cannot_fill():
    with pytest.raises(TokenizerError, match="more than this corpus can fill"):
        train_tokenizer("bpe", ["tiny corpus"], vocab_size=5000)


def test_unknown_kind_and_bad_files(tmp_path):
    with pytest.raises(TokenizerError, match="unknown tokenizer 'wordpiece'"):
        train_tokenizer("wordpiece", ["x"])
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        load_tokenizer(tmp_path)


def test_char_vocab_size_is_the_corpus_alphabet():
    with pytest.raises(TokenizerError, match="applies to bpe"):
        train_tokenizer("char", ["abc"], vocab_size=10)
    assert isinstance(train_tokenizer("char", ["abc"]), CharTokenizer)
    assert isinstance(train_tokenizer("bpe", PYTHON_DOCS[:5], vocab_size=300), BPETokenizer)


def test_text_stream_never_splits_a_character(bpe):
    text = "naïve ✓ 漢字 done"
    ids = bpe.encode(text)
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # single tokens carry partial bytes
    stream = TextStream(bpe)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_text_stream_decodes_only_the_tokens_since_its_last_text(bpe):
    text = " ".join(["naïve ✓ 漢字 done"] * 30)
    ids = bpe.encode(text)
    lengths = []
    decode = bpe.decode
    bpe.decode = lambda part: lengths.append(len(part)) or decode(part)
    try:
        stream = TextStream(bpe)
        pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    finally:
        del bpe.decode
    assert "".join(pieces) == text and len(ids) > 100
    assert max(lengths) <= 8  # a few pending tokens, never the whole output
