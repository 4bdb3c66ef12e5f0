"""tlm's encoder <-> Hugging Face BERT (issue 66): an export that transformers'
BertForMaskedLM computes as tlm does, its tokenizer read by AutoTokenizer, and a BERT
directory written by transformers read into tlm."""

import pytest
import torch

from conftest import save_run, tiny_config
from tlm.cli import main
from tlm.load import load_model, load_tokenizer
from tlm.model import Encoder
from tlm.tokenizer import encoder_tokenizer, train_tokenizer

transformers = pytest.importorskip("transformers")

TEXT = "the cat sat on the mat and the dog sat on the log; a bird sang in a tree. " * 4


def varied_encoder(vocab_size: int, **overrides) -> Encoder:
    torch.manual_seed(0)
    config = tiny_config(
        **{"model_type": "encoder", "norm": "post", "vocab_size": vocab_size} | overrides
    )
    model = Encoder(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("gamma") else 0.0, 0.2)
    return model


@pytest.fixture(scope="module", params=["bpe", "char"])
def exported(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"bert-{request.param}")
    size = {"vocab_size": 280} if request.param == "bpe" else {}
    tok = encoder_tokenizer(train_tokenizer(request.param, [TEXT] * 20, **size))
    model = varied_encoder(tok.vocab_size)
    run = save_run(folder / "run", model, tok)
    assert main(["export-hf", str(run), str(folder / "hf")]) == 0
    return model, tok, folder / "hf"


def test_transformers_computes_what_tlm_does(exported):
    model, tok, hf = exported
    theirs = transformers.BertForMaskedLM.from_pretrained(hf).eval()
    ids = torch.randint(0, tok.vocab_size, (2, 14))
    segments = torch.tensor([[0] * 8 + [1] * 6, [0] * 14])
    mask = torch.tensor([[1] * 14, [1] * 10 + [0] * 4])
    with torch.no_grad():
        got = theirs(input_ids=ids, token_type_ids=segments, attention_mask=mask).logits
    ours = model(ids, segments, mask)
    assert torch.allclose(got[0], ours[0], atol=1e-5)
    assert torch.allclose(got[1, :10], ours[1, :10], atol=1e-5)  # (padding rows: not read)
    back = load_model(hf)  # and tlm reads its export back: the same function, the same ids
    assert torch.allclose(back(ids, segments, mask), ours, atol=1e-5)
    assert load_tokenizer(hf).encode(TEXT) == tok.encode(TEXT)


def test_autotokenizer_gives_the_encoders_input(exported):
    _, tok, hf = exported
    theirs = transformers.AutoTokenizer.from_pretrained(hf)
    cls, sep = tok.special_id("[CLS]"), tok.special_id("[SEP]")
    text = "the cat [MASK] on the mat"
    assert theirs(text)["input_ids"] == [cls, *tok.encode(text), sep]
    pair = theirs("a bird", "sang in a tree")
    assert pair["input_ids"] == [
        cls,
        *tok.encode("a bird"),
        sep,
        *tok.encode("sang in a tree"),
        sep,
    ]
    assert pair["token_type_ids"] == [0] * (len(tok.encode("a bird")) + 2) + [1] * (
        len(tok.encode("sang in a tree")) + 1
    )
    assert theirs.mask_token_id == tok.special_id("[MASK]")
    assert theirs.pad_token_id == tok.special_id("[PAD]")


def test_a_bert_directory_reads_into_tlm(tmp_path):
    config = transformers.BertConfig(
        vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=40,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(tmp_path / "bert")
    ours = load_model(tmp_path / "bert")
    assert isinstance(ours, Encoder) and ours.config.layer_norm_eps == 1e-12
    ids = torch.randint(0, 120, (2, 20))
    segments = torch.randint(0, 2, (2, 20))
    with torch.no_grad():
        want = theirs(input_ids=ids, token_type_ids=segments).logits
    assert torch.allclose(ours(ids, segments), want, atol=1e-5)


def test_an_encoder_with_next_sentence_prediction_is_bert_for_pretraining(tmp_path):
    """Both heads equal transformers' BertForPreTraining's; read back, and read as the MLM
    model where the directory says BertForMaskedLM but holds the NSP head (as Google's)."""
    import json

    tok = encoder_tokenizer(train_tokenizer("char", [TEXT]))
    model = varied_encoder(tok.vocab_size, nsp=True)
    run = save_run(tmp_path / "run", model, tok)
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    theirs = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, tok.vocab_size, (3, 12))
    segments = torch.tensor([[0] * 5 + [1] * 7] * 3)
    with torch.no_grad():
        got = theirs(input_ids=ids, token_type_ids=segments)
        logits, nsp = model(ids, segments, next_sentence=True)
        assert torch.allclose(got.prediction_logits, logits, atol=1e-5)
        assert torch.allclose(got.seq_relationship_logits, nsp, atol=1e-5)
        back = load_model(tmp_path / "hf")
        assert back.config.nsp and torch.allclose(back(ids, segments, next_sentence=True)[1], nsp)
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        config["architectures"] = ["BertForMaskedLM"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
        mlm = load_model(tmp_path / "hf")
        assert not mlm.config.nsp and torch.allclose(mlm(ids, segments), logits, atol=1e-5)


def test_training_steps_are_transformers_from_one_start():
    """BertForMaskedLM started from a tlm encoder's weights and trained on the same masked
    batches with the same AdamW: the same gradients and the same loss at every step, tlm's
    head run on the selected positions only (mlm_loss) against transformers' labels."""
    from tlm.interop.bert import bert_weights, state_to_bert
    from tlm.train.mlm import Specials, mask_tokens, mlm_loss

    tok = encoder_tokenizer(train_tokenizer("bpe", [TEXT] * 20, vocab_size=280))
    specials = Specials(tok)
    ours = varied_encoder(tok.vocab_size).train()
    config = transformers.BertConfig(
        vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=ours.config.context_length,
        layer_norm_eps=ours.config.layer_norm_eps, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, hidden_act="gelu",
    )  # fmt: skip
    assert (
        (config.hidden_size, config.num_hidden_layers)
        == (64, 2)
        == (ours.config.d_model, ours.config.n_layers)
    )  # the shape of tiny_config
    theirs = transformers.BertForMaskedLM(config).train()
    theirs.load_state_dict(state_to_bert(ours.state_dict(), ours.config), strict=False)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor(tok.encode(TEXT * 2)[:150]).view(5, 30)
    for step in range(5):
        targets = specials.wrap(ids.roll(step, 1))
        inputs, selected = mask_tokens(targets, specials, 0.15, generator, False)
        losses = [
            mlm_loss(ours, inputs, targets, selected),
            theirs(input_ids=inputs, labels=targets.masked_fill(~selected, -100)).loss,
        ]
        assert torch.allclose(losses[0], losses[1], atol=1e-5), (step, losses)
        for loss in losses:
            loss.backward()
        if step == 0:  # every gradient, as transformers' names map to tlm's
            grads = {n: p.grad for n, p in theirs.named_parameters()}
            for name, grad in bert_weights(grads, ours.config):
                assert torch.allclose(ours.get_parameter(name).grad, grad, atol=1e-6), name
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_what_bert_cannot_express_is_refused(tmp_path, capsys):
    tok = encoder_tokenizer(train_tokenizer("char", [TEXT]))
    run = save_run(tmp_path / "run", varied_encoder(tok.vocab_size, norm="pre"), tok)
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 2
    assert "BERT's blocks are post-norm" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
