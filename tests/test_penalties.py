"""OpenAI's sampling parameters in the one decoding core: logit_bias, frequency and presence
penalties, best_of; each held to a restatement of its definition, cached == uncached,
batched == alone, and the documented order of operations."""

import json
import math
from dataclasses import replace

import pytest
import torch
from test_decode import run, varied_model

from conftest import save_run, tiny_config
from tlm import TransformerLM
from tlm.cli import main
from tlm.generate import GenerationConfig, GenerationError, choose, complete, process_logits
from tlm.generate.sampling import apply_frequency_presence, apply_logit_bias


def test_logit_bias_adds_to_the_named_logits():
    logits = torch.randn(2, 7)
    biased = apply_logit_bias(logits, ((1, 2.5), (6, -100.0)))
    expected = logits.clone()
    expected[:, 1] += 2.5
    expected[:, 6] -= 100
    assert torch.equal(biased, expected)
    with pytest.raises(GenerationError, match="names token 7; the vocabulary has 7"):
        apply_logit_bias(logits, ((7, 1.0),))


def test_frequency_and_presence_penalties_are_openais_formula():
    logits, counts = torch.randn(1, 5), torch.tensor([[0.0, 1, 3, 0, 2]])
    penalised = apply_frequency_presence(logits, counts, 0.5, 1.25)
    for j, c in enumerate(counts[0].tolist()):  # mu_j - c_j a_f - [c_j > 0] a_p
        assert penalised[0, j] == pytest.approx(logits[0, j] - c * 0.5 - (c > 0) * 1.25)


def test_choose_applies_bias_then_penalties_then_temperature_top_k_top_p():
    """The order docs/serve.md states: bias, repetition, frequency/presence, then
    temperature, top-k, top-p; a draw from the result, with the same generator."""
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    seen = torch.rand(1, 50) < 0.3
    logits[0, 3], seen[0, 3] = 2.0, True  # biased and seen: the order of the two shows
    counts = torch.randint(0, 3, (1, 50)).float()
    config = GenerationConfig(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3,
        frequency_penalty=0.4, presence_penalty=0.9, logit_bias={3: 1.0, 4: -2.0},
    )  # fmt: skip
    u = logits.clone()
    u[0, 3] += 1.0
    u[0, 4] -= 2.0
    u = torch.where(seen, torch.where(u > 0, u / 1.3, u * 1.3), u)
    u = u - counts * 0.4 - (counts > 0) * 0.9
    expected = process_logits(u, 0.7, 20, 0.8).softmax(-1)
    draws = torch.stack(
        [
            choose(logits, config, [torch.Generator().manual_seed(s)], seen, counts)[0]
            for s in range(3000)
        ]
    )
    frequencies = torch.bincount(draws, minlength=50) / len(draws)
    assert (frequencies - expected[0]).abs().max() < 0.03
    assert set(draws.tolist()) <= set(torch.nonzero(expected[0]).flatten().tolist())


def hand_greedy(model, prompt, steps, frequency, presence, bias):
    """Greedy decoding restated: the whole text each step, the penalties from the output."""
    text, counts = list(prompt), torch.zeros(model.config.vocab_size)
    for _ in range(steps):
        with torch.no_grad():
            u = model(torch.tensor([text]))[0, -1].clone()
        for token, value in bias.items():
            u[token] += value
        u = u - counts * frequency - (counts > 0).float() * presence
        token = int(u.argmax())
        text.append(token)
        counts[token] += 1
    return text[len(prompt) :]


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_with_penalties_and_bias_is_the_restated_loop(make_model, use_cache):
    model = varied_model(make_model)
    prompt = [5, 17, 3, 9]
    settings = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={11: 1.0, 2: -3.0})
    tokens, _ = run(
        model, torch.tensor([prompt]), max_new_tokens=14, use_cache=use_cache, **settings
    )
    assert tokens[0].tolist() == hand_greedy(model, prompt, 14, 1.5, 0.5, {11: 1.0, 2: -3.0})
    plain, _ = run(model, torch.tensor([prompt]), max_new_tokens=14)
    assert tokens[0].tolist() != plain[0].tolist()  # the settings change the text
    repeats = lambda t: len(t) - len(set(t))  # noqa: E731
    assert repeats(tokens[0].tolist()) < repeats(plain[0].tolist())


def test_a_bias_of_100_selects_its_token_and_minus_100_bans_it(make_model):
    model = varied_model(make_model)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    for sampled in ({}, {"do_sample": True, "temperature": 1.5, "seed": 4}):
        chosen, _ = run(model, ids, max_new_tokens=6, logit_bias={42: 100}, **sampled)
        assert (chosen == 42).all()
        free, _ = run(model, ids, max_new_tokens=30, **sampled)
        common = int(torch.mode(free.flatten()).values)
        banned, _ = run(model, ids, max_new_tokens=30, logit_bias={common: -100}, **sampled)
        assert not (banned == common).any()


@pytest.mark.parametrize("settings", [{}, {"do_sample": True, "top_p": 0.9, "seed": 7}])
def test_penalised_rows_batched_left_padded_equal_each_alone(make_model, settings):
    model = varied_model(make_model)
    rows = [[4, 8, 15], [16, 23, 42, 7, 1]]
    settings = {**settings, "frequency_penalty": 0.8, "presence_penalty": -0.4}
    ids = torch.tensor([[0, 0, *rows[0]], rows[1]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    together, _ = run(model, ids, mask, max_new_tokens=9, **settings)
    for r, row in enumerate(rows):
        alone, _ = run(model, torch.tensor([row]), max_new_tokens=9, **settings)
        uncached, _ = run(model, torch.tensor([row]), max_new_tokens=9, use_cache=False, **settings)
        assert together[r].tolist() == alone[0].tolist() == uncached[0].tolist()


def test_best_of_returns_the_likeliest_of_the_samples(make_model):
    model = varied_model(make_model)
    ids = torch.tensor([[3, 1, 4], [1, 5, 9]])
    settings = dict(max_new_tokens=8, do_sample=True, temperature=1.3, seed=11)
    best = model.generate(ids, num_return_sequences=2, best_of=5, **settings)
    every = model.generate(ids, num_return_sequences=5, **settings)  # the same five samples
    steps = list(run(model, ids, num_return_sequences=5, **settings)[1].sum(dim=1))
    for p in range(2):
        totals = {tuple(every[p * 5 + j].tolist()): float(steps[p * 5 + j]) for j in range(5)}
        ranked = sorted(totals, key=totals.get, reverse=True)
        assert [tuple(r.tolist()) for r in best[p * 2 : p * 2 + 2]] == ranked[:2]
    assert len(set(totals.values())) > 1  # the samples differ


def test_best_of_in_text_completions_keeps_the_highest_total(make_model, bpe_tokenizer):
    model = varied_model(make_model, vocab_size=bpe_tokenizer.vocab_size)
    config = GenerationConfig(max_new_tokens=6, do_sample=True, seed=2, num_return_sequences=4)
    every = complete(model, bpe_tokenizer, ["The"], config)
    best = complete(
        model, bpe_tokenizer, ["The"], replace(config, num_return_sequences=1, best_of=4)
    )
    assert best[0].text == max(every, key=lambda c: math.fsum(c.logprobs)).text


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2]"),
        ({"logit_bias": {3: 101}}, "logit_bias must be token ids >= 0 with biases in [-100, 100]"),
        ({"best_of": 1, "num_return_sequences": 2}, "best_of must be >= num_return_sequences"),
        ({"num_beams": 2, "best_of": 3}, "best_of chooses among samples"),
    ],
)
def test_bad_values_are_refused_by_name(settings, message):
    with pytest.raises(GenerationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        GenerationConfig(**settings)


def test_cli_flags_reach_the_core(tmp_path, capsys, bpe_tokenizer):
    model = varied_model(lambda: _tiny(bpe_tokenizer.vocab_size))
    run_dir = save_run(tmp_path / "run", model, bpe_tokenizer)
    token = bpe_tokenizer.encode(" the")[0]
    argv = ["generate", str(run_dir), "--prompt", "A", "--max-new-tokens", "4", "--no-eos"]
    assert main([*argv, "--logit-bias", f"{token}:100", "--json"]) == 0
    completion = json.loads(capsys.readouterr().out)["completions"][0]
    assert completion["tokens"] == [token] * 4
    assert main([*argv, "--logit-bias", "x"]) == 2
    assert "--logit-bias takes ID:BIAS" in capsys.readouterr().err
    assert main([*argv, "--frequency-penalty", "3"]) == 2
    assert "frequency_penalty must be in [-2, 2]" in capsys.readouterr().err


def _tiny(vocab_size):
    torch.manual_seed(0)
    return TransformerLM(tiny_config(vocab_size=vocab_size)).eval()


def test_extreme_settings_still_choose_a_token():
    """repetition_penalty 1e-38 divides a positive logit past float range: the choice is
    still one of the penalised-up tokens, never an error (the server answered 500)."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0]])
    seen = torch.tensor([[True, True, True, False]])
    for sampled in ({}, {"do_sample": True, "top_p": 1e-150}):
        config = GenerationConfig(repetition_penalty=1.175494351e-38, **sampled)
        token = choose(logits, config, [torch.Generator().manual_seed(0)], seen)
        assert token.tolist() in ([0], [1])
