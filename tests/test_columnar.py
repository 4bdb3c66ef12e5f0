"""`tlm prepare` reads Hugging Face's file formats: Parquet shards, Arrow files and
`datasets.save_to_disk` folders give the same tokens as the same documents in .jsonl."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlm.cli import main

DOCS = [
    "The for statement runs a block once for each item.",
    "def f(x):\n    return x  # ünïcode and emoji 🙂\n",
    "   ",  # blank: no document, in every format
    "The while statement repeats it.\n\nTwice.",
] * 30


def prepared(tmp_path, name, *inputs):
    out = tmp_path / name
    args = ["prepare", *map(str, inputs), "--out", str(out), "--vocab-size", "300", "--quiet"]
    assert main([*args, "--text-field", "content"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    return meta["documents"], (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes()


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return prepared(tmp_path, "from-jsonl", path)


def test_parquet_in_row_groups_gives_the_jsonl_tokens(tmp_path, jsonl):
    table = pa.table({"id": list(range(len(DOCS) + 1)), "content": [*DOCS, None]})  # a null row
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=7)  # 18 row groups
    assert pq.ParquetFile(tmp_path / "docs.parquet").num_row_groups > 1
    assert prepared(tmp_path, "from-parquet", tmp_path / "docs.parquet") == jsonl
    assert jsonl[0] == 90  # the blank documents are skipped


def test_arrow_files_and_a_save_to_disk_folder_give_the_jsonl_tokens(tmp_path, jsonl):
    import datasets

    datasets.Dataset.from_dict({"content": DOCS}).save_to_disk(str(tmp_path / "saved"))
    assert prepared(tmp_path, "from-saved", tmp_path / "saved") == jsonl  # an IPC stream
    table = pa.table({"content": DOCS})
    with pa.ipc.new_file(str(tmp_path / "docs.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=11)
    assert prepared(tmp_path, "from-arrow", tmp_path / "docs.arrow") == jsonl  # an IPC file


def test_a_missing_or_non_text_column_or_a_corrupt_file_is_one_line(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["a b c"] * 3, "n": [1, 2, 3]}), tmp_path / "t.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    cases = [
        ([str(tmp_path / "t.parquet"), "--text-field", "content"], "no column 'content'"),
        ([str(tmp_path / "t.parquet"), "--text-field", "n"], "column 'n' holds int64, not text"),
        ([str(tmp_path / "bad.parquet")], "not a readable parquet file"),
    ]
    for args, message in cases:
        assert main(["prepare", *args, "--out", str(tmp_path / "out"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()
