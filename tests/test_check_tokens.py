"""A step that checks k tokens of one sequence at once (`Decoder.check`), and caches rolled
back (`truncate`): the logits and the keys and values the forward pass gives, in every
weight format, through the C step and without it."""

import pytest
import torch
from test_native_step import Spy, needs_native

from tlm.generate.sampling import greedy_logprob
from tlm.inference import Decoder, SlotCache, for_decoding, for_inference
from tlm.inference.devices.threads import on_threads
from tlm.model.kv_cache import KVCache

# each instruction set this host runs, at one thread and at two
pytestmark = pytest.mark.usefixtures("kernel_build", "each_thread_count")

FORMATS = ["plain", "float32", "float16", "bfloat16", "int8"]


def prepared(make_model, fmt: str, **overrides):
    model = make_model(**overrides)
    for p in model.parameters():  # weights of the size a trained model has
        torch.nn.init.normal_(p, std=0.1)
    return for_decoding(model) if fmt == "plain" else for_inference(model, fmt)


def forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The forward pass's logits [T,V] of one sequence ids [T], no cache."""
    with torch.no_grad():
        return model(ids[None])[0]


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_k_tokens_in_one_step_are_the_forward_pass(make_model, monkeypatch, fmt, position):
    """After a 5-token prompt, drafts of 1 to 8 tokens checked in one step each give the
    logits the forward pass gives at their positions; the cache's keys and values are then
    those of feeding the tokens one by one, and the slot is k longer."""
    model = prepared(make_model, fmt, position=position, qk_norm=position == "rope")
    ids = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1))
    expected = forward_logits(model, ids)
    spy = Spy(monkeypatch)
    for k in range(1, 9):
        decoder, cache = Decoder(model), SlotCache(model.config, 2, capacity=16)
        with torch.no_grad():
            model(ids[None, :5], cache.feed([1], [5]))
        with on_threads(max(2, torch.get_num_threads())):  # rows shared out among threads
            got, picks = decoder.check(cache, 1, ids[5 : 5 + k].tolist(), greedy=True)
        assert got.shape == (k, 97) and cache.lengths == [0, 5 + k]
        assert torch.allclose(got, expected[5 : 5 + k], atol=1e-4)
        if picks is not None:  # the whole step in C: its own greedy choice per position
            assert picks == [greedy_logprob(row) for row in got]
        one_by_one = SlotCache(model.config, 2, capacity=16)
        with torch.no_grad():
            model(ids[None, : 5 + k], one_by_one.feed([1], [5 + k]))
        n = 5 + k
        assert torch.allclose(cache.k[:, 1, :, :n], one_by_one.k[:, 1, :, :n], atol=1e-5)
        assert torch.allclose(cache.v[:, 1, :, :n], one_by_one.v[:, 1, :, :n], atol=1e-5)
    assert spy.calls == 8  # every check took the C step


@needs_native
@pytest.mark.parametrize("fmt", ["plain", "int8"])
def test_a_rolled_back_slot_decodes_as_if_the_draft_never_was(make_model, fmt):
    """Check 6 drafted tokens, keep 2 (truncate), check 4 others: the logits are the
    forward pass's of the text kept; the rejected keys, left in memory, are never read."""
    model = prepared(make_model, fmt, position="rope")
    text = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(2))
    draft = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(3))
    decoder, cache = Decoder(model), SlotCache(model.config, 1, capacity=16)
    with torch.no_grad():
        model(text[None, :4], cache.feed([0], [4]))
    decoder.check(cache, 0, text[4:6].tolist() + draft[:4].tolist())  # 2 right, 4 wrong
    cache.truncate(0, 6)
    with on_threads(max(2, torch.get_num_threads())):
        got, _ = decoder.check(cache, 0, text[6:10].tolist())
    assert torch.allclose(got, forward_logits(model, text[:10])[6:10], atol=1e-4)
    with pytest.raises(ValueError, match="holds 10 positions, not 11"):
        cache.truncate(0, 11)


def test_without_the_c_step_the_forward_pass_checks(make_model, monkeypatch):
    """A hooked model (every hook point must see its activation) checks through the
    forward pass: the same logits, the same lengths."""
    model = prepared(make_model, "plain")
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(4))
    seen = []
    model.blocks[0].attn.pattern.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    spy = Spy(monkeypatch)
    decoder, cache = Decoder(model), SlotCache(model.config, 1, capacity=16)
    with torch.no_grad():
        model(ids[None, :4], cache.feed([0], [4]))
    got, picks = decoder.check(cache, 0, ids[4:9].tolist(), greedy=True)
    assert spy.calls == 0 and len(seen) == 2 and cache.lengths == [9]  # prompt, check
    assert picks is None  # the forward pass makes no choice
    assert torch.allclose(got, forward_logits(model, ids)[4:9], atol=1e-5)
    with pytest.raises(ValueError, match="holds 16 positions; 17 asked"):
        decoder.check(cache, 0, list(range(8)))


def test_a_kv_cache_rolls_back(make_model):
    model = make_model(position="rope")
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(5))
    cache = KVCache(model.config, 1, capacity=16)
    with torch.no_grad():
        model(ids[:, :8], cache)
        cache.truncate(5)
        got = model(ids[:, 5:10], cache)[0]
        assert torch.allclose(got, model(ids)[0, 5:10], atol=1e-5)
    assert cache.length == 10
    with pytest.raises(ValueError, match="holds 10 positions, not -1"):
        cache.truncate(-1)
