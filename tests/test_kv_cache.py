"""The KV cache, left padding and packed weights change nothing but speed."""

import pytest
import torch

from conftest import NORMS, POSITIONS
from tlm.model.kv_cache import KVCache


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("position", POSITIONS)
def test_cached_equals_uncached_at_every_step(make_model, position, norm, impl):
    model = make_model(position=position, norm=norm, attention_impl=impl)
    ids = torch.randint(0, 97, (2, 20))
    full = model(ids)  # [B,T,V]: position t predicts token t+1
    cache = KVCache(model.config, batch_size=2)
    steps = [model(ids[:, :6], cache)]  # prefill six positions at once
    steps.append(model(ids[:, 6:10], cache))  # a chunk after cached keys
    steps += [model(ids[:, t : t + 1], cache) for t in range(10, 20)]  # then one at a time
    assert cache.length == 20
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


@pytest.mark.parametrize("position", POSITIONS)
def test_left_padding_changes_no_logit(make_model, position):
    model = make_model(position=position)
    short, long = torch.randint(1, 97, (1, 5)), torch.randint(1, 97, (1, 9))
    batch = torch.zeros(2, 9, dtype=torch.long)  # pad id 0, on the left
    batch[0, 4:], batch[1] = short[0], long[0]
    mask = (torch.arange(9) >= torch.tensor([[4], [0]])).long()  # [B,9]
    padded = model(batch, attention_mask=mask)
    assert torch.allclose(padded[0, 4:], model(short)[0], atol=1e-5)
    assert torch.allclose(padded[1], model(long)[0], atol=1e-5)
    cache = KVCache(model.config, batch_size=2)  # and through the cache, one step after
    model(batch, cache, attention_mask=mask)
    nxt = torch.randint(1, 97, (2, 1))
    step = model(nxt, cache, attention_mask=torch.cat([mask, torch.ones(2, 1).long()], 1))
    assert torch.allclose(step[0], model(torch.cat([short, nxt[:1]], 1))[0, -1:], atol=1e-5)
    assert torch.allclose(step[1], model(torch.cat([long, nxt[1:]], 1))[0, -1:], atol=1e-5)


def test_last_only_is_the_last_row(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (3, 11))
    assert torch.allclose(model(ids, last_only=True), model(ids)[:, -1:], atol=1e-6)


def test_cache_bounds_and_reorder(make_model):
    model = make_model(context_length=32)
    cache = KVCache(model.config, batch_size=2, capacity=8)
    model(torch.randint(0, 97, (2, 8)), cache)
    with pytest.raises(ValueError, match="holds 8 positions"):
        model(torch.randint(0, 97, (2, 1)), cache)
    keys = cache.k.clone()
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.k[:, 0], keys[:, 1]) and torch.equal(cache.k[:, 1], keys[:, 1])


@pytest.mark.parametrize(
    "dtype, tolerance",
    [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 5e-2), ("int8", 5e-2)],
)
def test_packed_weights_compute_the_same_logits(make_model, dtype, tolerance):
    model = make_model(position="rope", bias=True)
    for p in model.parameters():  # weights of the size a trained model has
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 97, (2, 16))
    expected = model(ids)
    packed = make_model(position="rope", bias=True)
    packed.load_state_dict(model.state_dict())
    packed.for_inference(dtype)
    with torch.no_grad():
        got = packed(ids).float()
        cache = KVCache(packed.config, 2, dtype=next(packed.parameters()).dtype)
        stepped = torch.cat([packed(ids[:, :8], cache), packed(ids[:, 8:], cache)], 1).float()
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= tolerance * scale
    assert (stepped - expected).abs().max() <= tolerance * scale
    with pytest.raises(RuntimeError, match="packed for inference"):
        packed.train()


def test_unknown_inference_dtype(make_model):
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_model().for_inference("float8")
