"""`tlm demo encoder` (issue 66): pretraining, both fine-tuned heads and the bag-of-words
baseline end to end, and the built-in labeled sets it reads."""

import json

import pytest

from tlm.cli import main
from tlm.data.labeled import read_labeled
from tlm.data.stdlib_labels import builtin_labeled
from tlm.tasks.baselines import bag_of_words


def test_the_builtin_sets_are_the_same_paragraphs_split_alike():
    family = read_labeled("stdlib-family", "classify")
    identifiers = read_labeled("stdlib-identifiers", "tag")
    assert len(family.train) > 1000 and len(family.val) > 100
    assert [e.first for e in family.val] == [" ".join(e.first) for e in identifiers.val]
    assert {"concurrency", "dev", "files", "net", "numbers", "text"} <= set(family.labels)
    assert identifiers.labels == ("O", "B-ID")
    _, _, text = builtin_labeled("stdlib-family")
    assert family.sources[0]["bytes"] == len(text)


def test_identifiers_are_names_written_as_code():
    _, val, _ = builtin_labeled("stdlib-identifiers")
    tagged = {w: t for _, r in val for w, t in zip(r["tokens"], r["tags"], strict=True)}
    code = [w for w, t in tagged.items() if t == "B-ID"]
    assert code and all(not (w.isalpha() and w.islower()) for w in code)  # prose words are O
    assert any("." in w or "(" in w for w in code)


def test_the_baseline_is_logistic_regression_on_words():
    pytest.importorskip("sklearn")
    classify = bag_of_words(read_labeled("stdlib-family", "classify"))
    assert 0.5 < classify["accuracy"] <= 1 and 0 < classify["f1"] <= 1
    tag = bag_of_words(read_labeled("stdlib-identifiers", "tag"))
    assert tag["accuracy"] > 0.9 and tag["f1"] < 0.5  # new names are zeros to it


@pytest.mark.slow
def test_demo_encoder_runs_its_four_steps(tmp_path, capsys):
    pytest.importorskip("sklearn")
    args = ["demo", "encoder", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "enc")]
    args += ["--mlm-steps", "3", "--classify-steps", "3", "--tag-steps", "3", "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for step in ("[1/4] prepare", "[2/4] pretrain", "[3/4] fine-tune to classify", "[4/4]"):
        assert step in printed
    figures = json.loads((tmp_path / "enc" / "encoder_eval.json").read_text())
    assert set(figures) == {"mlm", "classify", "tag"}
    for task in ("classify", "tag"):
        assert {"accuracy", "f1", "baseline", "held_out"} <= set(figures[task])
    config = json.loads((tmp_path / "enc" / "tag" / "config.json").read_text())
    assert config["model"]["task"] == "tag" and config["train"]["init_from"].endswith("mlm")
    (tmp_path / "other").mkdir()  # a folder the demo did not make is never replaced
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main([*args[:4], "--out", str(tmp_path / "other"), *args[6:]]) == 2
