"""Built-in corpora: `tinyshakespeare` and `names` are the files they came from, read the same way.

The comparisons with the original files run where `../shared/data` sits beside the checkout;
the rest runs anywhere, from what the package ships.
"""

import gzip
import hashlib
import json
from importlib import resources
from pathlib import Path

import pytest

from tlm.cli import main
from tlm.data import CorpusError, TokenData, documents, prepare, resolve_sources
from tlm.data import corpus as corpus_module
from tlm.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"{SHARED} is absent: no original files to compare with"
)
# name: (shipped file, bytes and sha256 of the text, documents with --line-docs)
KNOWN = {
    "tinyshakespeare": (  # 40,000 lines, of which 32,777 are not blank
        "tinyshakespeare.txt.gz",
        1_115_394,
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        32_777,
    ),
    "names": (  # the last name has no newline after it, so `wc -l` counts 32,032
        "names.txt.gz",
        228_145,
        "0a30b5557f192f32ab962680889aac5f6fda0f4cecf40a6d0b5694f58ea8cc4d",
        32_033,
    ),
}


def shipped_text(name: str) -> bytes:
    file = KNOWN[name][0]
    return gzip.decompress((resources.files("tlm.data") / "corpora" / file).read_bytes())


def digests(folder: Path) -> dict[str, str]:
    """sha256 of the files `prepare` writes beside meta.json."""
    outputs = ("train.bin", "val.bin", "tokenizer.json")
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in outputs}


@needs_shared
@pytest.mark.parametrize("name", KNOWN)
def test_shipped_text_is_the_original_file(name):
    original = (SHARED / f"{name}.txt").read_bytes()
    assert hashlib.sha256(shipped_text(name)).digest() == hashlib.sha256(original).digest()


@pytest.mark.slow
@needs_shared
@pytest.mark.parametrize(
    "name, settings",
    [
        pytest.param("tinyshakespeare", dict(tokenizer="char"), id="tinyshakespeare-char"),
        pytest.param("names", dict(tokenizer="char", line_docs=True), id="names-char-lines"),
        pytest.param(
            "names", dict(tokenizer="bpe", vocab_size=300, line_docs=True), id="names-bpe-lines"
        ),
    ],
)
def test_prepare_of_builtin_equals_prepare_of_file(tmp_path, name, settings):
    settings = dict(val_fraction=0.1, progress=False, **settings)
    builtin = prepare([name], tmp_path / "builtin", **settings)
    file = prepare([str(SHARED / f"{name}.txt")], tmp_path / "file", **settings)
    assert digests(tmp_path / "builtin") == digests(tmp_path / "file")
    [from_builtin], [from_file] = builtin.pop("sources"), file.pop("sources")
    assert from_builtin["name"] == name
    assert from_builtin | {"name": None} == from_file | {"name": None}
    assert builtin == file


@pytest.mark.parametrize("name", KNOWN)
def test_builtin_resolves_with_its_known_size(name):
    _, size, sha256, lines = KNOWN[name]
    [whole] = resolve_sources([name])
    assert whole.path is None and whole.name == name
    assert len(list(documents([whole]))) == 1
    assert (whole.bytes, whole.sha256) == (size, sha256)  # of the text, not of the gzip file
    [by_line] = resolve_sources([name], line_docs=True)
    assert len(list(documents([by_line]))) == lines
    assert (by_line.bytes, by_line.sha256) == (size, sha256)


def test_names_are_one_document_per_line():
    names = list(documents(resolve_sources(["names"], line_docs=True)))
    assert names[:3] == ["emma", "olivia", "ava"] and names[-1] == "zzyzx"


def test_cli_prepares_a_builtin(tmp_path):
    out = tmp_path / "shakespeare_char"
    assert main(["prepare", "tinyshakespeare", "--tokenizer", "char", "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    _, size, sha256, _ = KNOWN["tinyshakespeare"]
    assert meta["sources"] == [{"name": "tinyshakespeare", "bytes": size, "sha256": sha256}]
    assert meta["vocab_size"] == 66 and meta["documents"] == 1  # 65 characters and <|endoftext|>
    assert sum(split["bytes"] for split in meta["splits"].values()) == size


def test_unknown_name_lists_every_builtin():
    with pytest.raises(
        CorpusError,
        match="built-in corpus \\(python-docs, python-stdlib, tinyshakespeare, names\\)",
    ):
        resolve_sources(["shakespeare"])


def test_documents_are_what_prepare_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "CHUNK_BYTES", 16)  # a document spans many pieces
    folder = tmp_path / "corpus"
    folder.mkdir()
    long = "a document read in pieces,\nmany more than one;\nstill one document.\n"
    (folder / "a.txt").write_text(long)
    (folder / "b.txt").write_text("  \n\t\n")  # whitespace only: no document
    (folder / "c.jsonl").write_text('{"text": "third"}\n\n{"text": " "}\n{"text": "fourth"}\n')
    docs = list(documents(resolve_sources([str(folder)])))
    assert docs == [long, "third", "fourth"]
    out = tmp_path / "out"
    prepare([str(folder)], out, tokenizer="char", val_fraction=0, progress=False)
    tok = load_tokenizer(out)
    assert TokenData(out).split("train").tolist() == [
        i for doc in docs for i in [*tok.encode(doc), tok.eot_id]
    ]
