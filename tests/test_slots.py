"""Continuous batching: rows at their own lengths give what each row gives alone."""

import pytest
import torch

from conftest import NORMS, POSITIONS, written_out
from tlm.generate import GenerationConfig, generate
from tlm.generate.slots import Slots
from tlm.inference.slot_cache import Band, Ragged, SlotCache

# every position and norm on the fused path; the written-out path (which test_attention.py
# holds equal to it without a cache) once, for its masks through a cache
CASES = [(p, n, "fused") for p in POSITIONS for n in NORMS] + [("rope", "pre", "reference")]


@pytest.mark.parametrize("position, norm, impl", CASES)
def test_rows_at_their_own_lengths_equal_each_row_alone(make_model, position, norm, impl):
    model = make_model(position=position, norm=norm)
    if impl == "reference":
        written_out(model)
    texts = [torch.randint(0, 97, (14,)).tolist() for _ in range(4)]
    cache = SlotCache(model.config, slots=4)
    lengths = [0, 0, 0, 0]

    def step(feeds):  # {slot: how many of its next tokens}, in one ragged pass
        slots = sorted(feeds)
        ids = [t for s in slots for t in texts[s][lengths[s] : lengths[s] + feeds[s]]]
        logits = model(torch.tensor([ids]), cache.feed(slots, [feeds[s] for s in slots]))
        at = 0
        for s in slots:
            lengths[s] += feeds[s]
            alone = model(torch.tensor([texts[s][: lengths[s]]]))[0, -feeds[s] :]
            assert torch.allclose(logits[0, at : at + feeds[s]], alone, atol=1e-5), (s, lengths)
            at += feeds[s]
        assert cache.lengths == lengths

    step({0: 7, 2: 5})  # two prompts of two lengths in one pass
    step({0: 1, 1: 3, 2: 1, 3: 4})  # two rows decode while two others join
    step({0: 1, 1: 1, 3: 2})  # slot 2 sits out (a dummy row): its positions must stay intact
    step({1: 2, 2: 1, 3: 1})  # slots 2, 3 at one length: one run
    step({0: 1, 1: 1, 2: 1, 3: 1})  # all decoding, at three lengths
    assert lengths == [10, 7, 8, 8]


def test_rows_are_grouped_for_attention_and_bad_passes_are_refused(make_model):
    model = make_model()
    cache = SlotCache(model.config, slots=4, capacity=8)
    cache.lengths[:] = [3, 3, 5, 3]
    rows = cache.feed([0, 1], [1, 1])  # neighbours at one length: one run, no mask
    assert [(type(g), g.lo, g.hi, g.mask) for g in rows.groups] == [(Band, 0, 2, None)]
    rows = cache.feed([0, 1, 3], [1, 1, 1])  # not neighbours: one masked group, slot 2 a dummy
    (steps,) = rows.groups
    assert isinstance(steps, Ragged) and (steps.lo, steps.hi) == (0, 4)
    assert steps.mask[:, 0, 0].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert rows.fed_positions.tolist() == [[3, 3, 3]] and rows.lasts == [0, 1, 2]
    rows = cache.feed([0, 1, 2, 3], [1, 4, 1, 2])  # two prompts, two rows decoding
    assert [type(g) for g in rows.groups] == [Band, Band, Ragged]
    assert rows.fed_positions.tolist() == [[3, 3, 4, 5, 6, 5, 3, 4]] and rows.lasts == [0, 4, 5, 7]
    for slots, counts in [([0], [6]), ([1, 0], [1, 1]), ([0, 0], [1, 1]), ([0], [0]), ([], [])]:
        with pytest.raises(ValueError):
            cache.feed(slots, counts)


def reference(model, prompt, **settings):
    """One prompt alone, without a cache: the whole window at every step."""
    config = GenerationConfig(use_cache=False, **settings)
    return [int(s.tokens[0]) for s in generate(model, torch.tensor([prompt]), config)]


def run(slots, sequences, joins=None):
    """Step until every sequence is done; joins = {step: [(prompt, config, seed)]}."""
    joins, step = joins or {}, 0
    while not slots.idle() or step in joins:
        assert step < 200, "the sequences never end"
        for prompt, config, seed in joins.pop(step, []):
            sequences.append(slots.add(prompt, config, seed=seed))
        slots.step()
        step += 1
    return [s.tokens for s in sequences]


def test_a_request_joining_a_busy_batch_gets_what_it_gets_alone(make_model):
    model = make_model(position="learned")
    greedy = GenerationConfig(max_new_tokens=12)
    hot = GenerationConfig(max_new_tokens=20, do_sample=True, temperature=1.5, top_k=20)
    penalised = GenerationConfig(max_new_tokens=9, repetition_penalty=20.0)
    nucleus = GenerationConfig(max_new_tokens=15, do_sample=True, top_p=0.8)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (4, 9, 2, 6)]
    slots = Slots(model, slots=3)
    first = slots.add(prompts[0], hot, seed=5)
    tokens = run(
        slots,
        [first],
        joins={2: [(prompts[1], greedy, None)], 3: [(prompts[2], penalised, None)]}
        | {4: [(prompts[3], nucleus, 7)]},  # waits for a free row: three are busy
    )
    assert tokens[0] == reference(model, prompts[0], **vars_of(hot), seed=5)
    assert tokens[1] == reference(model, prompts[1], max_new_tokens=12)
    assert tokens[2] == reference(model, prompts[2], max_new_tokens=9, repetition_penalty=20.0)
    assert tokens[2] != reference(model, prompts[2], max_new_tokens=9)  # the penalty acts
    assert tokens[3] == reference(model, prompts[3], **vars_of(nucleus), seed=7)
    assert [len(t) for t in tokens] == [20, 12, 9, 15]


def vars_of(config):
    keys = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p")
    return {k: getattr(config, k) for k in keys}


def test_one_row_slides_its_window_while_the_others_go_on(make_model):
    model = make_model(position="rope", context_length=16)
    with torch.no_grad():  # large weights: next tokens that depend on the whole window
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2"):
                param.mul_(10)
    long, short = torch.randint(0, 97, (12,)).tolist(), torch.randint(0, 97, (3,)).tolist()
    slots = Slots(model, slots=2)
    config = GenerationConfig(max_new_tokens=10)
    sequences = [slots.add(long, config), slots.add(short, config)]
    tokens = run(slots, sequences)  # the long row passes 16 tokens after 4 steps
    assert tokens[0] == reference(model, long, max_new_tokens=10)
    assert tokens[1] == reference(model, short, max_new_tokens=10)
    assert len(set(tokens[0])) > 3


def test_one_pass_per_step_and_rows_end_on_their_own(make_model):
    model = make_model()
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape)))
    eos = 3
    slots = Slots(model, slots=4)
    prompt = [1, 2, 5, 7]
    config = GenerationConfig(max_new_tokens=6, eos_token_id=eos, do_sample=True)
    sequences = [slots.add(prompt, config, sample=j, seed=0) for j in range(3)]
    slots.add([4, 4], GenerationConfig(max_new_tokens=2))
    slots.step()
    assert calls == [(1, 14)]  # every prompt in one pass
    slots.step()
    assert calls[-1] == (1, 4)  # then one token of every row in use
    run(slots, [])
    for s in sequences:
        assert s.finish_reason == ("eos" if eos in s.tokens else "length")
        assert eos not in s.tokens[:-1] and len(s.tokens) <= 6
    assert len({tuple(s.tokens) for s in sequences}) > 1  # samples j = 0, 1, 2 differ


def test_a_cancelled_sequence_frees_its_row_for_the_next_step(make_model):
    model = make_model()
    slots = Slots(model, slots=1)
    config = GenerationConfig(max_new_tokens=50)
    first, second = slots.add([1, 2, 3], config), slots.add([4, 5], config)
    slots.step()
    assert first.slot == 0 and second.slot is None and slots.busy == 1
    slots.cancel(first)
    assert first.finish_reason == "cancelled" and slots.busy == 0
    emitted = slots.step()
    assert [e.sequence for e in emitted] == [second] and second.slot == 0
    assert second.tokens[:1] == reference(model, [4, 5], max_new_tokens=1)


def test_a_new_rows_prompt_runs_in_the_pass_that_decodes_the_others(make_model):
    model = make_model()
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape)))
    slots = Slots(model, slots=2)
    config = GenerationConfig(max_new_tokens=5)
    busy = slots.add([1, 2, 3], config)
    slots.step()
    new = slots.add([4, 5], config)
    emitted = slots.step()
    assert [e.sequence for e in emitted] == [busy, new] and calls[1:] == [(1, 3)]
    assert new.tokens == reference(model, [4, 5], max_new_tokens=1)
    assert busy.tokens == reference(model, [1, 2, 3], max_new_tokens=2)
