"""Decoding switches grad mode off inside each step only, never in the caller's code."""

import torch

from tlm.generate import GenerationConfig, beam_search, generate


def test_generate_leaves_the_callers_grad_mode_alone(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (2, 4))
    seen = []
    for step in generate(model, ids, GenerationConfig(max_new_tokens=5)):
        seen.append(torch.is_grad_enabled())  # the caller's code, between steps
        assert not step.logprobs.requires_grad  # each step itself ran without a graph
        x = torch.ones(1, requires_grad=True)
        assert (x * 2).requires_grad  # the caller can still build a graph mid-generation
    assert seen == [True] * 5 and torch.is_grad_enabled()
    with torch.no_grad():  # and a caller that turned grad off keeps it off
        for _ in generate(model, ids, GenerationConfig(max_new_tokens=2)):
            assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


def test_beam_search_and_model_generate_leave_grad_mode_on(make_model):
    model = make_model()
    ids = torch.randint(0, 97, (1, 4))
    beam_search(model, ids, GenerationConfig(max_new_tokens=3, num_beams=2))
    model.generate(ids, max_new_tokens=3)
    assert torch.is_grad_enabled()
