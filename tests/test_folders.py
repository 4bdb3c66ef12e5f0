"""No command replaces a folder that holds anything tlm did not write."""

import json
import os

import pytest

from tlm.cli import main
from tlm.data import TokenData, prepare
from tlm.io import FolderError, atomic_path, check_replaceable


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("some text to prepare\n" * 20)
    return path


def prepare_command(text, out, *extra):
    return main(["prepare", str(text), "--out", str(out), "--tokenizer", "char", "--quiet", *extra])


def snapshot(folder):
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def test_force_refuses_a_users_folder_and_touches_nothing(text, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("four years of work")
    before = snapshot(mine)
    assert prepare_command(text, mine, "--force") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a folder written by tlm prepare" in err
    assert snapshot(mine) == before


def test_force_refuses_a_prepared_folder_holding_a_users_file(text, tmp_path, capsys):
    out = tmp_path / "out"
    assert prepare_command(text, out) == 0
    (out / "notes.md").write_text("my notes")
    (out / "sub").mkdir()
    (out / "sub" / "keep.txt").write_text("nested")
    before = snapshot(out)
    assert prepare_command(text, out, "--force") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds notes.md, which tlm did not write" in err
    assert snapshot(out) == before


def test_force_refuses_a_meta_json_tlm_did_not_write(text, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "meta.json").write_text(json.dumps({"splits": {}}))
    assert prepare_command(text, out, "--force") == 2
    assert "no meta.json written by tlm" in capsys.readouterr().err
    assert (out / "meta.json").is_file()


def test_force_replaces_what_prepare_wrote(text, tmp_path):
    out = tmp_path / "out"
    assert prepare_command(text, out, "--line-docs") == 0
    assert TokenData(out).meta["documents"] == 20
    assert prepare_command(text, out, "--force") == 0
    assert TokenData(out).meta["documents"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]  # nothing aside


def test_demo_refuses_its_own_folder_once_a_user_file_is_in_it(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    (run / ".tlm-demo").touch()
    (run / "config.json").write_text(json.dumps({"model": {}, "tlm": "0.1.0"}))
    (run / "plots" / "my-figure.svg").write_text("<svg/>")
    before = snapshot(run)
    args = ["demo", "--data", str(tmp_path / "d"), "--out", str(run), "--quiet"]
    assert main(args) == 2
    assert "holds plots/my-figure.svg" in capsys.readouterr().err
    assert snapshot(run) == before and not (tmp_path / "d").exists()


def test_a_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "out"
    target.mkdir()
    (target / "meta.json").write_text("old")
    real = os.replace

    def fail_on_the_new_folder(src, dst):
        if ".tmp-" in str(src):
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr("tlm.io.os.replace", fail_on_the_new_folder)
    with pytest.raises(OSError, match="disk full"), atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "meta.json").write_text("new")
    assert (target / "meta.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_check_replaceable_allows_absent_and_empty_folders(tmp_path):
    check_replaceable(tmp_path / "absent", (), "meta.json", "x")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    check_replaceable(tmp_path / "empty", (), "meta.json", "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(FolderError, match="is a file"):
        check_replaceable(tmp_path / "file", (), "meta.json", "x")


def test_prepare_api_refuses_like_the_command(text, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("x")
    with pytest.raises(FolderError):
        prepare([str(text)], mine, tokenizer="char", force=True, progress=False)
    assert (mine / "a.txt").read_text() == "x"
