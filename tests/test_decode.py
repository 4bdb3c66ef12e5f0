"""The decoding loop: cached == uncached, batched == one by one, greedy == argmax chain."""

import pytest
import torch

from conftest import POSITIONS
from tlm.generate import GenerationConfig, GenerationError, beam_search, generate

pytestmark = pytest.mark.usefixtures("kernel_build")  # each instruction set this host runs


def run(model, ids, mask=None, **settings):
    """tokens [B,new] and logprobs [B,new] of a whole generation."""
    steps = list(generate(model, ids, GenerationConfig(**settings), mask))
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logprobs for s in steps], 1)


def varied_model(make_model, **overrides):
    """A model whose greedy tokens change from step to step.

    GPT-2's init (std 0.02) gives near-uniform logits whose argmax repeats one token; weights
    of std 0.3 (gamma near 1) give a model whose choices depend on the whole window.
    """
    model = make_model(**overrides)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            mean = 1.0 if name.endswith("gamma") else 0.0
            param.normal_(mean, 0.3, generator=generator)
    return model


@pytest.mark.parametrize("position", POSITIONS)
def test_greedy_is_a_chain_of_argmaxes_and_the_cache_changes_nothing(make_model, position):
    model = make_model(position=position)
    ids = torch.randint(0, 97, (2, 5))
    tokens, logprobs = run(model, ids, max_new_tokens=12)
    seq = ids
    for t in range(12):  # the reference: a full forward per token (eq. 10.46)
        logits = model(seq)[:, -1]
        nxt = logits.argmax(-1)
        assert torch.equal(tokens[:, t], nxt)
        assert torch.allclose(
            logprobs[:, t], logits.log_softmax(-1)[torch.arange(2), nxt], atol=1e-5
        )
        seq = torch.cat([seq, nxt[:, None]], 1)
    uncached, uncached_lp = run(model, ids, max_new_tokens=12, use_cache=False)
    assert torch.equal(tokens, uncached) and torch.allclose(logprobs, uncached_lp, atol=1e-5)


@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("context_length", [8, 13, 16])
def test_sliding_window_for_three_context_lengths(make_model, position, context_length):
    N = context_length
    model = varied_model(make_model, position=position, context_length=N)
    ids = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(2))
    new = 3 * N + 4  # 3N + 8 tokens through an N-token window
    tokens, logprobs = run(model, ids, max_new_tokens=new)
    seq = ids
    for t in range(new):  # the reference: the whole model on the last N tokens, every step
        with torch.no_grad():
            logits = model(seq[:, -N:])[:, -1]  # [B,V]
        nxt = logits.argmax(-1)
        assert torch.equal(tokens[:, t], nxt), f"step {t}"
        expected = logits.log_softmax(-1)[torch.arange(2), nxt]
        assert torch.allclose(logprobs[:, t], expected, atol=1e-4), f"step {t}"
        seq = torch.cat([seq, nxt[:, None]], 1)
    assert all(len(set(row.tolist())) >= 5 for row in tokens)  # the argmax does move


def test_greedy_equals_top_k_1_and_temperature_0(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (3, 4))
    greedy, _ = run(model, ids, max_new_tokens=10)
    assert torch.equal(
        run(model, ids, max_new_tokens=10, do_sample=True, top_k=1, seed=5)[0], greedy
    )
    assert torch.equal(run(model, ids, max_new_tokens=10, do_sample=True, temperature=0)[0], greedy)


@pytest.mark.parametrize("settings", [{}, {"do_sample": True, "top_p": 0.9, "seed": 7}])
def test_batched_left_padded_equals_one_by_one(make_model, settings):
    model = make_model(position="rope")
    short, long = torch.randint(1, 97, (1, 3)), torch.randint(1, 97, (1, 8))
    batch = torch.zeros(2, 8, dtype=torch.long)
    batch[0, 5:], batch[1] = short[0], long[0]
    mask = (torch.arange(8) >= torch.tensor([[5], [0]])).long()
    together, lp = run(model, batch, mask, max_new_tokens=10, **settings)
    for row, prompt in enumerate((short, long)):
        alone, alone_lp = run(model, prompt, max_new_tokens=10, **settings)
        assert torch.equal(together[row], alone[0])
        assert torch.allclose(lp[row], alone_lp[0], atol=1e-5)


def test_samples_per_prompt_are_reproducible_and_differ(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (2, 4))
    settings = {"max_new_tokens": 15, "do_sample": True, "num_return_sequences": 3, "seed": 11}
    first, _ = run(model, ids, **settings)
    again, _ = run(model, ids, **settings)
    assert first.shape == (6, 15) and torch.equal(first, again)
    assert not torch.equal(first[0], first[1])  # samples of one prompt differ
    other, _ = run(model, ids, **{**settings, "seed": 12})
    assert not torch.equal(first, other)


def test_end_of_sequence_ends_rows_and_then_the_loop(make_model):
    model = varied_model(make_model)
    ids = torch.randint(0, 97, (4, 3), generator=torch.Generator().manual_seed(0))
    free, _ = run(model, ids, max_new_tokens=20)  # without padding, rows decode independently
    eos = tuple(int(free[row, step]) for row, step in enumerate((2, 10, 6, 14)))
    ends = [next(t for t in range(20) if int(free[row, t]) in eos) for row in range(4)]
    assert len(set(ends)) == 4 and max(ends) < 19, (eos, ends)  # the test needs these
    steps = list(generate(model, ids, GenerationConfig(max_new_tokens=20, eos_token_id=eos)))
    tokens = torch.stack([s.tokens for s in steps], 1)
    finished = torch.stack([s.finished for s in steps], 1)
    for row, end in enumerate(ends):
        assert torch.equal(tokens[row, : end + 1], free[row, : end + 1])  # up to its end token
        assert not finished[row, :end].any() and finished[row, end:].all()
        assert (tokens[row, end + 1 :] == tokens[row, end]).all()  # then its own end token
    assert len({int(tokens[row, end]) for row, end in enumerate(ends)}) > 1  # not one pad id
    assert len(steps) == max(ends) + 1  # the loop stops once all rows ended, not before


def test_a_steps_tensors_and_lists_agree_in_both_loops(make_model):
    """The slot loop's steps hold lists, made tensors when read; the reference loop's hold
    tensors: both read the same either way, and the same as each other."""
    model = varied_model(make_model)
    ids = torch.randint(0, 97, (3, 4), generator=torch.Generator().manual_seed(1))
    free, _ = run(model, ids, max_new_tokens=8)
    eos = (int(free[0, 3]),)
    read = {}
    for use_cache in (True, False):
        config = GenerationConfig(max_new_tokens=8, eos_token_id=eos, use_cache=use_cache)
        steps = list(generate(model, ids, config))
        listed = [step.lists() for step in steps]  # before any tensor of a step is made
        for step, (tokens, logprobs, finished) in zip(steps, listed, strict=True):
            step.lists()[0].append(-1)  # the caller's copy: the step is unchanged
            assert step.lists() == (tokens, logprobs, finished)
            assert step.tokens.dtype == torch.int64 and step.tokens.tolist() == tokens
            assert step.logprobs.dtype == torch.float32 and step.logprobs.tolist() == logprobs
            assert step.finished.dtype == torch.bool and step.finished.tolist() == finished
        read[use_cache] = listed
    assert any(finished[0] for _, _, finished in read[True])  # the end token was reached
    for (a, p, f), (b, q, g) in zip(read[True], read[False], strict=True):
        assert a == b and f == g and torch.allclose(torch.tensor(p), torch.tensor(q), atol=1e-4)


def test_repetition_penalty_applies_to_prompt_tokens(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (1, 6))
    plain, _ = run(model, ids, max_new_tokens=1)
    logits = model(ids)[0, -1]
    seen = torch.zeros(97, dtype=torch.bool)
    seen[ids[0]] = True
    penalised = torch.where(seen, torch.where(logits > 0, logits / 50, logits * 50), logits)
    first, _ = run(model, ids, max_new_tokens=1, repetition_penalty=50.0)
    assert first[0, 0] == penalised.argmax() and plain[0, 0] == logits.argmax()


def test_beam_search(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (2, 4))
    greedy, greedy_lp = run(model, ids, max_new_tokens=8)
    one = beam_search(model, ids, GenerationConfig(max_new_tokens=8, num_beams=1))
    assert torch.equal(one.sequences[:, 4:], greedy)  # one beam is greedy
    four = beam_search(
        model, ids, GenerationConfig(max_new_tokens=8, num_beams=4, length_penalty=0)
    )
    assert (four.logprobs >= greedy_lp.sum(1) - 1e-5).all()
    logp = model(four.sequences[:, :-1]).log_softmax(-1)  # its log-probability, recomputed
    scored = logp.gather(2, four.sequences[:, 1:, None])[:, 3:, 0].sum(1)
    assert torch.allclose(four.logprobs, scored, atol=1e-4)
    uncached = beam_search(
        model, ids, GenerationConfig(max_new_tokens=8, num_beams=4, use_cache=False)
    )
    assert torch.equal(
        uncached.sequences, beam_search(model, ids, num_beams=4, max_new_tokens=8).sequences
    )


def test_beam_search_ends_hypotheses_at_eos(make_model):
    """With length_penalty 0 sums only fall, so a hypothesis that ends at once must win."""
    model = make_model()
    ids = torch.randint(0, 97, (1, 4))
    first = model(ids)[0, -1].log_softmax(-1)
    eos = int(first.argmax())
    ended = beam_search(
        model, ids, num_beams=2, max_new_tokens=6, eos_token_id=eos, length_penalty=0
    )
    assert ended.sequences[0, 4:].tolist() == [eos]
    assert torch.allclose(ended.logprobs, first[eos], atol=1e-5)


def test_model_generate_names_things_as_hugging_face_does(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (2, 4))
    out = model.generate(ids, max_new_tokens=6)
    assert out.shape == (2, 10) and torch.equal(out[:, :4], ids)
    assert torch.equal(out[:, 4:], run(model, ids, max_new_tokens=6)[0])
    sampled = model.generate(
        ids, max_new_tokens=6, do_sample=True, top_p=0.9, seed=1, num_return_sequences=2
    )
    assert sampled.shape == (4, 10)
    assert model.generate(ids, max_new_tokens=5, num_beams=2).shape == (2, 9)


def test_repetition_penalty_never_counts_left_padding(make_model):
    """Padding positions hold id 0; they must not make token 0 count as already seen."""
    model = make_model()
    generator = torch.Generator().manual_seed(0)
    while True:  # a prompt without token 0 whose greedy next token is 0
        short = torch.randint(1, 97, (1, 3), generator=generator)
        if int(model(short)[0, -1].argmax()) == 0:
            break
    batch = torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)
    mask = (torch.arange(7) >= 4).long()[None]
    alone, _ = run(model, short, max_new_tokens=1, repetition_penalty=1e3)
    padded, _ = run(model, batch, mask, max_new_tokens=1, repetition_penalty=1e3)
    assert alone[0, 0] == 0 and torch.equal(padded, alone)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": 0}, "top_k must be >= 1, got 0"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"num_beams": 0}, "num_beams must be >= 1, got 0"),
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
        (
            {"num_beams": 2, "repetition_penalty": 1.2},
            "repetition_penalty, frequency_penalty, presence_penalty and logit_bias apply "
            "to greedy decoding and sampling",
        ),
    ],
)
def test_bad_settings_name_the_value(settings, message):
    with pytest.raises(GenerationError) as error:
        GenerationConfig(**settings)
    assert str(error.value) == message


@pytest.mark.parametrize("use_cache", [True, False])
def test_temperature_zero_is_greedy_at_every_entry_point(make_model, use_cache):
    """Sampling at temperature 0 is argmax decoding, whatever the seed; `GenerationConfig.of`
    gives every setting left out (None) its one default."""
    model = varied_model(make_model)
    ids = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(1))
    greedy, _ = run(model, ids, max_new_tokens=10, use_cache=use_cache)
    for seed in (0, 1):
        cold, _ = run(model, ids, max_new_tokens=10, do_sample=True, temperature=0.0, seed=seed)
        assert torch.equal(cold, greedy)
    warm, _ = run(model, ids, max_new_tokens=10, do_sample=True, temperature=5.0, seed=0)
    assert not torch.equal(warm, greedy)  # the test can tell sampling from argmax
    assert GenerationConfig.of(temperature=None, top_k=None) == GenerationConfig()
    with pytest.raises(GenerationError, match="no generation setting 'temp'"):
        GenerationConfig.of(temp=0.5)
