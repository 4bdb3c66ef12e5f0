"""The prefix cache (issue 64, part 1): what earlier texts computed, reused by later prompts,
with the same tokens as prefilling everything, and the prefill it saves counted."""

import pytest
import torch

from tlm.generate import GenerationConfig, generate
from tlm.generate.constrain import Grammar
from tlm.generate.slots import Slots
from tlm.inference import Decoder, for_decoding, for_inference
from tlm.inference.prefix_cache import PrefixCache

B = 4  # tokens a block


def block_tensors(start: int, end: int):
    """Stand-ins for a slot's keys and values: [L=1,H=1,n,d=2], position-valued."""
    k = torch.arange(start, end, dtype=torch.float32).repeat_interleave(2).view(1, 1, -1, 2)
    return k, -k


def test_blocks_chain_by_what_comes_before_and_the_ends_of_chains_go_first():
    per_block = 2 * B * 2 * 4  # k and v, B positions of 2 floats
    cache = PrefixCache(budget=4 * per_block, block=B)
    text = list(range(100, 113))  # 13 tokens: 3 full blocks
    assert cache.store(text, 13, block_tensors) == 3
    assert cache.store(text, 13, block_tensors) == 0  # kept already
    assert len(cache.lookup(text, 12)) == 3 and len(cache.lookup(text, 11)) == 2
    moved = [999, *text[1:]]  # the same later tokens after another first one: not a prefix
    assert cache.lookup(moved, 13) == []
    chain = cache.lookup(text + [7], 14)
    assert torch.equal(chain[1].k[0, 0, :, 0], torch.tensor([4.0, 5, 6, 7]))
    cache.use(chain)
    assert (cache.counts.lookups, cache.counts.hits, cache.counts.tokens_reused) == (1, 1, 12)
    other = text[:8] + [1, 2, 3, 4, 5, 6, 7, 8]  # shares two blocks, then two of its own
    assert cache.store(other, 16, block_tensors) == 2  # five blocks > four: one evicted
    assert cache.counts.evicted == 1 and cache.bytes == 4 * per_block
    assert len(cache.lookup(text, 13)) == 2  # the old chain lost its end, not its start
    assert len(cache.lookup(other, 16)) == 4
    assert PrefixCache(budget=per_block - 1, block=B).store(text, 13, block_tensors) == 0


def decode(model, prompts, prefix=None, slots=3, together=False, **settings):
    """Greedy tokens of each prompt through one `Slots` loop, one prompt after another (or
    all queued at once), and the loop."""
    config = GenerationConfig(max_new_tokens=settings.pop("max_new_tokens", 8), **settings)
    loop = Slots(model, slots, prefix=prefix)
    out = []
    queue = [loop.add(p, config, seed=i) for i, p in enumerate(prompts)] if together else []
    for i, prompt in enumerate(prompts):
        if not together:
            queue = [loop.add(prompt, config, seed=i)]
        while not loop.idle():
            loop.step()
        if not together:
            out.append(queue[0])
    return (queue if together else out), loop


def texts(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("fmt", ["plain", "float32", "float16", "bfloat16", "int8"])
def test_shared_prefixes_and_later_turns_decode_as_without_and_prefill_less(make_model, fmt):
    model = make_model(context_length=96, position="rope")
    model = for_decoding(model) if fmt == "plain" else for_inference(model, fmt)
    system = texts(1, 22, seed=1)[0]
    prompts = [system + t for t in texts(4, 5, seed=2)]
    turn = prompts[0] + [5, 6, 7]  # a later prompt that begins with an earlier whole text
    for together in (False, True):
        want, plain = decode(model, [*prompts, turn], together=together)
        prefix = PrefixCache(budget=1 << 24, block=B)
        got, cached = decode(model, [*prompts, turn], prefix, together=together)
        assert [s.tokens for s in got] == [s.tokens for s in want]
        for a, b in zip(got, want, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [s.cached for s in want] == [0] * 5
        # one at a time, each takes the row the last left, which holds the 22 system tokens;
        # together, two wait a step for the system prompt's 5 full blocks the first computes;
        # the later turn shares 27 tokens with the first prompt, whose 6 full blocks it reuses
        once = [0, 22, 22, 22, 24] if not together else [0, 20, 20, 22, 24]
        assert [s.cached for s in got] == once
        assert cached.prefilled == plain.prefilled - sum(s.cached for s in got)
        assert prefix.counts.tokens_reused == sum(s.cached for s in got)
    # the later turn, alone after the first: its prompt and reply's blocks are reused
    prefix = PrefixCache(budget=1 << 24, block=B)
    first, _ = decode(model, [prompts[0]], prefix)
    follow = prompts[0] + first[0].tokens + [9, 9]
    (again,), loop = decode(model, [follow], prefix)
    (alone,), _ = decode(model, [follow])
    assert again.tokens == alone.tokens and again.cached == (len(follow) - 2) // B * B


def test_eviction_under_pressure_and_cancelled_prefills_change_no_token(make_model):
    model = for_decoding(make_model(context_length=64))
    prompts = [p + q for p in texts(2, 12, seed=3) for q in texts(3, 6, seed=4)]
    want, _ = decode(model, prompts)
    one_block = 2 * model.config.n_layers * model.config.n_heads * B * model.config.d_head * 4
    prefix = PrefixCache(budget=5 * one_block, block=B)
    got, _ = decode(model, prompts, prefix)
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert prefix.counts.evicted > 0 and prefix.bytes <= 5 * one_block
    assert any(s.cached for s in got)
    loop = Slots(model, 2, prefix=PrefixCache(budget=1 << 24, block=B))
    config = GenerationConfig(max_new_tokens=8)
    early = loop.add(prompts[0], config)
    loop.cancel(early)  # before its prefill: nothing kept
    late = loop.add(prompts[1], config)
    loop.step()
    loop.cancel(late)  # after its prefill: its prompt's blocks are kept
    assert len(loop.prefix) == len(prompts[1]) // B
    again = loop.add(prompts[1], config)
    while not loop.idle():
        loop.step()
    assert again.tokens == want[1].tokens and again.cached == len(prompts[1]) - 1  # its row's


def test_rows_that_arrive_together_compute_a_shared_prefix_once(make_model):
    model = for_decoding(make_model(context_length=64))
    system = texts(1, 16, seed=5)[0]
    prompts = [system + t for t in texts(4, 3, seed=6)]
    want, plain = decode(model, prompts, slots=4, together=True)
    got, loop = decode(model, prompts, PrefixCache(1 << 24, B), slots=4, together=True)
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert plain.prefilled == 4 * 19 and loop.prefilled == 19 + 3 * 3
    assert [s.cached for s in got] == [0, 16, 16, 16]


def test_a_windowed_model_reuses_what_its_ring_still_holds(make_model):
    model = for_decoding(make_model(context_length=64, attention_window=8, position="rope"))
    short = texts(1, 9, seed=7)[0]  # within the ring (W + slack): kept and reused
    long = texts(1, 100, seed=8)[0]  # past its 72 entries: the ring came round, nothing kept
    for prompts in ([short, short + [1, 2]], [long, long + [3]]):
        want, _ = decode(model, prompts, max_new_tokens=12)
        prefix = PrefixCache(1 << 24, B)
        got, _ = decode(model, prompts, prefix, max_new_tokens=12)
        assert [s.tokens for s in got] == [s.tokens for s in want]
        assert bool(got[1].cached) == (prompts[0] is short)


def test_sampled_rows_draw_the_same_tokens_with_the_cache(make_model):
    model = for_decoding(make_model(context_length=64))
    prompts = [p + [1, 2, 3] for p in texts(1, 16, seed=9)] * 3
    settings = dict(do_sample=True, temperature=1.3, top_k=30, max_new_tokens=10)
    want, _ = decode(model, prompts, **settings)
    got, _ = decode(model, prompts, PrefixCache(1 << 24, B), **settings)
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert [s.cached for s in got] == [0, 18, 18]  # the row still holds all but the last


def test_a_decoder_that_is_kept_prefills_only_what_each_prompt_adds(make_model):
    """`generate` on a caller's decoder with a prefix cache (`tlm chat`'s turns): each later
    prompt, the text so far and a new message, reuses the blocks of the texts before it."""
    model = make_model(context_length=96)
    decoder = Decoder(model)
    decoder.prefix = PrefixCache(1 << 24, B)
    text, config = texts(1, 10, seed=10)[0], GenerationConfig(max_new_tokens=6)
    for turn in range(3):
        steps = list(generate(model, torch.tensor([text]), config, decoder=decoder))
        alone = list(generate(model, torch.tensor([text]), config))
        reply = [s.lists()[0][0] for s in steps]
        assert reply == [s.lists()[0][0] for s in alone]
        reused = decoder.prefix.counts.tokens_reused
        assert reused == 0 if turn == 0 else reused >= (len(text) - 6) // B * B
        text = text + reply[:-1] + [1, 2, 3, 4, 5, 6]  # the reply as the text holds it, and more
        decoder.prefix.counts.tokens_reused = 0


@pytest.mark.parametrize("setting", ["grammar", "prompt_lookup", "int8 draft"])
def test_grammars_and_drafts_decode_as_without_on_a_cached_prefix(bpe_tokenizer, setting):
    """A row that starts from a cached prefix constrains, drafts and checks as one that
    prefilled it all: its tokens (and their logprobs) are the same."""
    torch.manual_seed(11)
    model = for_decoding(make_random(bpe_tokenizer.vocab_size))
    if setting == "grammar":
        extra = {"grammar": Grammar.json_schema(None, bpe_tokenizer)}
    elif setting == "prompt_lookup":
        extra = {"prompt_lookup": 3}
    else:
        extra = {"draft": "int8"}
    system = bpe_tokenizer.encode("The for statement runs a block once for each item of a list.")
    prompts = [system + bpe_tokenizer.encode(ask) for ask in (" Say:", " Write:", " Say:")]
    settings = dict(max_new_tokens=24, eos_token_id=bpe_tokenizer.eot_id, **extra)
    want, _ = decode(model, prompts, slots=1, **settings)
    got, loop = decode(model, prompts, PrefixCache(1 << 24, B), slots=1, **settings)
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for a, b in zip(got, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert got[1].cached >= len(system) // B * B and got[2].cached > got[1].cached
    if setting != "grammar":
        assert loop.drafted > 0


def make_random(vocab_size):
    from test_structured import random_model

    return random_model(vocab_size)
