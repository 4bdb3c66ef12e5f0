"""Chunked prefill (issue 64, part 3): while rows decode, a long prompt is fed a chunk a step
beside them, so their steps stay small; every row's tokens are what they are without it."""

import torch

from tlm.generate import GenerationConfig
from tlm.generate.slots import Slots
from tlm.inference import for_decoding
from tlm.inference.prefix_cache import PrefixCache


def run(model, chunk, prefix=None):
    """Three rows decode; after two steps a 45-token prompt joins. Returns every row's
    tokens, the tokens each forward pass fed, and the steps at which each row emitted."""
    loop = Slots(model, 4, prefix=prefix, prefill_chunk=chunk)
    g = torch.Generator().manual_seed(0)
    config = GenerationConfig(max_new_tokens=14)
    rows = [loop.add(torch.randint(0, 97, (5,), generator=g).tolist(), config) for _ in range(3)]
    fed, emitted = [], {}
    hook = model.register_forward_pre_hook(lambda _, args: fed.append(args[0].shape[-1]))
    long = torch.randint(0, 97, (45,), generator=g).tolist()
    step = 0
    while not loop.idle():
        if step == 2:
            rows.append(loop.add(long, GenerationConfig(max_new_tokens=6)))
        for e in loop.step():
            emitted.setdefault(rows.index(e.sequence), []).append(step)
        step += 1
    hook.remove()
    return [r.tokens for r in rows], fed, emitted


def test_a_long_prompt_is_fed_a_chunk_a_step_while_rows_decode_and_changes_no_token(make_model):
    model = for_decoding(make_model(context_length=64))
    whole, fed_whole, _ = run(model, None)
    chunked, fed, emitted = run(model, 8)
    assert chunked == whole
    assert max(fed_whole) == 45 + 3  # the prompt in one pass beside three decoding rows
    assert fed[0] == 3 * 5 and max(fed[1:]) == 8 + 3  # the first pass: the three prompts
    assert fed.count(8 + 3) == 5 and 5 + 3 in fed  # 45 = 5 chunks of 8 and one of 5
    assert all(emitted[r] == list(range(14)) for r in range(3))  # a token every step
    assert emitted[3][0] == 2 + 5  # its first token after its last chunk
    cached, _, _ = run(model, 8, PrefixCache(1 << 20, 4))
    assert cached == whole


def test_a_prompt_with_no_row_decoding_is_fed_whole(make_model):
    model = for_decoding(make_model(context_length=64))
    loop = Slots(model, 2, prefill_chunk=4)
    fed = []
    model.register_forward_pre_hook(lambda _, args: fed.append(args[0].shape[-1]))
    row = loop.add(list(range(30)), GenerationConfig(max_new_tokens=3))
    while not loop.idle():
        loop.step()
    assert fed[0] == 30 and len(row.tokens) == 3


def test_a_prompt_cancelled_between_chunks_leaves_what_it_fed_for_the_next(make_model):
    """Cancelled after two of its chunks, a long prompt's row gives back what it computed:
    the same prompt sent again reuses it and decodes what it decodes from nothing."""
    model = for_decoding(make_model(context_length=64))
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, 97, (40,), generator=g).tolist()
    config = GenerationConfig(max_new_tokens=5)
    loop = Slots(model, 2, prefix=PrefixCache(1 << 20, 4), prefill_chunk=8)
    busy = loop.add(
        torch.randint(0, 97, (4,), generator=g).tolist(), GenerationConfig(max_new_tokens=30)
    )
    loop.step()
    cut = loop.add(long, config)
    loop.step()
    loop.step()  # two chunks of 8 fed beside the decoding row
    assert loop.cache.lengths[cut.slot] == 16 and cut.tokens == []
    loop.cancel(cut)
    again = loop.add(long, config)
    while not loop.idle():
        loop.step()
    alone = Slots(model, 1)
    want = alone.add(long, config)
    while not alone.idle():
        alone.step()
    assert again.tokens == want.tokens and again.cached == 16 and len(busy.tokens) == 30
