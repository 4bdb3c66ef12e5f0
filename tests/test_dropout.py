"""Dropout at its three places (GPT-2's attn_pdrop, resid_pdrop, embd_pdrop): each knob acts
alone, `dropout` alone behaves as before the split, and residual dropout leaves attention on
the fused kernel without dropout."""

import json

import pytest
import torch

import tlm.model.attention as attention
from conftest import tiny_config
from tlm.cli import main
from tlm.config import ConfigError, ModelConfig
from tlm.interop.gpt2 import config_from_gpt2, gpt2_config
from tlm.interop.marian import marian_config
from tlm.model import TransformerLM
from tlm.model.encoder_decoder import EncoderDecoder

KNOBS = ("attn_dropout", "resid_dropout", "embd_dropout")
IDS = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def fused_rates(monkeypatch):
    """The dropout_p of every call of the fused kernel, in order."""
    seen, fused = [], attention.attention_fused

    def spy(q, k, v, mask=None, dropout_p=0.0, is_causal=False):
        seen.append(dropout_p)
        return fused(q, k, v, mask, dropout_p, is_causal)

    monkeypatch.setattr(attention.MultiHeadAttention, "fused", staticmethod(spy))
    return seen


def run(model: TransformerLM, train: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the embedding X after its dropout) of one forward pass in train or eval mode."""
    embedded = []
    handle = model.embed.register_forward_hook(lambda _m, _i, out: embedded.append(out))
    model.train(train)
    torch.manual_seed(seed)
    with torch.no_grad():
        logits = model(IDS)
    handle.remove()
    return logits, embedded[0]


@pytest.mark.parametrize("knob", KNOBS)
def test_each_dropout_acts_alone(knob, fused_rates):
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(dropout=0.0, **{knob: 0.5}))
    eval_logits, eval_x = run(model, train=False)
    fused_rates.clear()
    train_logits, train_x = run(model, train=True)
    assert not torch.allclose(train_logits, eval_logits)  # something drops
    assert torch.equal(train_x, eval_x) == (knob != "embd_dropout")  # X only by embd_dropout
    assert fused_rates == [0.5 if knob == "attn_dropout" else 0.0] * 2  # α only by attn_dropout
    # X and α untouched by resid_dropout, yet the logits differ: the residual branches drop


def test_three_zeros_override_dropout(fused_rates):
    model = TransformerLM(tiny_config(dropout=0.5, **dict.fromkeys(KNOBS, 0.0)))
    assert torch.equal(run(model, train=True)[0], run(model, train=False)[0])
    assert set(fused_rates) == {0.0}


def test_residual_dropout_keeps_attention_fused_and_undropped(fused_rates):
    """attn_dropout 0, resid_dropout 0.5: the fused kernel runs with dropout_p 0, and equals
    the written-out attention (no dropout on α) under the same residual dropout masks."""
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(dropout=0.0, attn_dropout=0.0, resid_dropout=0.5))
    fused = run(model, train=True, seed=3)[0]
    assert fused_rates == [0.0, 0.0]
    from conftest import written_out

    reference = run(written_out(model), train=True, seed=3)[0]
    assert fused_rates == [0.0, 0.0]  # the written-out path took the second pass
    assert torch.allclose(fused, reference, atol=1e-5)
    assert not torch.allclose(fused, run(model, train=False)[0])


def test_dropout_alone_behaves_as_before_the_split():
    """An old config.json (no split keys) and `dropout` alone: every place at that rate."""
    old = tiny_config(dropout=0.2).to_dict()
    for knob in KNOBS:
        del old[knob]
    config = ModelConfig.from_dict(old)
    assert (config.attn_dropout, config.resid_dropout, config.embd_dropout) == (None,) * 3
    assert config.attn_dropout_p == config.resid_dropout_p == config.embd_dropout_p == 0.2
    model = TransformerLM(config)
    assert model.drop.p == 0.2
    assert all(b.drop.p == 0.2 and b.attn.dropout == 0.2 for b in model.blocks)
    assert config.replace(dropout=0.0).attn_dropout_p == 0.0  # unset knobs follow `dropout`


@pytest.mark.parametrize("knob", KNOBS)
def test_bad_rates_name_the_field(knob):
    with pytest.raises(ConfigError, match=f"{knob} must be in \\[0, 1\\)"):
        tiny_config(**{knob: 1.0})


def test_the_encoder_decoder_uses_the_three_knobs(fused_rates):
    values = dict(model_type="encoder-decoder", vocab_size=50, d_model=32, n_heads=4)
    values |= dict(n_layers=2, n_encoder_layers=2, context_length=16, position="sinusoidal")
    config = ModelConfig(**values, dropout=0.0, attn_dropout=0.1, resid_dropout=0.2)
    model = EncoderDecoder(config.replace(embd_dropout=0.3))
    assert model.drop.p == 0.3
    assert all(block.drop.p == 0.2 for block in [*model.encoder, *model.decoder])
    attentions = [b.attn for b in model.encoder] + [
        a for b in model.decoder for a in (b.attn, b.cross)
    ]
    assert {a.dropout for a in attentions} == {0.1}
    model = EncoderDecoder(config.replace(attn_dropout=0.0)).train()  # residual dropout only
    src, tgt = IDS[:, :8] % 50, IDS[:, 8:] % 50
    with torch.no_grad():
        model(src, tgt)
    assert fused_rates == [0.0] * 6  # 2 encoder + 2 x 2 decoder attentions, none dropped


def test_hugging_face_configs_carry_the_three_rates():
    config = tiny_config(dropout=0.1, attn_dropout=0.0, embd_dropout=0.2)
    hf = gpt2_config(config, eot_id=0)
    assert (hf["attn_pdrop"], hf["resid_pdrop"], hf["embd_pdrop"]) == (0.0, 0.1, 0.2)
    back = config_from_gpt2(hf)
    assert (back.attn_dropout_p, back.resid_dropout_p, back.embd_dropout_p) == (0.0, 0.1, 0.2)
    same = config_from_gpt2({"model_type": "gpt2"})  # GPT-2's default: 0.1 each
    assert same.dropout == 0.1 and same.attn_dropout is None and same.embd_dropout is None
    values = dict(model_type="encoder-decoder", position="sinusoidal", norm="post")
    marian = marian_config(ModelConfig(**values, dropout=0.1, attn_dropout=0.05), eot_id=0)
    assert (marian["dropout"], marian["attention_dropout"]) == (0.1, 0.05)


def test_train_flags_set_the_knobs(docs_chars, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", "--data", str(docs_chars), "--out", str(run_dir), "--max-steps", "2"]
    args += ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--context-length", "16"]
    args += ["--dropout", "0.1", "--attn-dropout", "0", "--embd-dropout", "0.3", "--quiet"]
    assert main(args) == 0
    saved = json.loads((run_dir / "config.json").read_text())["model"]
    assert (saved["dropout"], saved["attn_dropout"], saved["embd_dropout"]) == (0.1, 0.0, 0.3)
    assert saved["resid_dropout"] is None
    capsys.readouterr()
    assert main([*args[:4], str(tmp_path / "bad"), *args[5:], "--resid-dropout", "1"]) == 2
    err = capsys.readouterr().err
    assert "resid_dropout must be in [0, 1)" in err and err.count("\n") == 1
