"""Export of the encoder-decoder as Hugging Face's MarianMTModel: logit parity, refusals."""

import pytest
import torch
from transformers import MarianMTModel

from tlm.config import ModelConfig
from tlm.interop.gpt2 import HFFormatError
from tlm.interop.marian import interleaved_to_halves
from tlm.kinds import export_hf
from tlm.model.encoder_decoder import EncoderDecoder
from tlm.model.positions import sinusoidal_table
from tlm.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")  # 28 characters + <|endoftext|>


def make(**overrides) -> EncoderDecoder:
    """Post-norm, sinusoidal, every weight random (biases and LayerNorms included)."""
    values = dict(
        model_type="encoder-decoder",
        vocab_size=40,
        d_model=32,
        n_heads=4,
        n_layers=2,
        n_encoder_layers=3,
        d_ff=48,
        context_length=24,
        position="sinusoidal",
        norm="post",
        activation="gelu",
    )
    torch.manual_seed(0)
    model = EncoderDecoder(ModelConfig(**{**values, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("E"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def test_marian_sinusoids_are_a_permutation_of_the_papers():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    table = MarianSinusoidalPositionalEmbedding(24, 32).create_weight()
    ours = sinusoidal_table(24, 32)
    assert torch.allclose(table, ours[:, interleaved_to_halves(32)], atol=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": False}, {"bias": False}])
def test_exported_marian_gives_tlms_logits(tmp_path, overrides):
    model = make(**overrides)
    out = export_hf(model, TOKENIZER, tmp_path / "marian")
    hf = MarianMTModel.from_pretrained(out).eval()
    src = torch.tensor([[3, 4, 5, 6, 7, 8, 28], [9, 10, 11, 28, 17, 17, 17]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])  # the second padded
    target = torch.tensor([[28, 1, 2, 3, 4], [28, 5, 6, 7, 8]])
    with torch.no_grad():
        ours = model(src, target, mask)
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=target).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_what_marian_cannot_hold_is_refused(tmp_path):
    for overrides, reason in [
        ({"norm": "pre"}, "pre-norm"),
        ({"position": "learned"}, "learned positions"),
        ({"layer_norm_eps": 1e-6}, "layer_norm_eps"),
    ]:
        with pytest.raises(HFFormatError, match=reason):
            export_hf(make(**overrides), TOKENIZER, tmp_path / "refused")
        assert not (tmp_path / "refused").exists()
