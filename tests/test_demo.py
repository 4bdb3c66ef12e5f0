import hashlib
import json
import shlex
from pydoc_data.topics import topics

import pytest

from tlm.cli import main


@pytest.mark.slow
def test_demo_runs_end_to_end_and_replaces_only_its_own_folders(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "run"
    args = ["demo", "--data", str(data), "--out", str(out), "--max-steps", "4", "--quiet"]
    args += ["--vocab-size", "300"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for step in ("[1/4] prepare python-stdlib", "[2/4] train", "[3/4] generate", "[4/4] evaluate"):
        assert step in printed
    assert ">>> The for statement" in printed and "bits/byte" in printed
    for name in ("loss.png", "attention.png"):
        assert (out / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    assert (out / "MODEL_CARD.md").is_file() and (data / "meta.json").is_file()
    hint = next(line for line in printed.splitlines() if "tlm generate" in line)
    hint_args = shlex.split(hint)[1:] + ["--max-new-tokens", "5"]
    assert main(hint_args) == 0  # the command the demo suggests works as printed
    # a second demo replaces the first one's folders (on the smaller corpus, to save time)
    assert main([*args, "python-docs"]) == 0

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["demo", "--data", str(mine), "--out", str(out), "--quiet"]) == 2
    assert "was not made by tlm demo" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_demo_trains_on_the_files_it_is_given(tmp_path, capsys):
    corpus = tmp_path / "topics.txt"
    corpus.write_text("\n\n".join(list(topics.values())[:20]), encoding="utf-8")
    raw = corpus.read_bytes()
    data, out = tmp_path / "data", tmp_path / "run"
    args = ["demo", str(corpus), "--data", str(data), "--out", str(out), "--max-steps", "2"]
    assert main([*args, "--vocab-size", "300", "--quiet"]) == 0
    assert f"[1/4] prepare {corpus} -> {data}" in capsys.readouterr().out
    source = {"name": str(corpus), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    assert json.loads((data / "meta.json").read_text())["sources"] == [source]
    card = (out / "MODEL_CARD.md").read_text()
    assert f"| `{corpus}` | {len(raw):,} | `{source['sha256']}` |" in card


@pytest.mark.slow
def test_demo_chat_fine_tunes_the_base_and_measures_both(tmp_path, capsys, monkeypatch):
    from tlm.cli import demo_chat

    monkeypatch.setattr(demo_chat, "MEASURED", 48)  # the measure's flow, on 48 questions
    base = tmp_path / "base"
    pretrain = ["demo", "python-docs", "--data", str(tmp_path / "docs"), "--out", str(base)]
    assert main([*pretrain, "--max-steps", "5", "--vocab-size", "300", "--quiet"]) == 0
    data, out = tmp_path / "chat-data", tmp_path / "chat"
    args = ["demo", "chat", "--base", str(base), "--data", str(data), "--out", str(out)]
    assert main([*args, "--max-steps", "4", "--quiet"]) == 0
    printed = capsys.readouterr().out
    for step in ("[1/4] base model", "[2/4] prepare python-qa", "[3/4] fine-tune", "[4/4] answer"):
        assert step in printed
    figures = json.loads((out / "chat_eval.json").read_text())
    assert set(figures) == {"base", "assistant"}
    assert set(figures["base"]) == {"stop_rate", "chrf"}
    assert set(figures["assistant"]) == {"stop_rate", "chrf", "loss"}
    assert all(0 <= f["stop_rate"] <= 1 and 0 <= f["chrf"] <= 100 for f in figures.values())
    assert "goals: stop rate" in printed and "Q: " in printed
    hint = next(line for line in printed.splitlines() if "--message" in line)
    assert main([*shlex.split(hint)[1:], "--max-new-tokens", "4"]) == 0  # works as printed
