"""The CPU decoding route (`tlm.model.blas`): numpy's BLAS products equal torch's."""

import threading

import pytest
import torch
import torch.nn.functional as F

from tlm import ModelConfig, TransformerLM
from tlm.model import blas
from tlm.model.functional import linear
from tlm.model.kv_cache import KVCache


def make_model(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    shape = {"vocab_size": 97, "d_model": 64, "n_layers": 2, "n_heads": 4, "context_length": 32}
    return TransformerLM(ModelConfig(**{**shape, **overrides})).eval()


@pytest.mark.parametrize("rows", [(1,), (3,), (2, 5)])
def test_product_is_torchs_linear(rows):
    torch.manual_seed(0)
    x, W, b = torch.randn(*rows, 48), torch.randn(48, 80), torch.randn(80)
    E = torch.randn(80, 48)  # a tied head reads E^T: a transposed view, not a copy
    assert torch.allclose(blas.product(x, W, b), F.linear(x, W.t(), b), atol=1e-5)
    assert torch.allclose(blas.product(x, E.t(), None), x @ E.t(), atol=1e-5)
    assert blas.product(x, W, None).shape == (*rows, 80)


@pytest.mark.parametrize("tie", [True, False])
def test_decoding_route_equals_the_plain_model(tie):
    model, ids = make_model(tie_embeddings=tie), torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        plain, cache = model(ids), KVCache(model.config, 2)
        plain_steps = [model(ids[:, :5], cache), model(ids[:, 5:6], cache)]
    with blas.decoding(model, 1):
        assert blas.active()
        routed, cache = model(ids), KVCache(model.config, 2)
        steps = [model(ids[:, :5], cache), model(ids[:, 5:6], cache)]
    assert not blas.active()
    assert torch.allclose(routed, plain, atol=1e-5)
    for got, expected in zip(steps, plain_steps, strict=True):
        assert torch.allclose(got, expected, atol=1e-5)


def test_products_go_through_numpy_only_inside(monkeypatch):
    calls = []
    product = blas.product
    monkeypatch.setattr(blas, "product", lambda *a: calls.append(1) or product(*a))
    model, ids = make_model(), torch.randint(0, 97, (1, 4))
    with torch.no_grad():
        model(ids)
    assert calls == []
    with blas.decoding(model, 1):
        model(ids)
    assert len(calls) == 2 * 6 + 1  # Q, K, V, O, W_1, W_2 in each of 2 layers, and the head


def test_threads_are_restored_and_autograd_stays_off():
    model, threads = make_model(), torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"), blas.decoding(model, 1):
        assert torch.get_num_threads() == 1 and not torch.is_grad_enabled()
        raise RuntimeError("inside")
    assert torch.get_num_threads() == threads and not blas.active()


def test_gradients_inside_take_torchs_path():
    """A user who turns autograd back on inside the context still gets gradients."""
    model, ids = make_model(), torch.randint(0, 97, (1, 6))
    with blas.decoding(model, 1), torch.enable_grad():
        assert not blas.active()
        model(ids).sum().backward()
    assert model.blocks[0].attn.W_Q.grad is not None


def test_training_on_is_seen_at_the_next_step():
    """numpy reads the parameters' own memory: an optimizer step is visible at once."""
    model, ids = make_model(), torch.randint(0, 97, (1, 6))
    with blas.decoding(model, 1):
        before = model(ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids).logsumexp(-1).mean().backward()
    optimizer.step()
    with blas.decoding(model, 1):
        after = model(ids)
    with torch.no_grad():
        assert torch.allclose(after, model(ids), atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-3)


def test_packed_models_and_other_threads_keep_torchs_path():
    model, threads = make_model().for_inference("int8"), torch.get_num_threads()
    assert not blas.applies(model)
    with blas.decoding(model, 1):
        assert not blas.active() and torch.get_num_threads() == threads
    seen = []

    def other_thread() -> None:
        with torch.no_grad():  # autograd is per thread: off here too, so only the route differs
            seen.append(blas.active())

    with blas.decoding(make_model(), 1):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == [False]


def test_the_head_of_a_tied_model_reads_E():
    model, h = make_model(), torch.randn(1, 3, 64)
    expected = h @ model.embedding.E.t()
    with blas.decoding(model, 1):
        assert torch.allclose(model.unembed(h), expected, atol=1e-5)
    assert torch.allclose(linear(h, model.unembedding(), None), expected, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_generation_takes_the_route_for_one_row_only(monkeypatch, batch):
    """Batch 1 decodes through numpy after the prompt; a batch of 2 stays on torch, and the
    tokens are those of the plain model either way."""
    model, ids = make_model(), torch.randint(0, 97, (batch, 5))
    expected = model.generate(ids, max_new_tokens=6, use_cache=False)
    routed = []
    product = blas.product
    monkeypatch.setattr(blas, "product", lambda x, *a: routed.append(len(x)) or product(x, *a))
    assert torch.equal(model.generate(ids, max_new_tokens=6), expected)
    steps = 5 if batch == 1 else 0  # the prompt runs 5 positions on torch, then 1 a step
    assert len(routed) == steps * 13
    with blas.decoding(model, 2):
        assert not blas.active()


@pytest.mark.parametrize("settings", [{}, {"num_beams": 2}])
def test_batched_decoding_steps_use_the_layout_and_prompts_do_not(settings):
    """A model prepared in float32 decodes several rows on its oneDNN layout (made at the
    first such step), both in generate's rows and in beam search, with the plain model's
    tokens; one row and prompts read the parameters."""
    ids = torch.randint(0, 97, (2, 5))
    expected = make_model().generate(ids, max_new_tokens=6, **settings)
    model = make_model().for_inference("float32")
    qkv = model.blocks[0].attn.project_qkv
    model.generate(ids[:1], max_new_tokens=6)
    assert qkv.layout is None
    assert torch.equal(model.generate(ids, max_new_tokens=6, **settings), expected)
    assert qkv.layout is not None
