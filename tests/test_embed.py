"""Contextual embeddings and anisotropy (issue 66, J&M §11.3): pooling as stated, the mean
cosine of random words as its definition, and `tlm embed` to .npy and .parquet."""

import numpy as np
import pytest
import torch

from tlm.cli import main
from tlm.load import load_model, load_tokenizer
from tlm.tasks.embed import anisotropy, embed_texts, mean_cosine

TEXTS = ["python module import", "string object", "return string module"]


def test_pooling_is_the_mean_or_cls(words_mlm):
    model, tok = load_model(words_mlm), load_tokenizer(words_mlm)
    vectors = embed_texts(model, tok, TEXTS, "mean", batch_size=2)  # padding in a batch
    cls_vectors = embed_texts(model, tok, TEXTS, "cls")
    for text, mean, cls in zip(TEXTS, vectors, cls_vectors, strict=True):
        ids = [tok.special_id("[CLS]"), *tok.encode(text), tok.special_id("[SEP]")]
        with torch.no_grad():
            h = model.hidden(torch.tensor([ids]))[0]  # alone: no padding at all
        assert np.allclose(mean, h.mean(0).numpy(), atol=1e-5)
        assert np.allclose(cls, h[0].numpy(), atol=1e-5)


def test_mean_cosine_is_its_definition():
    g = torch.Generator().manual_seed(0)
    same = torch.ones(6, 4)
    assert mean_cosine(same, torch.tensor([0, 0, 1, 1, 2, 2]), 50, g) == pytest.approx(1.0)
    axes = torch.eye(4)  # four texts, one word each: every pair orthogonal
    assert mean_cosine(axes, torch.arange(4), 50, g) == pytest.approx(0.0)
    mixed = torch.tensor([[1.0, 0], [1.0, 0], [0, 1.0]])  # text 0 twice: its own pairs left out
    assert mean_cosine(mixed, torch.tensor([0, 0, 1]), 200, g) == pytest.approx(0.0)


def test_anisotropy_at_every_layer_and_the_command(words_mlm, tmp_path, capsys):
    model, tok = load_model(words_mlm), load_tokenizer(words_mlm)
    values = anisotropy(model, tok, TEXTS * 4, pairs=500)
    assert len(values) == model.config.n_layers + 1 and all(-1 <= v <= 1 for v in values)
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n\n")
    args = ["embed", str(words_mlm), str(tmp_path / "texts.txt"), "--out", str(tmp_path / "v.npy")]
    assert main([*args, "--anisotropy"]) == 0
    printed = capsys.readouterr().out
    assert "3 texts" in printed and "block 1" in printed
    assert np.load(tmp_path / "v.npy").shape == (3, model.config.d_model)
    assert (tmp_path / "v.anisotropy.png").read_bytes()[:4] == b"\x89PNG"
    pq = pytest.importorskip("pyarrow.parquet")
    assert main([*args[:3], "--out", str(tmp_path / "v.parquet"), "--pool", "cls"]) == 0
    table = pq.read_table(tmp_path / "v.parquet").to_pydict()
    assert table["text"] == TEXTS and len(table["embedding"][0]) == model.config.d_model
    assert main([*args[:3], "--out", str(tmp_path / "v.csv")]) == 2
    # texts from a Parquet file's column: the same vectors as from the text file
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "in.parquet")
    back = ["embed", str(words_mlm), str(tmp_path / "in.parquet"), "--text-field", "body"]
    assert main([*back, "--out", str(tmp_path / "w.npy")]) == 0
    assert np.allclose(np.load(tmp_path / "w.npy"), np.load(tmp_path / "v.npy"), atol=1e-6)
    assert main([*back[:3], "--out", str(tmp_path / "w.npy")]) == 2  # no column "text"
    assert "no column 'text'" in capsys.readouterr().err
