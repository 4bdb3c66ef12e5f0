"""Canaries (J&M §10.10; Carlini et al. 2019): planted by tlm prepare, measured by tlm audit."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import tiny_config, varied_char_run
from tlm import TransformerLM, load_tokenizer
from tlm.audit import exposure, extracted, text_logprobs
from tlm.cli import main
from tlm.data import prepare
from tlm.tokenizer import document_ids
from tlm.train.privacy import HEADING, privacy_section, rewrite_section

PLANTED, NEVER = "my PIN is 4931", "my PIN is 2760"


@pytest.fixture(scope="module")
def planted_model(docs_chars):
    """A tiny character model trained on python-docs text with PLANTED in it 40 times."""
    tokenizer = load_tokenizer(docs_chars)
    text = np.fromfile(docs_chars / "train.bin", dtype=np.uint16)[:6000].astype(np.int64)
    canary = np.array(document_ids(tokenizer, PLANTED))
    pieces = np.array_split(text, 40)
    stream = torch.from_numpy(np.concatenate([np.concatenate([p, canary]) for p in pieces]))
    torch.manual_seed(0)
    config = tiny_config(vocab_size=tokenizer.vocab_size, context_length=32, dropout=0.0)
    model = TransformerLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        starts = torch.randint(0, len(stream) - 33, (32,), generator=generator)
        batch = torch.stack([stream[s : s + 33] for s in starts])
        loss = torch.nn.functional.cross_entropy(
            model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer


def test_a_planted_canary_is_exposed_and_one_never_planted_is_not(planted_model):
    model, tokenizer = planted_model
    planted, never = exposure(model, tokenizer, PLANTED), exposure(model, tokenizer, NEVER)
    assert planted.enumerated and planted.max_exposure == pytest.approx(np.log2(10_000))
    assert planted.exposure > 10 and never.exposure < 6
    assert extracted(model, tokenizer, PLANTED) and not extracted(model, tokenizer, NEVER)


def binomial_tail(k: int, n: int, p: float) -> float:
    """The two-sided tail of Binomial(n, p) at k: 2·min(P(K <= k), P(K >= k)), at most 1."""
    log_choose = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(n + 1)
    ]
    pmf = [
        math.exp(c + i * math.log(p) + (n - i) * math.log1p(-p)) for i, c in enumerate(log_choose)
    ]
    return min(1.0, 2 * min(sum(pmf[: k + 1]), sum(pmf[k:])))


def test_the_sampled_exposure_agrees_with_the_exact_one(planted_model):
    """The sampled rank counts the drawn candidates that beat the canary: that count is a
    draw of Binomial(samples, (exact rank - 1) / (|R| - 1)), so it is held to that law at
    the 1e-4 level (a canary of rank 17 of 10,000 expects 4.8 of 3,000 to beat it, ±2.2:
    a fixed tolerance in bits would be under one standard deviation there). Where nothing
    beats the canary the estimate extrapolates a normal tail: within 0.5 bits of the exact."""
    model, tokenizer = planted_model
    samples = 3000
    for canary in ("my PIN is 4938", "my PIN is 1234"):  # one near the planted secret
        exact = exposure(model, tokenizer, canary)
        sampled = exposure(model, tokenizer, canary, samples=samples, enumerate_up_to=0)
        assert exact.enumerated and not sampled.enumerated
        space = 2**exact.max_exposure
        if exact.rank == 1:
            assert abs(sampled.exposure - exact.exposure) < 0.5, (exact, sampled)
            continue
        beaten = round((sampled.rank - 1) / (space - 1) * samples)  # the count drawn
        law = (exact.rank - 1) / (space - 1)
        assert binomial_tail(beaten, samples, law) > 1e-4, (exact, sampled, beaten)


def test_text_logprobs_are_the_sums_of_the_tokens_logprobs(planted_model):
    model, tokenizer = planted_model
    texts = ["my PIN is 1", "a longer text, padded"]
    got = text_logprobs(model, tokenizer, texts, batch_size=2)
    for text, value in zip(texts, got, strict=True):
        ids = torch.tensor([document_ids(tokenizer, text)])
        with torch.no_grad():
            logprobs = model(ids)[0, :-1].log_softmax(-1)
        assert value == pytest.approx(float(logprobs.gather(1, ids[0, 1:, None]).sum()), abs=1e-4)


def count(stream: np.ndarray, ids: list[int]) -> int:
    """How many times `ids` occurs in `stream`, at every offset (overlaps too)."""
    windows = np.lib.stride_tricks.sliding_window_view(stream, len(ids))  # [len - n + 1, n]
    return int((windows == np.asarray(ids)).all(axis=1).sum())


def test_prepare_plants_each_canary_as_often_as_asked_in_train_only(tmp_path):
    out = tmp_path / "data"
    assert main(["prepare", "python-docs", "--out", str(out), "--tokenizer", "char",
                 "--canary-repeats", "1,3,8", "--quiet"]) == 0  # fmt: skip
    meta = json.loads((out / "meta.json").read_text())
    assert [c["repeats"] for c in meta["canaries"]] == [1, 3, 8]
    tokenizer = load_tokenizer(out)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert meta["splits"]["train"]["tokens"] == len(train)
    for canary in meta["canaries"]:
        ids = tokenizer.encode(canary["text"]) + [tokenizer.eot_id]
        assert count(train, ids) == canary["repeats"] and count(val, ids) == 0
    plain = tmp_path / "plain"
    prepare(["python-docs"], plain, tokenizer="char", progress=False)
    assert np.array_equal(np.fromfile(plain / "val.bin", dtype=np.uint16), val)


def test_a_char_vocabulary_spells_the_canaries_and_every_candidate(tmp_path, capsys):
    """A corpus without digits (Tiny Shakespeare has one, '3'): the vocabulary is made from
    the text as planted, all ten digits in it, so the audit can rank the canary among every
    secret of its format."""
    corpus = tmp_path / "plays.txt"
    corpus.write_text("To be, or not to be: that is the question.\n" * 200)
    data = tmp_path / "data"
    assert main(["prepare", str(corpus), "--out", str(data), "--tokenizer", "char",
                 "--canary-repeats", "1,8", "--quiet"]) == 0  # fmt: skip
    tokenizer = load_tokenizer(data)
    assert set("0123456789PIN") <= set(tokenizer.chars)
    train = np.fromfile(data / "train.bin", dtype=np.uint16)
    meta = json.loads((data / "meta.json").read_text())
    for canary in meta["canaries"]:
        ids = tokenizer.encode(canary["text"]) + [tokenizer.eot_id]
        assert count(train, ids) == canary["repeats"]
    run = varied_char_run(data, tmp_path / "run")
    capsys.readouterr()
    assert main(["audit", str(run), "--data", str(data), "--samples", "8", "--prefix", "8",
                 "--suffix", "4", "--json", "--quiet"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)["canaries"]
    assert [row["repeats"] for row in rows] == [1, 8]
    assert all(0 <= row["exposure"] <= row["max_exposure"] for row in rows)


def test_a_reused_tokenizer_that_cannot_spell_the_canaries_is_refused(tmp_path, capsys):
    corpus = tmp_path / "plays.txt"
    corpus.write_text("To be, or not to be: that is the question.\n" * 200)
    plain = tmp_path / "plain"
    assert main(["prepare", str(corpus), "--out", str(plain), "--tokenizer", "char",
                 "--quiet"]) == 0  # fmt: skip
    capsys.readouterr()
    code = main(["prepare", str(corpus), "--out", str(tmp_path / "d"), "--tokenizer", str(plain),
                 "--canary-repeats", "1", "--quiet"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "cannot spell the canaries" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("repeats", ["0", "1,x", "-4", ""])
def test_a_canary_count_that_is_not_a_positive_integer_is_refused(tmp_path, capsys, repeats):
    code = main(["prepare", "python-docs", "--out", str(tmp_path / "d"), "--tokenizer", "char",
                 "--canary-repeats", repeats, "--quiet"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--canary-repeats" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_the_audit_reports_canaries_without_their_secrets(tmp_path, capsys):
    data = tmp_path / "data"
    main(["prepare", "python-docs", "--out", str(data), "--tokenizer", "char",
          "--canary-repeats", "2,5", "--quiet"])  # fmt: skip
    run = varied_char_run(data, tmp_path / "run")
    capsys.readouterr()
    assert main(["audit", str(run), "--data", str(data), "--samples", "8", "--prefix", "8",
                 "--suffix", "4", "--json", "--quiet"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = json.loads(out)["canaries"]
    assert [row["repeats"] for row in rows] == [2, 5]
    for row in rows:
        assert set(row) == {"repeats", "exposure", "max_exposure", "extracted"}
        assert 0 <= row["exposure"] <= row["max_exposure"]
    for canary in json.loads((data / "meta.json").read_text())["canaries"]:
        assert canary["text"][-6:] not in out


def test_exposure_is_log2_of_the_space_over_the_rank(planted_model):
    """Two digits: 100 candidates, ranked here by hand."""
    model, tokenizer = planted_model
    scores = text_logprobs(model, tokenizer, [f"my PIN is {i:02d}" for i in range(100)])
    for secret in (49, 7):
        rank = 1 + int((scores > scores[secret]).sum())
        found = exposure(model, tokenizer, f"my PIN is {secret:02d}")
        assert found.rank == rank and found.max_exposure == pytest.approx(np.log2(100))
        assert found.exposure == pytest.approx(np.log2(100) - np.log2(rank))


def test_the_audit_rewrites_the_model_cards_section_without_secrets(tmp_path, capsys):
    data = tmp_path / "data"
    main(["prepare", "python-docs", "--out", str(data), "--tokenizer", "char",
          "--canary-repeats", "3", "--quiet"])  # fmt: skip
    run = varied_char_run(data, tmp_path / "run")
    meta = json.loads((data / "meta.json").read_text())
    tokens = 2 * meta["splits"]["train"]["tokens"]  # two passes over the training split
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens": tokens}) + "\n")
    card = run / "MODEL_CARD.md"
    card.write_text(f"# Model card\n\n{privacy_section(meta, 2.0)}\n## Limits (J&M §10.10)\n\nx\n")
    assert "Not audited yet" in card.read_text()
    for _ in range(2):  # the second audit replaces the first's section
        main(["audit", str(run), "--data", str(data), "--samples", "4", "--prefix", "8",
              "--suffix", "4", "--quiet"])  # fmt: skip
    text = card.read_text()
    assert text.count(HEADING) == 1 and "Not audited yet" not in text
    assert "| train | 4 |" in text and "| 3 | ~6 times |" in text
    assert text.endswith("## Limits (J&M §10.10)\n\nx\n")
    assert meta["canaries"][0]["text"] not in text and meta["canaries"][0]["text"][-6:] not in text
    assert json.loads((run / "audit.json").read_text())["canaries"][0]["repeats"] == 3


def test_the_section_goes_before_the_limits_or_at_the_end(tmp_path):
    card = tmp_path / "MODEL_CARD.md"
    card.write_text("# Card\n\n## Limits\n\ny\n")
    rewrite_section(card, f"{HEADING}\n\nfigures\n")
    assert card.read_text() == f"# Card\n\n{HEADING}\n\nfigures\n\n## Limits\n\ny\n"
    card.write_text("# Card\n")
    rewrite_section(card, f"{HEADING}\n\nfigures\n")
    assert card.read_text() == f"# Card\n\n{HEADING}\n\nfigures\n"
