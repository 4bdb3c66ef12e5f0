"""Speculative sampling with a draft model (`Slots._speculate`, `Slots._accept`): a draft
token x is kept with probability min(1, p(x)/q(x)), the first one not kept replaced by a
draw from norm(max(0, p - q)). The tokens then follow the target's distribution exactly:
held against the distribution plain sampling draws from by a χ² test that a wrong
residual fails.

Power (worked out from the two models' exact distributions): the wrong residual (a draw
from p where norm(max(0, p - q)) belongs) moves P(t1, t2) by a noncentrality λ = 191
(temperature 1, 27 cells) and 177 (top-k 4 with a repetition penalty, 16 cells) at SAMPLES
= 800, against a critical χ² of 54 and 38 at LEVEL: the test misses it with probability
6e-15 and 1e-15 (measured here: p = 1e-29 and 3e-32). The models it had before, both of
std 0.5, gave λ = 36 and 114 at 3000 samples: misses of 0.06 and 6e-9. A right rule
fails with probability LEVEL."""

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from tlm.generate import GenerationConfig
from tlm.generate.choice import RowChoice
from tlm.generate.sampling import draw
from tlm.generate.slots import Slots
from tlm.inference import for_decoding

V, PROMPT, SAMPLES, LEVEL = 6, [1, 2, 3], 800, 1e-3


def peaked(make_model, seed: int, std: float):
    """A model of V tokens whose weights are N(0, std): the larger std, the further its
    distributions are from uniform."""
    model = make_model(seed=seed, vocab_size=V, n_layers=1, d_model=32, n_heads=2)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    return for_decoding(model)


@torch.no_grad()
def plain_pairs(model, config: GenerationConfig) -> torch.Tensor:
    """P(t1, t2) [V,V] of the first two tokens plain sampling draws after PROMPT, each from
    the distribution the row's processing gives (penalties move with t1)."""
    first = model(torch.tensor([PROMPT]))[0, -1]
    p1 = RowChoice(PROMPT, config, None, V, torch.device("cpu")).probabilities(first)
    seconds = model(torch.tensor([PROMPT + [t] for t in range(V)]))[:, -1]
    rows = []
    for t in range(V):
        choice = RowChoice(PROMPT, config, None, V, torch.device("cpu"))
        choice.record(t)
        rows.append(choice.probabilities(seconds[t]))
    return p1[:, None] * torch.stack(rows)


def drafted_pairs(model, draft, config: GenerationConfig) -> tuple[torch.Tensor, Slots]:
    """Counts [V,V] of the first two tokens of SAMPLES sequences decoded alone with `draft`."""
    slots, counts = Slots(model, 1), torch.zeros(V, V)
    for j in range(SAMPLES):
        sequence = slots.add(PROMPT, config, sample=j, seed=7)
        while not sequence.done:
            slots.step()
        counts[sequence.tokens[0], sequence.tokens[1]] += 1
    return counts, slots


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """χ² goodness of fit of counts to probs, cells expected < 5 times pooled into one; a
    count where probs is 0 (top-k's cut) is impossible: 0."""
    probs = probs.double() / probs.double().sum()  # fp32's rounding would upset scipy's check
    expected = (probs * counts.sum()).flatten()
    observed = counts.flatten().double()
    if observed[expected == 0].sum() > 0:
        return 0.0
    observed, expected = observed[expected > 0], expected[expected > 0]
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def wrong_residual(choice, logits, drafted, q):
    """The rule with p for the residual: too many draws of what q favours."""
    p = choice.probabilities(logits)
    u = float(torch.rand((), generator=choice.generator))
    return drafted if u * float(q[drafted]) < float(p[drafted]) else draw(p, choice.generator)


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 4, "repetition_penalty": 1.5}],
)
def test_drafted_samples_follow_the_targets_distribution(make_model, monkeypatch, settings):
    model, other = peaked(make_model, 0, std=0.3), peaked(make_model, 4, std=1.0)  # see above
    config = GenerationConfig(max_new_tokens=3, do_sample=True, **settings)
    probs = plain_pairs(model, config)
    drafted = replace(config, draft=other, draft_tokens=2)
    counts, slots = drafted_pairs(model, other, drafted)
    assert slots.checks >= SAMPLES and 0.2 < slots.accepted / slots.drafted < 0.9
    assert p_value(counts, probs) > LEVEL
    monkeypatch.setattr(Slots, "_accept", staticmethod(wrong_residual))
    wrong, _ = drafted_pairs(model, other, drafted)
    assert p_value(wrong, probs) < LEVEL  # the test tells the wrong residual apart
