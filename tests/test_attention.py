import math

import pytest
import torch

from conftest import tiny_config
from tlm.model.attention import (
    MultiHeadAttention,
    attention_fused,
    attention_reference,
    causal_mask,
    simplified_attention,
)
from tlm.model.positions import Rotary, sinusoidal_table


def softmax(xs):
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


def test_hand_computed_three_tokens_one_head():
    """Eq. 9.10-9.14 by hand: X [3,2], W_Q = W_K = I, W_V = [[1,2],[3,4]], W_O = I."""
    X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    W_V = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    v = [[1.0, 2.0], [3.0, 4.0], [4.0, 6.0]]  # v_j = x_j W_V
    r = math.sqrt(2.0)  # √d_k
    alphas = [softmax([1 / r]), softmax([0.0, 1 / r]), softmax([1 / r, 1 / r, 2 / r])]
    expected = [[sum(a * v[j][c] for j, a in enumerate(row)) for c in range(2)] for row in alphas]

    q = k = X.view(1, 1, 3, 2)  # q_i = x_i W_Q with W_Q = I
    heads, pattern = attention_reference(q, k, (X @ W_V).view(1, 1, 3, 2), causal_mask(3, 3))
    assert torch.allclose(heads[0, 0], torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    for i, row in enumerate(alphas):
        assert pattern[0, 0, i, : i + 1].tolist() == pytest.approx(row, abs=1e-12)
        assert pattern[0, 0, i, i + 1 :].abs().sum() == 0  # masked: α_ij = 0 for j > i

    # the same numbers through the module's projections (eq. 9.10 and 9.14)
    mha = MultiHeadAttention(tiny_config(d_model=2, n_heads=1, bias=False, position="none"))
    mha = mha.double()
    with torch.no_grad():
        mha.W_Q.copy_(torch.eye(2))
        mha.W_K.copy_(torch.eye(2))
        mha.W_V.copy_(W_V)
        mha.W_O.copy_(torch.eye(2))
    out = mha(X.unsqueeze(0))
    assert torch.allclose(out[0], torch.tensor(expected, dtype=torch.float64), atol=1e-12)


def test_causal_mask_is_bottom_right_aligned():
    assert causal_mask(3, 3).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    # 2 new queries after 3 cached keys: query 0 is at absolute position 3
    assert causal_mask(2, 5).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 4, 7, 16), (3, 2, 33, 32), (1, 12, 64, 64)])
def test_reference_equals_fused(shape):
    torch.manual_seed(0)
    B, H, T, D = shape
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    random_mask = torch.rand(B, 1, T, T) < 0.6
    random_mask[..., 0] = True  # every query sees at least one key
    for mask in (None, causal_mask(T, T), random_mask):
        ref, _ = attention_reference(q, k, v, mask)
        assert torch.allclose(ref, attention_fused(q, k, v, mask), atol=1e-5)
    ref, _ = attention_reference(q, k, v, causal_mask(T, T))
    assert torch.allclose(ref, attention_fused(q, k, v, is_causal=True), atol=1e-5)


def test_reference_equals_fused_with_fewer_queries_than_keys():
    torch.manual_seed(1)
    q = torch.randn(2, 3, 4, 16)
    k, v = torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)
    mask = causal_mask(4, 9)
    ref, pattern = attention_reference(q, k, v, mask)
    assert torch.allclose(ref, attention_fused(q, k, v, mask), atol=1e-5)
    assert torch.allclose(pattern.sum(-1), torch.ones(2, 3, 4))


def test_pattern_rows_are_distributions_over_the_past():
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    _, pattern = attention_reference(q, k, v, causal_mask(10, 10))
    assert torch.allclose(pattern.sum(-1), torch.ones(2, 4, 10), atol=1e-6)
    assert pattern.triu(diagonal=1).abs().max() == 0


def test_simplified_attention_is_a_weighted_sum_of_inputs():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    a, alpha = simplified_attention(x)
    # row 2 (eq. 9.7-9.8): scores x_2·x_0 = 1, x_2·x_1 = 2, x_2·x_2 = 2
    assert alpha[2].tolist() == pytest.approx(softmax([1.0, 2.0, 2.0]))
    assert alpha[1].tolist() == pytest.approx(softmax([0.0, 4.0]) + [0.0])
    assert torch.allclose(a, alpha @ x)  # eq. 9.6
    assert a[0].tolist() == [1.0, 0.0]


def test_module_reference_equals_fused():
    torch.manual_seed(3)
    for position in ("learned", "rope"):
        fused = MultiHeadAttention(tiny_config(position=position))
        for p in fused.parameters():
            torch.nn.init.normal_(p, std=0.2)
        reference = MultiHeadAttention(tiny_config(position=position, attention_impl="reference"))
        reference.load_state_dict(fused.state_dict())
        x = torch.randn(3, 20, 64)
        assert torch.allclose(fused(x), reference(x), atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(4)
    rotary = Rotary(tiny_config(position="rope", context_length=64))
    q, k = torch.randn(16), torch.randn(16)
    positions = torch.arange(64)
    q_at = rotary(q.expand(1, 1, 64, 16), positions)[0, 0]  # the same q at every position
    k_at = rotary(k.expand(1, 1, 64, 16), positions)[0, 0]
    scores = q_at @ k_at.T  # [64, 64], score(i, j)
    for offset in (-5, 0, 3, 17):
        diagonal = torch.diagonal(scores, offset=offset)  # all pairs with j - i == offset
        assert torch.allclose(diagonal, diagonal[0].expand_as(diagonal), atol=1e-4)
    assert not torch.allclose(scores.diagonal(0)[0], scores.diagonal(3)[0])
    assert torch.allclose(q_at.norm(dim=-1), q.norm().expand(64), atol=1e-5)  # a rotation


def test_sinusoidal_table_matches_vaswani():
    table = sinusoidal_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert sinusoidal_table(4, 7).shape == (4, 7)  # odd widths drop the last cosine
