"""Loss, perplexity and bits per byte by value, on a byte-level BPE model and multi-byte text."""

import json
import math
from pydoc_data.topics import topics

import pytest
import torch

from tlm import load_model, load_tokenizer
from tlm.cli import main
from tlm.evaluate import evaluate_text

MIXED = "naïve café — 中文 🙂 déjà vu, 東京, ñandú… "  # 1 to 4 UTF-8 bytes a character
TEXT = "A naïve café — 中文 🙂 and 東京: déjà vu… ñandú"
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A tiny run whose 300-token BPE has merged some multi-byte characters whole."""
    folder = tmp_path_factory.mktemp("bpe")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n\n".join(list(topics.values())[:20]) + MIXED * 300, encoding="utf-8")
    data, run = folder / "data", folder / "run"
    prepare = ["prepare", str(corpus), "--out", str(data), "--vocab-size", "300", "--quiet"]
    assert main(prepare) == 0
    args = ["train", "--data", str(data), "--out", str(run), "--n-layers", "2"]
    args += ["--d-model", "32", "--n-heads", "2", "--context-length", "64", "--max-steps", "20"]
    assert main([*args, "--batch-size", "8", "--quiet"]) == 0
    return run


def scores(run, text: str, n_bytes: int) -> dict[str, float]:
    """Score [eot, *text] in one forward pass; <|endoftext|> targets spell no bytes."""
    model, tok = load_model(run), load_tokenizer(run)
    ids = torch.tensor([tok.eot_id, *tok.encode(text)])
    assert len(ids) <= model.config.context_length + 1  # one window holds it all
    with torch.no_grad():
        logits = model(ids[None, :-1])[0].double()  # [T, V]
    nll = -logits.log_softmax(-1).gather(1, ids[1:, None])[:, 0]  # nats per target, float64
    loss = nll.sum().item() / len(nll)
    spelled = nll[ids[1:] != tok.eot_id].sum().item()
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": spelled / math.log(2) / n_bytes,
        "tokens": len(nll),
        "bytes": n_bytes,
    }


def test_bits_per_byte_counts_utf8_bytes(bpe_run, tmp_path, capsys):
    tok = load_tokenizer(bpe_run)
    ids, n_bytes = tok.encode(TEXT), len(TEXT.encode("utf-8"))
    # bytes outnumber tokens and characters clearly, and some tokens spell a multi-byte
    # character whole: counting tokens or characters (of the text or of each token) is wrong
    assert len(ids) < 0.7 * n_bytes and len(TEXT) < 0.7 * n_bytes
    assert sum(len(tok.decode([i])) for i in ids) < n_bytes
    path = tmp_path / "mixed.txt"
    path.write_bytes(TEXT.encode("utf-8"))
    assert main(["eval", str(bpe_run), "--text", str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed.pop("text") == [str(path)]
    expected = scores(bpe_run, TEXT, n_bytes)
    assert printed["tokens"] == len(ids) and printed["bytes"] == n_bytes
    assert printed == pytest.approx(expected, rel=1e-5)
    assert evaluate_text(load_model(bpe_run), tok, TEXT) == printed


def test_end_token_counts_in_neither_sum_of_bits_per_byte(bpe_run):
    text = TEXT + EOT + "x"  # the end token is a target, but spells no bytes
    n_bytes = len(TEXT.encode("utf-8")) + 1
    tok = load_tokenizer(bpe_run)
    assert tok.encode(text) == [*tok.encode(TEXT), tok.eot_id, *tok.encode("x")]
    expected = scores(bpe_run, text, n_bytes)
    got = evaluate_text(load_model(bpe_run), tok, text)
    assert got["tokens"] == len(tok.encode(text)) and got["bytes"] == n_bytes
    assert got == pytest.approx(expected, rel=1e-5)
