import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from tlm.model.functional import gelu_tanh, layer_norm, linear
from tlm.model.layers import Embedding, FeedForward, LayerNorm, PostNormBlock, PreNormBlock


def layer_norm_by_the_book(x, gamma, beta, eps):
    """Eq. 9.22-9.25 written out over the last dimension, ε inside the root (as GPT-2 and torch)."""
    d = x.shape[-1]
    mu = x.sum(-1, keepdim=True) / d  # eq. 9.22
    sigma = (((x - mu) ** 2).sum(-1, keepdim=True) / d + eps).sqrt()  # eq. 9.23, ε added
    x_hat = (x - mu) / sigma  # eq. 9.24
    return gamma * x_hat + (0 if beta is None else beta)  # eq. 9.25


@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 64), (1, 1, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_is_eq_9_22_to_9_25(shape, bias):
    generator = torch.Generator().manual_seed(0)
    d = shape[-1]
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    # rows from tiny to large spread around means far from 0: with eps = 0.05, a row of
    # variance ~1e-4 is scaled ~4x apart by σ = √(var + ε) and by √var + ε
    scale = torch.logspace(-2, 1, shape[-2], dtype=torch.float64)[:, None]  # [rows, 1]
    mean = 5 * torch.randn(*shape[:-1], 1, generator=generator, dtype=torch.float64)
    x = x * scale + mean
    gamma = torch.randn(d, generator=generator, dtype=torch.float64) + 1
    beta = torch.randn(d, generator=generator, dtype=torch.float64) if bias else None
    eps = 0.05
    expected = layer_norm_by_the_book(x, gamma, beta, eps)
    if bias:
        assert torch.allclose(layer_norm(x, gamma, beta, eps), expected, atol=1e-12, rtol=0)
    module = LayerNorm(d, eps, bias).double()
    with torch.no_grad():
        module.gamma.copy_(gamma)
        if bias:
            module.beta.copy_(beta)
    assert torch.allclose(module(x), expected, atol=1e-12, rtol=0)


def test_layer_norm_output_has_zero_mean_unit_variance():
    x = torch.randn(4, 32) * 10 - 3
    out = layer_norm(x, torch.ones(32), torch.zeros(32), eps=0.0)
    assert torch.allclose(out.mean(-1), torch.zeros(4), atol=1e-5)
    assert torch.allclose(out.var(-1, unbiased=False), torch.ones(4), atol=1e-4)


def test_gelu_is_gpt2_tanh_approximation():
    x = torch.linspace(-6, 6, 101)
    assert torch.allclose(gelu_tanh(x), F.gelu(x, approximate="tanh"), atol=1e-6)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_ffn_is_eq_9_21(activation):
    torch.manual_seed(1)
    ffn = FeedForward(tiny_config(activation=activation))
    for p in ffn.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 5, 64)
    act = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": gelu_tanh}[activation]
    expected = act(x @ ffn.W_1 + ffn.b_1) @ ffn.W_2 + ffn.b_2
    assert torch.allclose(ffn(x), expected, atol=1e-4)


def test_linear_is_right_multiplication():
    x, W, b = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    assert torch.allclose(linear(x, W, b), x @ W + b, atol=1e-6)
    assert torch.allclose(linear(x, W, None), x @ W, atol=1e-6)


def test_embedding_row_selection_equals_one_hot_times_E():
    torch.manual_seed(2)
    embedding = Embedding(tiny_config(position="none"))
    torch.nn.init.normal_(embedding.E)
    ids = torch.tensor([[5, 0, 96, 5]])
    one_hot = F.one_hot(ids, num_classes=97).float()  # [1,4,V]
    assert torch.allclose(embedding(ids, torch.arange(4)), one_hot @ embedding.E)  # Fig. 9.12


def test_learned_positions_are_added():
    torch.manual_seed(3)
    embedding = Embedding(tiny_config())
    torch.nn.init.normal_(embedding.E)
    torch.nn.init.normal_(embedding.P)
    ids = torch.tensor([[1, 2, 3]])
    expected = embedding.E[ids[0]] + embedding.P[:3]  # X = E[id(i)] + P[i]
    assert torch.allclose(embedding(ids, torch.arange(3))[0], expected)


def _randomised(block):
    torch.manual_seed(4)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return block.eval()


def test_prenorm_block_is_eq_9_39_to_9_44():
    block = _randomised(PreNormBlock(tiny_config(position="none")))
    X = torch.randn(2, 6, 64)
    positions = torch.arange(6)
    T1 = layer_norm(X, block.ln1.gamma, block.ln1.beta)  # eq. 9.39
    T2 = block.attn(T1, positions)  # eq. 9.40
    T3 = T2 + X  # eq. 9.41
    T4 = layer_norm(T3, block.ln2.gamma, block.ln2.beta)  # eq. 9.42
    T5 = block.ffn(T4)  # eq. 9.43
    assert torch.allclose(block(X, positions), T5 + T3, atol=1e-5)  # eq. 9.44


def test_postnorm_block_is_eq_10_26_to_10_31():
    block = _randomised(PostNormBlock(tiny_config(position="none", norm="post")))
    X = torch.randn(2, 6, 64)
    positions = torch.arange(6)
    T1 = block.attn(X, positions)  # eq. 10.26
    T3 = layer_norm(X + T1, block.ln1.gamma, block.ln1.beta)  # eq. 10.27-10.28
    T5 = block.ffn(T3) + T3  # eq. 10.29-10.30
    H = layer_norm(T5, block.ln2.gamma, block.ln2.beta)  # eq. 10.31
    assert torch.allclose(block(X, positions), H, atol=1e-5)
