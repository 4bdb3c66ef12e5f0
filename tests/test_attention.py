import itertools
import math

import pytest
import torch

from conftest import tiny_config, written_out
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


def random_attention(impl="fused", seed=0, **shape):
    """A MultiHeadAttention (float64, position "none") with every weight and bias random."""
    mha = MultiHeadAttention(tiny_config(position="none", **shape)).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mha.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64))
    return written_out(mha) if impl == "reference" else mha


def as_lists(mha):
    return {name: param.tolist() for name, param in mha.named_parameters()}


def times(x, W, b):
    """x W + b for a vector x and a matrix W [len(x), n], as explicit sums."""
    return [sum(x[m] * W[m][c] for m in range(len(x))) + b[c] for c in range(len(b))]


def attend_by_hand(q, k, v):
    """Causal attention of one head, eq. 9.11-9.13: (head_i for each i, alpha_ij for j <= i)."""
    d_k = len(q[0])
    heads, alphas = [], []
    for i in range(len(q)):
        # eq. 9.11  score(x_i, x_j) = q_i · k_j / √d_k
        scores = [sum(q[i][m] * k[j][m] for m in range(d_k)) / math.sqrt(d_k) for j in range(i + 1)]
        alpha = softmax(scores)  # eq. 9.12, j <= i only
        heads.append([sum(alpha[j] * v[j][c] for j in range(i + 1)) for c in range(len(v[0]))])
        alphas.append(alpha)
    return heads, alphas


def multi_head_by_hand(mha, x):
    """Eq. 9.15-9.19 for one sequence x (list of T vectors): per-head slices, then W^O."""
    w, H, d_head = as_lists(mha), mha.n_heads, mha.d_head
    z, alphas = [[] for _ in x], []
    for c in range(H):
        cols = range(c * d_head, (c + 1) * d_head)  # head c's columns of W^Q, W^K, W^V
        W_Qc, W_Kc, W_Vc = ([[row[j] for j in cols] for row in w[f"W_{n}"]] for n in "QKV")
        b_Qc, b_Kc, b_Vc = ([w[f"b_{n}"][j] for j in cols] for n in "QKV")
        q = [times(x_i, W_Qc, b_Qc) for x_i in x]  # eq. 9.15  q_i^c = x_i W^Qc
        k = [times(x_j, W_Kc, b_Kc) for x_j in x]
        v = [times(x_j, W_Vc, b_Vc) for x_j in x]
        heads, alpha = attend_by_hand(q, k, v)  # eq. 9.16-9.18
        for i, head in enumerate(heads):
            z[i] += head  # head^1 ⊕ ... ⊕ head^A
        alphas.append(alpha)
    return [times(z_i, w["W_O"], w["b_O"]) for z_i in z], alphas  # eq. 9.19


def listen_to_pattern(mha):
    """The attention pattern α the reference path reports at its hook point."""
    seen = []
    mha.pattern.register_forward_hook(lambda _m, _i, out: seen.append(out))
    return seen


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("d_head", [4, 3])  # W^Q square (a transposed W^Q still runs), then not
def test_one_head_with_random_weights_is_eq_9_9_to_9_14(d_head, impl):
    mha = random_attention(impl, n_heads=1, d_model=4, d_head=d_head)
    X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w, x = as_lists(mha), X.tolist()
    q = [times(x_i, w["W_Q"], w["b_Q"]) for x_i in x]  # eq. 9.9-9.10  q_i = x_i W^Q
    k = [times(x_j, w["W_K"], w["b_K"]) for x_j in x]  # k_j = x_j W^K
    v = [times(x_j, w["W_V"], w["b_V"]) for x_j in x]  # v_j = x_j W^V
    heads, alphas = attend_by_hand(q, k, v)  # eq. 9.11-9.13
    a = [times(head, w["W_O"], w["b_O"]) for head in heads]  # eq. 9.14  a_i = head_i W^O
    pattern = listen_to_pattern(mha)  # reported on the reference path only
    assert torch.allclose(mha(X[None])[0], torch.tensor(a, dtype=torch.float64), atol=1e-12)
    for i, alpha in enumerate(alphas if pattern else []):
        assert pattern[0][0, 0, i].tolist() == pytest.approx(alpha + [0.0] * (4 - i), abs=1e-12)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_heads_are_column_slices_of_the_projections_eq_9_15_to_9_19(impl):
    # d_head 4 != d_model / n_heads = 2: the heads are concatenated to 12 columns, W^O [12, 6]
    mha = random_attention(impl, n_heads=3, d_model=6, d_head=4)
    X = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    pattern = listen_to_pattern(mha)  # reported on the reference path only
    out = mha(X)
    for b in range(2):  # each sequence of the batch on its own
        a, alphas = multi_head_by_hand(mha, X[b].tolist())
        assert torch.allclose(out[b], torch.tensor(a, dtype=torch.float64), atol=1e-12)
        for c, i in itertools.product(range(3), range(5) if pattern else []):
            assert pattern[0][b, c, i, : i + 1].tolist() == pytest.approx(alphas[c][i], abs=1e-12)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_parallel_form_for_a_batch_is_eq_9_32_to_9_36(impl):
    mha = random_attention(impl, seed=3, n_heads=2, d_model=6, d_head=5)
    B, T, H, d_head = 3, 7, 2, 5
    X = torch.randn(B, T, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    Q = X @ mha.W_Q + mha.b_Q  # eq. 9.32  [B,T,6] @ [6,H*d_head] -> [B,T,H*d_head]
    K = X @ mha.W_K + mha.b_K
    V = X @ mha.W_V + mha.b_V
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)  # j > i (Fig. 9.9)
    heads = []
    for c in range(H):
        cols = slice(c * d_head, (c + 1) * d_head)
        Qc, Kc, Vc = Q[..., cols], K[..., cols], V[..., cols]  # eq. 9.34  Q^c = X W^Qc
        scores = Qc @ Kc.transpose(1, 2) / math.sqrt(d_head)  # [B,T,d_head] @ [B,d_head,T]
        alpha = scores.masked_fill(future, float("-inf")).softmax(-1)  # eq. 9.33, 9.35
        heads.append(alpha @ Vc)  # [B,T,T] @ [B,T,d_head] -> [B,T,d_head]
    expected = torch.cat(heads, dim=-1) @ mha.W_O + mha.b_O  # eq. 9.36  [B,T,H*d_head] @ W^O
    with torch.no_grad():
        assert torch.allclose(mha(X), expected, atol=1e-12)


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
        reference = written_out(MultiHeadAttention(tiny_config(position=position)))
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
