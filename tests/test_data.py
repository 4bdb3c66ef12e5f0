import hashlib
import json

import numpy as np
import pytest
import torch

from tlm.cli import main
from tlm.data import (
    CorpusError,
    TokenData,
    batch_generator,
    count_eval_chunks,
    document_starts,
    eval_windows,
    prepare,
    random_windows,
    resolve_sources,
    step_starts,
)
from tlm.data import corpus as corpus_module
from tlm.data import encode as encode_module
from tlm.data.tokens import id_dtype
from tlm.tokenizer import load_tokenizer
from tlm.train.report import _cleaning


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("first document\nwith two lines\n")
    (folder / "sub" / "b.txt").write_text("second document ✓\n")
    (folder / "c.jsonl").write_text('{"text": "third"}\n\n{"text": "fourth", "id": 4}\n')
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    return folder


def test_resolve_sources(corpus):
    names = [s.name for s in resolve_sources([str(corpus)])]
    assert names == [str(corpus / "a.txt"), str(corpus / "c.jsonl"), str(corpus / "sub/b.txt")]
    assert [s.name for s in resolve_sources([str(corpus / "*.txt")])] == [str(corpus / "a.txt")]
    assert resolve_sources(["python-docs"])[0].path is None
    with pytest.raises(CorpusError, match="nope.txt: no such file"):
        resolve_sources([str(corpus / "nope.txt")])
    with pytest.raises(CorpusError, match="no files match"):
        resolve_sources([str(corpus / "*.md")])


def test_prepare_joins_documents_with_eot(corpus, tmp_path):
    meta = prepare([str(corpus)], tmp_path / "out", tokenizer="char", val_fraction=0.25)
    tok = load_tokenizer(tmp_path / "out")
    data = TokenData(tmp_path / "out")
    stream = np.concatenate([data.split("train"), data.split("val")])
    docs = ["first document\nwith two lines\n", "third", "fourth", "second document ✓\n"]
    expected = [i for doc in docs for i in [*tok.encode(doc), tok.eot_id]]
    assert stream.tolist() == expected
    assert meta["documents"] == 4 and meta["id_dtype"] == "uint16"
    assert meta["splits"]["val"]["tokens"] == round(len(expected) * 0.25)
    total_bytes = sum(len(d.encode()) for d in docs)
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == total_bytes
    files = [corpus / "a.txt", corpus / "c.jsonl", corpus / "sub" / "b.txt"]  # sorted, as read
    raw = [path.read_bytes() for path in files]
    assert meta["sources"] == [
        {"name": str(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for path, data in zip(files, raw, strict=True)
    ]
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta
    old = {k if k != "id_dtype" else "dtype": v for k, v in meta.items()}  # an older folder
    (tmp_path / "out" / "meta.json").write_text(json.dumps(old))
    assert TokenData(tmp_path / "out").split("train").tolist() == data.split("train").tolist()


def test_line_docs_make_one_document_per_line(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("emma\nolivia\n\nava\n")
    meta = prepare([str(names)], tmp_path / "out", tokenizer="char", line_docs=True, val_fraction=0)
    assert meta["documents"] == 3
    tok = load_tokenizer(tmp_path / "out")
    assert tok.decode(TokenData(tmp_path / "out").split("train")) == (
        "emma<|endoftext|>olivia<|endoftext|>ava<|endoftext|>"
    )


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_streaming_in_small_chunks_gives_the_same_tokens(tmp_path, monkeypatch, kind):
    big = tmp_path / "big.txt"
    ends = ["\n", "\n\n", " \n", "\r\n", "\n  "]  # paragraph breaks, trailing spaces, CRLF
    big.write_bytes("".join(f"line {i} of a document{ends[i % 5]}" for i in range(2000)).encode())
    args = {"progress": False, "val_fraction": 0}
    whole = {"tokenizer": "char"} if kind == "char" else {"vocab_size": 300}
    prepare([str(big)], tmp_path / "whole", **whole, **args)
    monkeypatch.setattr(corpus_module, "CHUNK_BYTES", 100)
    meta = prepare([str(big)], tmp_path / "chunks", tokenizer=str(tmp_path / "whole"), **args)
    assert meta["documents"] == 1
    whole, chunks = TokenData(tmp_path / "whole"), TokenData(tmp_path / "chunks")
    assert np.array_equal(whole.split("train"), chunks.split("train"))


def test_segments_train_the_same_tokenizer_and_give_the_same_tokens(tmp_path, monkeypatch):
    text = tmp_path / "text.txt"
    ends = ["\n", "\n\n", " \n", "\r\n", "\n  ", "\n\t"]  # runs a cut must not split
    text.write_text("".join(f"line {i} of été{ends[i % 6]}" for i in range(3000)))
    outs = {}
    for name, chars in [("whole", 1 << 30), ("segments", 50)]:
        monkeypatch.setattr(encode_module, "SEGMENT_CHARS", chars)
        outs[name] = tmp_path / name
        prepare([str(text)], outs[name], vocab_size=400, progress=False)
    for file in ("tokenizer.json", "train.bin", "val.bin"):
        assert (outs["whole"] / file).read_bytes() == (outs["segments"] / file).read_bytes()
    cut = encode_module.segments(text.read_text())
    assert len(cut) > 100 and "".join(cut) == text.read_text()


def test_builtin_python_docs_with_bpe(tmp_path):
    meta = prepare(["python-docs"], tmp_path / "pd", vocab_size=512, progress=False)
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 512
    assert meta["documents"] > 50 and meta["splits"]["train"]["tokens"] > 100_000


@pytest.mark.parametrize(
    "content, message",
    [
        (b"text\x00with a NUL", "binary"),
        (b"caf\xe9 latin-1", "not valid UTF-8 at line 1"),
        (b"", "corpus is empty"),
        (b"  \n\n", "corpus is empty"),
    ],
)
def test_bad_input_names_the_file_and_leaves_nothing(tmp_path, content, message):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    with pytest.raises(CorpusError, match=message):
        prepare([str(bad)], tmp_path / "out", tokenizer="char")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]


def test_jsonl_without_text_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: no string field 'text'"):
        prepare([str(bad)], tmp_path / "out", tokenizer="char")


def test_existing_output_needs_force(corpus, tmp_path):
    prepare([str(corpus)], tmp_path / "out", tokenizer="char")
    with pytest.raises(CorpusError, match="already exists"):
        prepare([str(corpus)], tmp_path / "out", tokenizer="char")
    prepare([str(corpus / "a.txt")], tmp_path / "out", tokenizer="char", force=True)
    assert TokenData(tmp_path / "out").meta["documents"] == 1


def test_id_dtype():
    assert id_dtype(65535) == np.uint16 and id_dtype(65536) == np.uint32


def test_random_windows_are_shifted_and_reproducible():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = random_windows(tokens, 4, 16, batch_generator(seed=1, step=7))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    again, _ = random_windows(tokens, 4, 16, batch_generator(seed=1, step=7))
    other, _ = random_windows(tokens, 4, 16, batch_generator(seed=1, step=8))
    assert torch.equal(x, again) and not torch.equal(x, other)
    with pytest.raises(CorpusError, match="fewer than one window"):
        random_windows(tokens[:10], 1, 16, batch_generator(1, 0))


def test_document_windows_start_at_a_document():
    tokens = np.array([0, 5, 6, 0, 7, 8, 9, 0, 1, 2, 3, 4], dtype=np.uint16)  # eot 0
    starts = document_starts(tokens, 0, 3)  # windows of 4 fit from each document's start
    assert starts.tolist() == [0, 3, 7]
    assert document_starts(tokens, 0, 5, chunk=5).tolist() == [0, 3]  # 7 + 6 > 12
    drawn = step_starts(len(tokens), 3, 1337, 0, 16, 2, starts)
    assert len(drawn) == 32 and set(drawn.tolist()) == {0, 3, 7}
    assert not set(step_starts(len(tokens), 3, 1337, 0, 16, 2).tolist()) <= {0, 3, 7}
    with pytest.raises(CorpusError, match="no document starts"):
        document_starts(np.array([1, 2, 0, 3], dtype=np.uint16), 0, 2)


def test_eval_windows_predict_every_token_once():
    tokens = np.arange(103, dtype=np.uint16)
    batches = list(eval_windows(tokens, 10))
    assert [tuple(b.shape) for b in batches] == [(10, 11), (1, 3)]
    targets = torch.cat([b[:, 1:].flatten() for b in batches])
    assert targets.tolist() == list(range(1, 103))
    capped = list(eval_windows(tokens, 10, max_tokens=30))
    assert len(capped) == 1 and capped[0].shape == (3, 11)
    chunks = list(eval_windows(tokens, 10, chunk=4))  # bounded memory: 4 windows at a time
    assert [len(c) for c in chunks] == [4, 4, 2, 1] and count_eval_chunks(103, 10, 4) == 4
    assert torch.equal(torch.cat(chunks[:3]), batches[0])


@pytest.mark.parametrize(
    "content, args, message",
    [
        (b"", [], "corpus is empty"),
        (b"\x00\x01 binary", [], "looks binary"),
        (b"caf\xe9", [], "not valid UTF-8 at line 1"),
        (b"some text", ["--tokenizer", "wordpiece"], "unknown tokenizer 'wordpiece'"),
        (b"tiny corpus", ["--vocab-size", "5000"], "more than this corpus can fill"),
        (b"some text", ["--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
    ],
)
def test_prepare_command_errors_are_one_line_exit_2(tmp_path, capsys, content, args, message):
    source = tmp_path / "in.txt"
    source.write_bytes(content)
    assert main(["prepare", str(source), "--out", str(tmp_path / "out"), "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error:") and message in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]  # nothing left behind


@pytest.mark.parametrize(
    "text", ["a\n\nb", "a\r\nb", "a \nb", "x = 1\n    y\nz", "end.\n\n\nNext", "a\nb\n\n"]
)
def test_safe_split_never_cuts_a_gpt2_pre_token(text):
    from tokenizers.pre_tokenizers import ByteLevel

    def pieces(s: str) -> list[str]:
        return [p for p, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(s)]

    head, tail = corpus_module._safe_split(text.encode())
    assert pieces(head.decode()) + pieces(tail.decode()) == pieces(text)


def test_prepare_cleans_documents_and_counts_what_it_removed(tmp_path, capsys):
    words = np.array(list("abcdefghijklmnopqrst"))  # one-letter words
    rng = np.random.default_rng(0)
    kept = [" ".join(rng.choice(words, 200)) + f" doc{i}" for i in range(30)]
    near = kept[3].split()
    near[10] = "changed"
    docs = [*kept[:10], kept[2].upper(), " ".join(near), "tiny", kept[10] + " forbidden"]
    docs += kept[11:]  # an exact (case) and a near duplicate, a short and a blocked document
    corpus, blocked = tmp_path / "corpus.jsonl", tmp_path / "blocked.txt"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    blocked.write_text("# words no document may hold\nforbidden\n")
    args = ["prepare", str(corpus), "--tokenizer", "char", "--val-fraction", "0", "--quiet"]
    clean = ["--dedup", "--min-chars", "10", "--blocklist", str(blocked)]
    assert main([*args, "--out", str(tmp_path / "clean"), *clean]) == 0
    assert "cleaning: 29 of 33 documents kept" in capsys.readouterr().out
    meta = json.loads((tmp_path / "clean" / "meta.json").read_text())
    counts = meta["cleaning"]["counts"]
    assert counts == {
        "documents": 33,
        "kept": 29,
        "too_short": 1,
        "non_text": 0,
        "blocklisted": 1,
        "exact_duplicates": 1,
        "near_duplicates": 1,
    }
    expected = tmp_path / "expected.jsonl"  # the documents a person would keep, by hand
    expected.write_text("".join(json.dumps({"text": d}) + "\n" for d in kept[:10] + kept[11:]))
    tokenizer = ["--tokenizer", str(tmp_path / "clean")]
    assert (
        main(
            [
                "prepare",
                str(expected),
                "--out",
                str(tmp_path / "hand"),
                *tokenizer,
                "--quiet",
                "--val-fraction",
                "0",
            ]
        )
        == 0
    )
    clean_tokens, hand = TokenData(tmp_path / "clean"), TokenData(tmp_path / "hand")
    assert np.array_equal(clean_tokens.split("train"), hand.split("train"))
    assert meta["documents"] == 29
    card = _cleaning(meta["cleaning"])  # the model card's line
    assert "29 of 33 documents kept; removed: too short 1, non text 0, blocklisted 1," in card


def test_shards_read_as_the_single_stream(tmp_path, capsys):
    args = ["prepare", "tinyshakespeare", "--tokenizer", "char", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--out", str(tmp_path / "sharded"), "--shard-tokens", "100000"]) == 0
    one, sharded = TokenData(tmp_path / "one"), TokenData(tmp_path / "sharded")
    shards = sharded.meta["splits"]["train"]["shards"]
    assert len(shards) == 11 and shards[0] == {"file": "train-00000.bin", "tokens": 100000}
    for name in ("train", "val"):
        whole, parts = one.split(name), sharded.split(name)
        assert len(parts) == len(whole) and np.array_equal(parts[:], whole[:])
    whole, parts = one.split("train"), sharded.split("train")
    starts = np.array([0, 99990, 199_999, len(whole) - 65])  # two windows straddle a cut
    index = starts[:, None] + np.arange(65)
    assert np.array_equal(parts[index], whole[index])
    generator = batch_generator(1, 2)
    x, y = random_windows(parts, 16, 64, generator)
    assert torch.equal(x, random_windows(whole, 16, 64, batch_generator(1, 2))[0])
    (tmp_path / "sharded" / "train-00003.bin").unlink()
    with pytest.raises(CorpusError, match="train-00003.bin is missing"):
        TokenData(tmp_path / "sharded").split("train")
    capsys.readouterr()
    run = ["train", "--data", str(tmp_path / "sharded"), "--out", str(tmp_path / "run")]
    assert main([*run, "--max-steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "train-00003.bin is missing" in err


@pytest.mark.slow
def test_workers_give_the_same_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(encode_module, "ENCODE_BATCH_CHARS", 50_000)  # 23 batches to share out
    common = {"tokenizer": "char", "progress": False, "line_docs": True}
    prepare(["tinyshakespeare"], tmp_path / "one", **common)
    prepare(["tinyshakespeare"], tmp_path / "two", workers=2, **common)
    for file in ("tokenizer.json", "train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "one" / file).read_bytes() == (tmp_path / "two" / file).read_bytes()
    with pytest.raises(CorpusError, match="--workers must be at least 1"):
        prepare(["tinyshakespeare"], tmp_path / "none", workers=0, **common)
