"""`tlm eval --text` reads documents as `prepare` does and separates them with <|endoftext|>."""

import json

import pytest
import torch

from conftest import tiny_config
from tlm import TransformerLM, load_tokenizer
from tlm.checkpoint import save_weights, write_config
from tlm.cli import main
from tlm.model.loss import cross_entropy_reference


@pytest.fixture
def run(docs_chars, tmp_path):
    tokenizer = load_tokenizer(docs_chars)
    config = tiny_config(vocab_size=tokenizer.vocab_size, context_length=64)
    torch.manual_seed(0)
    model = TransformerLM(config).eval()
    for p in model.parameters():  # a model whose predictions depend on the context
        torch.nn.init.normal_(p, std=0.2)
    folder = tmp_path / "run"
    folder.mkdir()
    save_weights(folder / "model.safetensors", model)
    write_config(folder, config, {})
    tokenizer.save(folder / "tokenizer.json")
    return folder, model, tokenizer


def expected_loss(model, ids):
    ids = torch.tensor([ids])
    with torch.no_grad():
        return cross_entropy_reference(model(ids[:, :-1]), ids[:, 1:]).item()


def test_documents_are_separated_by_endoftext(run, tmp_path, capsys):
    folder, model, tok = run
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("The for statement.")
    b.write_text("  \n")  # whitespace only: no document, as in prepare
    c = tmp_path / "c.txt"
    c.write_text("A list is a sequence.")
    assert main(["eval", str(folder), "--text", str(a), str(b), str(c), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    ids = [tok.eot_id, *tok.encode(a.read_text()), tok.eot_id, *tok.encode(c.read_text())]
    assert scores["tokens"] == len(ids) - 1
    assert scores["loss"] == pytest.approx(expected_loss(model, ids), rel=1e-5)
    joined = [tok.eot_id, *tok.encode(a.read_text() + c.read_text())]  # the old reading
    assert abs(expected_loss(model, joined) - scores["loss"]) > 1e-3


def test_line_docs_and_jsonl_read_as_prepare_reads_them(run, tmp_path, capsys):
    folder, model, tok = run
    lines = tmp_path / "lines.txt"
    lines.write_text("first line\nsecond line\n")
    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "first line"}\n{"text": "second line"}\n')
    ids = [tok.eot_id, *tok.encode("first line"), tok.eot_id, *tok.encode("second line")]
    for args in ([str(lines), "--line-docs"], [str(records)]):
        assert main(["eval", str(folder), "--text", *args, "--json"]) == 0
        loss = json.loads(capsys.readouterr().out)["loss"]
        assert loss == pytest.approx(expected_loss(model, ids), rel=1e-5)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["eval", str(folder), "--text", str(empty)]) == 2
    assert "no text to evaluate" in capsys.readouterr().err
