"""The bidirectional encoder (issue 66, J&M ch. 11): the blocks without the causal mask, its
input (tokens, positions, segments, LayerNorm), its MLM head, hooks and counts."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config, written_out
from tlm.config import ConfigError, ModelConfig
from tlm.interpret import run_with_cache
from tlm.model import Encoder, build_model
from tlm.model.attention import attention_reference
from tlm.model.counts import parameter_counts


def encoder(seed: int = 0, **overrides) -> Encoder:
    torch.manual_seed(seed)
    model = Encoder(tiny_config(model_type="encoder", norm="post", **overrides)).eval()
    with torch.no_grad():  # weights large enough that every position's context matters
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("gamma") else 0.0, 0.2)
    return model


def written(model: Encoder, ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """The encoder's logits written out from its parameters, one equation a line."""
    c = model.config
    x = model.embedding.E[ids] + model.embedding.P[: ids.shape[1]] + model.S[segments]
    x = F.layer_norm(x, (c.d_model,), model.ln_embed.gamma, model.ln_embed.beta, c.layer_norm_eps)
    for block in model.blocks:
        a = block.attn
        q, k, v = (
            a.split_heads(x @ W + b) for W, b in ((a.W_Q, a.b_Q), (a.W_K, a.b_K), (a.W_V, a.b_V))
        )
        heads, _ = attention_reference(q, k, v, None)  # no mask: every query sees every key
        t1 = heads.transpose(1, 2).reshape(x.shape) @ a.W_O + a.b_O
        t3 = F.layer_norm(x + t1, (c.d_model,), block.ln1.gamma, block.ln1.beta, c.layer_norm_eps)
        h = F.gelu(t3 @ block.ffn.W_1 + block.ffn.b_1) @ block.ffn.W_2 + block.ffn.b_2
        x = F.layer_norm(t3 + h, (c.d_model,), block.ln2.gamma, block.ln2.beta, c.layer_norm_eps)
    t = F.layer_norm(
        F.gelu(x @ model.W_T + model.b_T),
        (c.d_model,),
        model.ln_T.gamma,
        model.ln_T.beta,
        c.layer_norm_eps,
    )
    return t @ model.embedding.E.t() + model.b_U


def test_the_encoder_is_its_equations():
    model = encoder()
    ids = torch.randint(0, 97, (2, 12))
    segments = torch.tensor([[0] * 6 + [1] * 6, [0] * 12])
    assert torch.allclose(model(ids, segments), written(model, ids, segments), atol=1e-5)
    assert torch.allclose(model(ids), written(model, ids, torch.zeros_like(ids)), atol=1e-5)


def test_every_position_reads_both_sides():
    """All-to-all attention: every query but the last gives weight to later keys (a causal
    model's pattern is exactly 0 above the diagonal), and the first position's output
    depends on the last token."""
    model = encoder()
    ids = torch.randint(0, 97, (1, 10))
    _, cache = run_with_cache(model, ids, names=["blocks.0.attn.pattern"])
    pattern = cache["blocks.0.attn.pattern"]  # [1,H,T,T]
    assert (pattern.triu(1).sum(-1)[..., :-1] > 0).all()
    assert torch.allclose(pattern.sum(-1), torch.ones(1, 4, 10))
    changed = torch.cat([ids[:, :-1], (ids[:, -1:] + 1) % 97], 1)
    assert not torch.allclose(model(changed)[0, 0], model(ids)[0, 0], atol=1e-4)


def test_padding_is_never_read():
    model = encoder()
    ids = torch.randint(0, 97, (1, 9))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.tensor([[1] * 9 + [0] * 4])
    alone = model(ids)
    assert torch.allclose(model(padded, attention_mask=mask)[:, :9], alone, atol=1e-5)
    assert torch.allclose(
        written_out(encoder())(padded, attention_mask=mask)[:, :9], alone, atol=1e-5
    )


def test_only_the_selected_positions():
    model = encoder()
    ids = torch.randint(0, 97, (3, 11))
    only = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) < 0.3
    assert torch.allclose(model(ids, only=only), model(ids)[only], atol=1e-6)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("nsp", [False, True])
def test_counts_and_shapes(norm, position, nsp):
    config = tiny_config(model_type="encoder", norm=norm, position=position, nsp=nsp)
    model = build_model(config)
    assert isinstance(model, Encoder)
    assert parameter_counts(config)["total"] == model.num_parameters()
    assert model(torch.randint(0, 97, (2, 7))).shape == (2, 7, 97)


def test_an_encoder_has_no_window():
    with pytest.raises(ConfigError, match="attention window"):
        ModelConfig(model_type="encoder", position="rope", attention_window=8)


def test_the_next_sentence_head_is_its_equation():
    """y = tanh(h_CLS W_P + b_P) W_N + b_N (§11.2.2), beside the MLM logits of one pass."""
    torch.manual_seed(0)
    model = Encoder(tiny_config(model_type="encoder", nsp=True)).eval()
    with torch.no_grad():
        for p in (model.b_P, model.b_N):
            p.normal_(0.0, 0.5)
    ids, segments = torch.randint(0, 97, (3, 9)), torch.tensor([[0] * 4 + [1] * 5] * 3)
    only = torch.rand(3, 9, generator=torch.Generator().manual_seed(2)) < 0.4
    logits, nsp = model(ids, segments, only=only, next_sentence=True)
    h = model.hidden(ids, segments)
    assert torch.allclose(nsp, torch.tanh(h[:, 0] @ model.W_P + model.b_P) @ model.W_N + model.b_N)
    assert torch.allclose(logits, model(ids, segments)[only], atol=1e-6)
    for wrong in ({"task": "tag", "labels": ("O", "B-X")}, {"model_type": "decoder"}):
        with pytest.raises(ConfigError, match="nsp is a pretraining encoder's head"):
            ModelConfig(**{"model_type": "encoder", "nsp": True} | wrong)
