import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import NORMS, POSITIONS, written_out
from tlm import ModelConfig, TransformerLM
from tlm.model.counts import parameter_counts


def test_logits_shape(make_model):
    model = make_model()
    assert model(torch.randint(0, 97, (3, 11))).shape == (3, 11, 97)


def test_input_longer_than_context_is_refused(make_model):
    with pytest.raises(ValueError, match="context_length"):
        make_model()(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("position", POSITIONS)
def test_causality(make_model, position, norm):
    """Changing token j never changes the logits at positions < j (the mask of Fig. 9.9)."""
    model = make_model(position=position, norm=norm)
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        base = model(ids)
        for j in (0, 7, 19):
            changed = ids.clone()
            changed[:, j] = (changed[:, j] + 1) % 97
            logits = model(changed)
            assert torch.allclose(logits[:, :j], base[:, :j], atol=1e-6)
            assert not torch.allclose(logits[:, j], base[:, j])  # position j does see it


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("position", POSITIONS)
def test_reference_model_equals_fused_model(make_model, position, norm):
    fused = make_model(position=position, norm=norm)
    reference = written_out(make_model(position=position, norm=norm))
    reference.load_state_dict(fused.state_dict())
    ids = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        assert torch.allclose(fused(ids), reference(ids), atol=1e-5)


def test_weight_tying_shares_storage(make_model):
    tied = make_model()
    assert tied.unembedding().data_ptr() == tied.embedding.E.data_ptr()
    assert "W_U" not in dict(tied.named_parameters())
    h = torch.randn(1, 3, 64)
    assert torch.allclose(tied.unembed(h), h @ tied.embedding.E.T, atol=1e-6)  # eq. 9.45
    untied = make_model(tie_embeddings=False)
    assert untied.unembedding().data_ptr() != untied.embedding.E.data_ptr()
    assert untied.W_U.shape == (64, 97)


def test_tied_embedding_gets_gradient_from_both_ends(make_model):
    model = make_model().train()
    model(torch.tensor([[1, 2, 3, 4]]))[0, -1, 5].backward()
    grad_norms = model.embedding.E.grad.abs().sum(-1)
    assert grad_norms[5] > 0  # from the head: u_5 = h · E[5] (eq. 9.45)
    assert (grad_norms[1:5] > 0).all()  # from the input: rows selected by the tokens
    assert grad_norms[6] == 0  # neither read nor scored


CONFIGS = [
    {},
    {"tie_embeddings": False},
    {"bias": False},
    {"norm": "post"},
    {"position": "rope", "n_heads": 2, "d_head": 24},
    {"position": "sinusoidal", "d_ff": 100, "activation": "relu"},
]


def part_of(name, param):
    """Which part of `parameter_counts` a named parameter of TransformerLM belongs to."""
    leaf = name.rsplit(".", 1)[-1]
    if name == "embedding.E":
        return "embedding"
    if name == "embedding.P":
        return "positions"  # learned P only: sinusoidal P is a buffer, rope and none have none
    if ".attn." in name and leaf in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
        return "attention"
    if ".ffn." in name and leaf in ("W_1", "b_1", "W_2", "b_2"):
        return "ffn"
    if leaf in ("gamma", "beta"):
        return "norms"
    if name == "W_U":
        return "head"
    raise AssertionError(f"parameter {name} {tuple(param.shape)} belongs to no counted part")


@pytest.mark.parametrize("overrides", CONFIGS)
def test_parameter_counts_match_the_model(make_model, overrides):
    model = make_model(**overrides)
    parts = ("embedding", "positions", "attention", "ffn", "norms", "head")
    measured = dict.fromkeys(parts, 0)
    for name, param in model.named_parameters():  # a tied E is listed (and counted) once
        measured[part_of(name, param)] += param.numel()
    measured["non_embedding"] = measured["attention"] + measured["ffn"] + measured["norms"]
    measured["total"] = sum(measured[part] for part in parts)
    counts = parameter_counts(model.config)
    assert {k: counts[k] for k in measured} == measured
    assert model.num_parameters() == measured["total"]
    assert model.num_parameters(non_embedding=True) == measured["non_embedding"]


def test_book_estimate_is_close_for_a_wide_model():
    counts = parameter_counts(ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12))
    assert counts["estimate_12Ld2"] == 12 * 12 * 768**2
    assert abs(counts["non_embedding"] / counts["estimate_12Ld2"] - 1) < 0.01  # eq. 10.55


@pytest.mark.parametrize("overrides", [{}, {"n_heads": 2, "d_head": 24, "d_ff": 100}])
def test_flops_per_token_counts_every_matmul(make_model, overrides):
    model = written_out(make_model(**overrides))
    T = 16
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 97, (1, T)))
    assert model.flops_per_token(seq_len=T) * T == counter.get_total_flops()
    assert model.flops_per_token(seq_len=T, training=True) == 3 * model.flops_per_token(seq_len=T)


def test_initialisation_scales():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=500, d_model=256, n_layers=8, n_heads=4))
    block = model.blocks[3]
    assert block.attn.W_Q.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.W_O.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 0.02/sqrt(2L)
    assert block.ffn.W_2.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert model.embedding.E.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(block.ln1.gamma == 1) and torch.all(block.attn.b_Q == 0)


def test_reset_parameters_with_seed_is_reproducible(make_model):
    a, b = make_model(seed=1), make_model(seed=2)
    a.reset_parameters(seed=7)
    b.reset_parameters(seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
