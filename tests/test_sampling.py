"""The decoding steps of §10.8 as pure functions on logits."""

import math

import pytest
import torch

from tlm.generate import (
    GenerationError,
    apply_repetition_penalty,
    apply_temperature,
    greedy,
    process_logits,
    sample,
    top_k_filter,
    top_p_filter,
)

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])  # already sorted, for readable kept sets
LOGITS = PROBS.log()


def kept(logits):
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_temperature_divides_the_logits():
    u = torch.tensor([1.0, -2.0, 4.0])
    assert torch.equal(apply_temperature(u, 1.0), u)
    assert torch.equal(apply_temperature(u, 0.5), u * 2)  # eq. 10.49: softmax(u / τ)
    assert kept(apply_temperature(u, 0.0)) == {2}  # τ -> 0 is greedy
    flat, sharp = apply_temperature(u, 10).softmax(-1), apply_temperature(u, 0.1).softmax(-1)
    assert flat.max() < u.softmax(-1).max() < sharp.max()
    with pytest.raises(GenerationError, match="temperature must be >= 0, got -1"):
        apply_temperature(u, -1)


def test_top_k_keeps_exactly_the_k_largest():
    u = torch.tensor([[1.0, 3.0, 2.0, 5.0, 4.0]])
    assert kept(top_k_filter(u, 2)[0]) == {3, 4}
    assert kept(top_k_filter(u, 1)[0]) == {3}  # k = 1 is greedy
    assert kept(top_k_filter(u, 50)[0]) == {0, 1, 2, 3, 4}
    assert top_k_filter(u, 2)[0, 3] == 5.0  # kept logits are unchanged
    with pytest.raises(GenerationError, match="top_k must be >= 1, got 0"):
        top_k_filter(u, 0)


@pytest.mark.parametrize(
    "p, expected",
    [
        (0.01, {0}),
        (0.45, {0}),
        (0.7, {0, 1}),
        (0.9, {0, 1, 2}),
        (0.99, {0, 1, 2, 3}),
        (1, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    assert kept(top_p_filter(LOGITS, p)) == expected  # eq. 10.47
    shuffled = torch.tensor([2, 0, 3, 1])  # the same distribution in another order
    assert kept(top_p_filter(LOGITS[shuffled], p)) == {
        int((shuffled == i).nonzero()) for i in expected
    }


def test_top_p_rejects_values_outside_the_unit_interval():
    for p in (0, -0.5, 1.5):
        with pytest.raises(GenerationError, match=f"top_p must be in \\(0, 1\\], got {p}"):
            top_p_filter(LOGITS, p)


def test_filters_compose_temperature_then_top_k_then_top_p():
    torch.manual_seed(0)
    u = torch.randn(3, 50)
    by_hand = top_p_filter(top_k_filter(apply_temperature(u, 0.7), 10), 0.8)
    assert torch.equal(process_logits(u, 0.7, 10, 0.8), by_hand)


def test_repetition_penalty():
    u = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert torch.equal(
        apply_repetition_penalty(u, seen, 2.0), torch.tensor([[1.0, -4.0, 2.0, -2.0]])
    )
    assert torch.equal(apply_repetition_penalty(u, seen, 1.0), u)


def test_sampling_frequencies_match_the_renormalised_distribution():
    """Chi-square on 20,000 draws from the top-p nucleus, with a fixed generator."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])
    filtered = top_p_filter(logits, 0.8)
    nucleus = sorted(kept(filtered))
    probs = logits[nucleus].softmax(-1)  # what remains, renormalised
    draws = sample(filtered.expand(20_000, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=len(logits))
    assert counts.sum() == counts[nucleus].sum()  # nothing outside the nucleus is ever drawn
    expected = probs * 20_000
    chi2 = (((counts[nucleus] - expected) ** 2) / expected).sum().item()
    critical = {1: 10.83, 2: 13.82, 3: 16.27}[len(nucleus) - 1]  # p = 0.001
    assert chi2 < critical
    assert greedy(logits) == 0


def test_sampling_at_temperature_zero_is_the_argmax():
    u = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    draws = sample(apply_temperature(u, 0), torch.Generator().manual_seed(2))
    assert torch.equal(draws, greedy(u))
    assert math.isclose(apply_temperature(u, 0).softmax(-1).max(-1).values.min().item(), 1.0)


def test_greedy_takes_the_first_maximum_as_torch_does():
    from tlm.generate.sampling import greedy

    logits = torch.randn(5, 50257)
    logits[1, [7, 9000]] = 50.0  # a tie: the first
    logits[2, 123] = float("nan")  # a NaN counts as the maximum
    logits[3] = 0.0  # all equal
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert greedy(logits)[1] == 7 and greedy(logits)[2] == 123 and greedy(logits)[3] == 0
    assert greedy(logits[0]).shape == () and greedy(logits[0]) == logits[0].argmax()
    assert torch.equal(greedy(logits.double()), logits.double().argmax(-1))  # torch's path


@pytest.mark.usefixtures("kernel_build")
def test_greedy_logprob_is_the_argmax_and_its_log_softmax():
    """The one-pass C pick (fp32 CPU) against torch: the first of equal maxima wherever it
    falls (a block of 256 holds it, or the last partial block), and its log-probability
    within 1e-6 of fp64's on every build (seen: 2.4e-7; a sum in fp32 lanes was 9.8e-6 off
    with AVX-512's code and 1.9e-5 with AVX2's, and so is torch's fp32 log_softmax, 9.8e-6);
    logits that are not all finite take torch's path and agree with it."""
    from tlm.generate.sampling import greedy_logprob

    torch.manual_seed(0)
    cases = []
    for top in (0, 5, 255, 256, 30_000, 50_256):
        logits = torch.randn(50_257) * 3
        logits[top] = logits[min(top + 1, 50_256)] = logits[-3] = 20.0  # ties: the first wins
        cases.append(logits)
    cases += [torch.randn(7), torch.full((300,), -1e30)]
    for odd in (float("nan"), float("inf"), float("-inf")):
        logits = torch.randn(1000)
        logits[500] = odd
        cases.append(logits)
    for logits in cases:
        token, logprob = greedy_logprob(logits)
        assert token == int(logits.argmax())
        expected = float(logits.double().log_softmax(-1)[token])
        assert logprob == pytest.approx(expected, abs=1e-6, nan_ok=True)


def test_rows_of_one_config_are_drawn_together_as_each_would_be_alone(monkeypatch):
    """choose_rows brings the plain draws of one config to their distribution in one call
    ([k,V]) and draws each from its own generator: the tokens and log-probabilities of
    every row are those it gets chosen alone; a row with penalties keeps its own path."""
    from tlm.generate import GenerationConfig, sampling
    from tlm.generate import choice as module
    from tlm.generate.choice import RowChoice, choose_rows

    V, logits = 50, torch.randn(6, 50) * 3
    config = GenerationConfig(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    penalised = GenerationConfig(do_sample=True, repetition_penalty=1.3)

    def rows():
        made = [RowChoice.of_row([1, 2], config, V, torch.device("cpu"), j, 7) for j in range(5)]
        return [*made, RowChoice.of_row([1, 2], penalised, V, torch.device("cpu"), 5, 7)]

    alone = [row.choose(logits[r]) for r, row in enumerate(rows())]
    calls = []
    monkeypatch.setattr(module, "distribution", lambda x, c, *a: calls.append(len(x)) or
                        sampling.distribution(x, c, *a))  # fmt: skip
    together = choose_rows(rows(), logits)
    assert calls == [5]  # the five plain rows at once; the penalised row on its own path
    assert [t for t, _, _ in together] == [t for t, _, _ in alone]
    assert [lp for _, lp, _ in together] == pytest.approx([lp for _, lp, _ in alone])


def test_a_draw_follows_the_distribution_and_refuses_one_that_is_not():
    """`draw_rows`, every draw's one inverse-CDF pass: each row from its own generator, a
    token of probability 0 never, frequencies within 4 standard errors of p; rows of NaN or
    of no mass refused, as torch.multinomial refuses them."""
    from tlm.generate.sampling import draw_rows

    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    n = 40_000
    got = draw_rows(p.expand(n, 4), [torch.Generator().manual_seed(0)] * n)
    freq = torch.bincount(got, minlength=4).double() / n
    assert freq[1] == 0 and torch.all((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-12)
    one = [torch.Generator().manual_seed(s) for s in (1, 1, 2)]
    rows = draw_rows(torch.tensor([[0.5, 0.5]] * 3), one)
    again = draw_rows(
        torch.tensor([[0.5, 0.5]] * 3), [torch.Generator().manual_seed(s) for s in (1, 1, 2)]
    )
    assert rows.tolist() == again.tolist() and rows[0] == rows[1]
    for bad in (torch.tensor([[0.5, float("nan")]]), torch.zeros(1, 3)):
        with pytest.raises(RuntimeError, match="inf, nan or no mass"):
            draw_rows(bad, [None])
