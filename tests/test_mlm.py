"""Masked-LM pretraining (issue 66, J&M §11.2.1): the masking's statistics measured, whole
words masked together, the loss on the selected positions only, and a run that learns."""

import json
import random

import numpy as np
import pytest
import torch

from tlm.cli import main
from tlm.load import load_model, load_tokenizer
from tlm.model import Encoder
from tlm.tokenizer import encoder_tokenizer, train_tokenizer
from tlm.train import new_run_configs
from tlm.train.mlm import (
    Specials,
    mask_tokens,
    mlm_loss,
    mlm_loss_reference,
    pretraining_loss,
    sentence_pairs,
)

TEXT = "the cat sat on the mat and the dog sat on the log; a bird sang in a tree. " * 4


@pytest.fixture(scope="module")
def bpe_specials():
    return Specials(encoder_tokenizer(train_tokenizer("bpe", [TEXT] * 20, vocab_size=280)))


def test_a_bpe_mask_takes_the_space_before_it():
    """A masked word was one token with its space (" sat"): "[MASK]" in a text takes the
    space before it, so a filled mask reads as training masked (RoBERTa's <mask> does so);
    a character tokenizer's space is a token of its own, and stays."""
    tok = encoder_tokenizer(train_tokenizer("bpe", [TEXT] * 20, vocab_size=280))
    mask = tok.special_id("[MASK]")
    assert tok.encode("the [MASK] sat") == [*tok.encode("the"), mask, *tok.encode(" sat")]
    chars = encoder_tokenizer(train_tokenizer("char", [TEXT]))
    space = chars.encode(" ")
    assert chars.encode("a [MASK]") == [*chars.encode("a"), *space, chars.special_id("[MASK]")]


def test_the_masking_statistics(bpe_specials):
    """Of 200,000 text positions: 15% selected, and of those 80% [MASK], 10% another token,
    10% unchanged; [CLS] and [SEP] never."""
    s = bpe_specials
    ids = s.wrap(s.text_ids[torch.randint(0, len(s.text_ids), (400, 500))])
    inputs, selected = mask_tokens(ids, s, 0.15, torch.Generator().manual_seed(0), False)
    text = (ids != s.cls) & (ids != s.sep)
    assert not selected[~text].any() and torch.equal(inputs[~text], ids[~text])
    assert abs(selected.sum() / text.sum() - 0.15) < 0.003
    picked, original = inputs[selected], ids[selected]
    masked = (picked == s.mask).float().mean()
    unchanged = (picked == original).float().mean()
    other = ((picked != s.mask) & (picked != original)).float().mean()
    assert abs(masked - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01 and abs(other - 0.1) < 0.01
    assert (inputs[~selected & text] == ids[~selected & text]).all()  # the rest as they were
    assert s.text[inputs[selected & (inputs != s.mask)]].all()  # random tokens are text


def test_whole_words_are_masked_together(bpe_specials):
    s = bpe_specials
    tok = encoder_tokenizer(train_tokenizer("bpe", [TEXT] * 20, vocab_size=280))
    words = ["extraordinarily", "unbelievable", "cat", "photosynthesis", "sat"]
    ids = torch.tensor([tok.encode(" ".join(words * 40))])
    starts = s.word_starts(ids)
    assert starts.sum() == 200  # one start a word (each word's first token has its space)
    _, selected = mask_tokens(ids, s, 0.3, torch.Generator().manual_seed(0), True)
    first = torch.cummax(torch.where(starts, torch.arange(ids.shape[1]), 0), 1).values
    assert torch.equal(selected, selected.gather(1, first))  # a word's tokens go together
    assert 0.15 < selected[starts].float().mean() < 0.45


def test_every_window_is_scored(bpe_specials):
    s = bpe_specials
    ids = s.wrap(s.text_ids[torch.randint(0, len(s.text_ids), (64, 3))])
    _, selected = mask_tokens(ids, s, 0.01, torch.Generator().manual_seed(0), False)
    assert selected.any(1).all()


def test_the_loss_scores_the_selected_positions_only():
    from conftest import tiny_config

    torch.manual_seed(0)
    model = Encoder(tiny_config(model_type="encoder")).eval()
    targets = torch.randint(0, 97, (4, 16))
    inputs = targets.clone()
    selected = torch.rand(4, 16) < 0.3
    inputs[selected] = 5
    fast, slow = (
        mlm_loss(model, inputs, targets, selected),
        mlm_loss_reference(model, inputs, targets, selected),
    )
    assert torch.allclose(fast, slow, atol=1e-6)
    logits = model(inputs)  # by hand: -mean log p(target) at the selected positions
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(fast, -logp[selected].mean(), atol=1e-6)


def test_a_run_learns_to_fill_masks(words_mlm, capsys):
    mlm_run = words_mlm
    rows = [json.loads(line) for line in (mlm_run / "metrics.jsonl").read_text().splitlines()]
    train = [r["train_loss"] for r in rows if "train_loss" in r]
    val = [r for r in rows if "val_loss" in r]
    assert train[-1] < train[0] - 2.0  # from ~ln V: the letters read from both sides
    assert val[-1]["val_accuracy"] > 0.8  # the most frequent character: under 0.25
    model, tok = load_model(mlm_run), load_tokenizer(mlm_run)
    assert isinstance(model, Encoder)
    assert (
        tok.special_id("[MASK]") == model.config.vocab_size - 2
    )  # after <|endoftext|>, [CLS], [SEP]
    card = (mlm_run / "MODEL_CARD.md").read_text()
    assert "masked-token accuracy" in card and "80% [MASK]" in card
    assert main(["fill-mask", str(mlm_run), "string pyt[MASK]on module", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["masks"]) == 1 and len(out["masks"][0]) == 5
    assert out["masks"][0][0]["token"] == "h"  # p-y-t-?-o-n: only "python" fits
    assert sum(c["probability"] for c in out["masks"][0]) <= 1.0 + 1e-6


def test_an_encoder_run_takes_berts_blocks_unless_told(words_data, tmp_path):
    values = {"data": str(words_data), "out": str(tmp_path / "run"), "objective": "mlm"}
    model_config, _, _ = new_run_configs({}, values)
    assert (model_config.model_type, model_config.norm, model_config.position) == (
        "encoder",
        "post",
        "learned",
    )
    assert model_config.vocab_size == load_tokenizer(words_data).vocab_size + 4
    model_config, _, _ = new_run_configs({"norm": "pre"}, values)
    assert model_config.norm == "pre"


def test_commands_refuse_the_other_kind(words_mlm, words_data, tmp_path, capsys):
    mlm_run = words_mlm
    assert main(["generate", str(mlm_run), "--prompt", "a"]) == 2
    assert "bidirectional encoder" in capsys.readouterr().err
    assert main(["lm-eval", str(mlm_run), "--tasks", "hellaswag"]) == 2  # not for encoders
    assert "tlm eval RUN --data FILE" in capsys.readouterr().err
    assert main(["fill-mask", str(mlm_run), "python module"]) == 2
    assert "no [MASK]" in capsys.readouterr().err
    out = tmp_path / "wrong"
    args = ["train", "--data", str(words_data), "--out", str(out), "--model-type", "encoder"]
    assert main([*args, "--max-steps", "1"]) == 2
    assert "--objective mlm" in capsys.readouterr().err


def test_sentence_pairs_are_berts(bpe_specials):
    """[CLS] A [SEP] B [SEP]: A the window's first tokens, B the rest of it (IsNext) or as
    many tokens from one other place (NotNext, half of them), segments 0 then 1."""
    s = bpe_specials
    tokens = np.arange(100_000) + 1_000  # each token once: where a run came from is plain
    starts = np.random.default_rng(0).integers(0, len(tokens) - 20, 2000)
    ids, segments, not_next = sentence_pairs(tokens, starts, 20, s, torch.Generator())
    assert ids.shape == segments.shape == (2000, 23) and 0.46 < not_next.float().mean() < 0.54
    for row, seg, other, start in zip(ids, segments, not_next, starts, strict=True):
        seps = (row == s.sep).nonzero()[:, 0].tolist()
        assert row[0] == s.cls and len(seps) == 2 and seps[1] == 22
        a, b = row[1 : seps[0]].numpy(), row[seps[0] + 1 : -1].numpy()
        assert seg.tolist() == [0] * (seps[0] + 1) + [1] * (22 - seps[0])
        assert (a == tokens[start : start + len(a)]).all() and len(a) >= 1 and len(b) >= 1
        if not other:
            assert (b == tokens[start + len(a) : start + 20]).all()
        else:  # one run of the stream, from another place
            assert (np.diff(b) == 1).all() and b[0] != tokens[start + len(a)]


def test_the_pretraining_loss_adds_the_next_sentence_loss():
    from conftest import tiny_config

    torch.manual_seed(0)
    model = Encoder(tiny_config(model_type="encoder", nsp=True)).eval()
    targets, segments = torch.randint(0, 97, (4, 16)), torch.tensor([[0] * 7 + [1] * 9] * 4)
    selected, not_next = torch.rand(4, 16) < 0.3, torch.tensor([True, False, False, True])
    inputs = targets.masked_fill(selected, 5)
    got = pretraining_loss(model, inputs, targets, selected, segments, not_next)
    logits, nsp = model(inputs, segments), model(inputs, segments, next_sentence=True)[1]
    mlm = -torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0][selected].mean()
    nsp_nll = -torch.log_softmax(nsp, -1)[torch.arange(4), not_next.long()].mean()
    assert torch.allclose(got, mlm + nsp_nll, atol=1e-6)


def test_a_run_learns_next_sentence_prediction(tmp_path):
    """Long paragraphs of four kinds (lower case, upper case, digits, signs): a B from
    elsewhere is of another kind 3/4 of the time, a B that follows A almost never, so
    telling pairs apart can reach ~86%; chance is 50%."""
    rng = random.Random(0)
    kinds = ["python module import ", "STRING OBJECT RETURN ", "0123 4567 89 ", "+-*/ <=> %& "]
    text = "".join(rng.choice(kinds) * rng.randint(20, 40) for _ in range(150))
    (tmp_path / "kinds.txt").write_text(text)
    from tlm.data import prepare

    prepare([str(tmp_path / "kinds.txt")], tmp_path / "data", tokenizer="char", progress=False)
    run = tmp_path / "run"
    args = ["train", "--objective", "mlm", "--nsp", "--data", str(tmp_path / "data")]
    args += ["--out", str(run), "--d-model", "64", "--n-layers", "2", "--n-heads", "4"]
    args += ["--context-length", "32", "--batch-size", "32", "--max-steps", "200", "--lr", "3e-3"]
    args += ["--warmup-steps", "10", "--position", "rope", "--norm", "pre", "--quiet"]
    assert main([*args, "--eval-interval", "200", "--eval-tokens", "8192"]) == 0
    val = [
        json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines() if "val_nsp" in r
    ]
    assert val[-1]["val_nsp_accuracy"] > 0.75, val[-1]
    assert (
        load_model(run).config.nsp
        and "next-sentence accuracy" in (run / "MODEL_CARD.md").read_text()
    )
