"""tlm audit (J&M §10.10): extraction of memorized text, duplication counts, the command."""

import json

import numpy as np
import pytest
import torch

from conftest import tiny_config
from tlm import TransformerLM
from tlm.audit import AuditError, by_bucket, extraction, occurrences, wilson
from tlm.cli import main


def memorizer(text: np.ndarray, steps: int = 120) -> TransformerLM:
    """A tiny model trained on every window of `text` until it has learned it by heart."""
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(vocab_size=50, context_length=32, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.from_numpy(text.astype(np.int64))
    windows = torch.stack([data[i : i + 33] for i in range(len(data) - 32)])
    for _ in range(steps):
        logits = model(windows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_a_model_gives_back_what_it_learned_by_heart_and_not_unseen_text():
    rng = np.random.default_rng(0)
    seen, unseen = rng.integers(0, 50, 120), rng.integers(0, 50, 120)
    model = memorizer(seen)
    train = extraction(model, seen, samples=40, prefix=8, suffix=8, batch_size=16)
    held_out = extraction(model, unseen, samples=40, prefix=8, suffix=8, batch_size=16)
    assert train.summary()["rate"] >= 0.8 and train.summary()["token_match"] >= 0.9
    assert held_out.summary()["rate"] == 0.0 and held_out.summary()["token_match"] < 0.2


def test_wilson_interval():
    low, high = wilson(0, 100)
    assert low == 0.0 and 0.03 < high < 0.04  # never empty at k = 0
    low, high = wilson(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    assert wilson(100, 100)[1] == 1.0


def test_occurrences_count_every_offset_across_blocks(monkeypatch):
    import tlm.audit.duplication as duplication

    rng = np.random.default_rng(1)
    stream = rng.integers(0, 4, 3000).astype(np.uint16)
    windows = np.stack([stream[0:5], stream[77:82], np.array([9, 9, 9, 9, 9], dtype=np.uint16)])
    starts = range(len(stream) - 4)
    brute = [sum(bool((stream[i : i + 5] == row).all()) for i in starts) for row in windows]
    assert brute[0] > 1 and brute[2] == 0
    assert occurrences(stream, windows).tolist() == brute
    monkeypatch.setattr(duplication, "BLOCK", 7)  # windows that straddle two blocks
    assert occurrences(stream, windows).tolist() == brute


def test_extraction_by_duplication_bucket():
    rows = by_bucket(np.array([1, 1, 3, 20, 17, 5]), np.array([0, 1, 1, 1, 0, 0], dtype=bool))
    assert rows == [
        {"bucket": "1", "windows": 2, "rate": 0.5},
        {"bucket": "2-4", "windows": 1, "rate": 1.0},
        {"bucket": "5-16", "windows": 1, "rate": 0.0},
        {"bucket": "17+", "windows": 2, "rate": 0.5},
    ]


def test_a_window_longer_than_the_context_is_refused():
    model = TransformerLM(tiny_config(vocab_size=50, context_length=16)).eval()
    with pytest.raises(AuditError, match="longer than the model's context"):
        extraction(model, np.zeros(100, dtype=np.int64), prefix=10, suffix=10)


def test_the_command_prints_one_json_object(tmp_path, capsys, docs_chars):
    from conftest import varied_char_run

    run = varied_char_run(docs_chars, tmp_path / "run")
    code = main(["audit", str(run), "--data", str(docs_chars), "--samples", "20", "--prefix",
                 "8", "--suffix", "4", "--json", "--quiet"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and set(report) == {"extraction", "duplication", "canaries"}
    for split in ("train", "val"):
        keys = {"windows", "exact", "rate", "low", "high", "token_match"}
        assert set(report["extraction"][split]) == keys
        assert report["extraction"][split]["windows"] == 20
    assert sum(row["windows"] for row in report["duplication"]) == 20


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, docs_chars):
    from conftest import varied_char_run

    run = varied_char_run(docs_chars, tmp_path / "run")
    assert main(["audit", str(run), "--data", str(docs_chars), "--prefix", "60", "--suffix",
                 "60", "--quiet"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "context" in err and len(err.splitlines()) == 1


def test_a_hugging_face_directory_is_audited_and_left_as_it_was(gpt2_dir, tmp_path, capsys):
    from tlm.data import prepare

    data = tmp_path / "docs-gpt2"
    prepare(["python-docs"], data, tokenizer=str(gpt2_dir), progress=False, canary_repeats=[2])
    before = sorted(p.name for p in gpt2_dir.iterdir())
    code = main(["audit", str(gpt2_dir), "--data", str(data), "--samples", "6", "--prefix", "8",
                 "--suffix", "4", "--json", "--quiet"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["extraction"]["train"]["windows"] == 6
    assert [row["repeats"] for row in report["canaries"]] == [2] and "epochs" not in report
    assert sorted(p.name for p in gpt2_dir.iterdir()) == before  # no card, no audit.json


def test_data_of_another_tokenizer_or_an_empty_split_is_refused(tmp_path, capsys, docs_chars):
    from conftest import varied_char_run
    from tlm.data import prepare

    run = varied_char_run(docs_chars, tmp_path / "run")
    other = tmp_path / "bpe"
    prepare(["python-docs"], other, vocab_size=300, progress=False)
    no_val = tmp_path / "no-val"
    prepare(["python-docs"], no_val, tokenizer=str(docs_chars), val_fraction=0, progress=False)
    for data, says in ((other, "not tokenized with the tokenizer"), (no_val, "val split")):
        args = ["--prefix", "8", "--suffix", "4", "--quiet"]
        assert main(["audit", str(run), "--data", str(data), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1
