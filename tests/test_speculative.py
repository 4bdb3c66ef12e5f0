"""Speculative decoding with prompt lookup (generate/drafts.py, `Slots._speculate`): the
tokens plain decoding gives, greedy or sampled from the same seed, with drafts kept."""

import json
import random
import re

import pytest
import torch

from conftest import save_run
from tlm.cli import main
from tlm.generate import GenerationConfig
from tlm.generate.drafts import NgramIndex, prompt_lookup
from tlm.generate.pace import Pace
from tlm.generate.slots import Slots
from tlm.inference import for_decoding, for_inference
from tlm.tokenizer import CharTokenizer


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    text = [1, 2, 3, 9, 1, 2, 4, 7, 5, 1, 2]
    assert prompt_lookup(text, 2, 3) == [4, 7, 5]  # [1, 2] last seen at 4: 4 7 5 followed
    assert prompt_lookup(text, 2, 1) == [4]
    assert prompt_lookup([5, 6, 7, 6], 3, 2) == [7, 6]  # no [7, 6] or [5, 6, 7, 6] before: [6]
    assert prompt_lookup([1, 2, 3], 2, 4) == []  # nothing recurs
    assert prompt_lookup([4], 2, 4) == [] and prompt_lookup([4, 4], 1, 3) == [4]


def test_the_ngram_index_proposes_what_prompt_lookup_proposes():
    """`NgramIndex`, kept as a text grows, answers as the scan does, for every prefix."""
    for trial in range(200):
        rng = random.Random(trial)
        ngram, vocab = rng.randint(1, 4), rng.choice([2, 3, 5, 20])
        text, index = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))], NgramIndex(ngram)
        for _ in range(30):
            count = rng.randint(1, 6)
            assert index.propose(text, count) == prompt_lookup(text, ngram, count), trial
            text += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]


def looping(make_model, fmt: str, **overrides):
    """A model whose greedy text soon repeats itself (weights of std 0.3), prepared in fmt."""
    model = make_model(**overrides)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return for_decoding(model) if fmt == "plain" else for_inference(model, fmt)


def decode(model, prompt: list[int], config: GenerationConfig, seed: int = 0):
    """The tokens of one sequence decoded alone on `Slots`, and the sequence."""
    slots = Slots(model, 1)
    sequence = slots.add(prompt, config, seed=seed)
    while not sequence.done:
        slots.step()
    return sequence.tokens, sequence


SETTINGS = [
    {},
    {"repetition_penalty": 1.3},
    {"do_sample": True, "temperature": 0.3},
    {"do_sample": True, "temperature": 0.5, "top_k": 5, "presence_penalty": 0.5},
    {"logit_bias": {3: 2.0}, "frequency_penalty": 0.05},
]


@pytest.mark.parametrize("fmt", ["plain", "int8"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_prompt_lookup_gives_the_tokens_of_plain_decoding(make_model, fmt, settings, untimed):
    model = looping(make_model, fmt, position="rope")
    prompt = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt = prompt + prompt[:8]  # a text that quotes itself
    kept = 0
    for seed in range(3):
        plain = GenerationConfig(max_new_tokens=40, **settings)
        expected, _ = decode(model, prompt, plain, seed)
        for n, draft in [(1, 3), (3, 6)]:
            fast = GenerationConfig(
                max_new_tokens=40, prompt_lookup=n, draft_tokens=draft, **settings
            )
            got, sequence = decode(model, prompt, fast, seed)
            assert got == expected, (seed, n, draft)
            assert sequence.checks > 0 and sequence.accepted <= sequence.drafted
            kept += sequence.accepted
    assert kept > 0  # drafts were kept: tokens came more than one a step


def test_stops_and_lengths_fall_on_the_same_token(make_model):
    """max_new_tokens and an end token inside a kept draft end the text where plain decoding
    ends it; `model.generate` and `tlm.generate` take prompt_lookup as a setting."""
    model = looping(make_model, "plain")
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(5))
    ids = torch.cat([ids, ids], dim=1)
    expected = model.generate(ids, max_new_tokens=30)
    eos = int(expected[0, 20 + 12])  # a token the text reaches, possibly inside a draft
    for new in (1, 2, 7, 30):
        got = model.generate(ids, max_new_tokens=new, prompt_lookup=2, draft_tokens=8)
        assert torch.equal(got, expected[:, : 20 + new])
    plain = model.generate(ids, max_new_tokens=30, eos_token_id=eos)
    fast = model.generate(ids, max_new_tokens=30, eos_token_id=eos, prompt_lookup=2)
    assert torch.equal(fast, plain)
    with pytest.raises(ValueError, match="prompt_lookup must be >= 1"):
        model.generate(ids, prompt_lookup=0)


@pytest.fixture
def untimed(monkeypatch):
    """Drafting paced by acceptance alone: no plain step's time is known, so the time rule
    (which depends on the host's speed) never pauses a draft."""
    monkeypatch.setattr(Pace, "plain", lambda self, seconds: None)


def test_a_draft_that_misses_gets_shorter(make_model, monkeypatch, untimed):
    """Drafts the target never keeps shrink by one a check, down to one token, and leave
    the tokens as plain decoding gives them; none is drafted past max_new_tokens."""
    model = looping(make_model, "plain")
    monkeypatch.setattr(NgramIndex, "propose", lambda self, text, count: [5] * count)
    never = {"max_new_tokens": 12, "logit_bias": {5: -100}}  # token 5 is never chosen
    expected, _ = decode(model, [1, 2, 3], GenerationConfig(**never))
    config = GenerationConfig(prompt_lookup=1, draft_tokens=6, **never)
    tokens, sequence = decode(model, [1, 2, 3], config)
    assert tokens == expected and sequence.accepted == 0
    assert sequence.drafted == 6 + 5 + 4 + 3 + 2 + 1  # then 4 plain steps; no room after
    assert sequence.checks == 6 and sequence.pace.pause == 0 and sequence.pace.next_pause == 8


def test_a_draft_that_costs_more_than_it_gives_pauses():
    """The time rule (`pace.py`): a drafting step dearer a token than plain steps pauses
    drafting 4, 8, 16 … steps whatever was kept; one that pays sets the pause back."""
    pace = Pace(most=5)
    pace.checked(5, 5, 0.010)  # no plain step timed yet: only acceptance counts,
    assert pace.pause == 1 and pace.length == 5  # and a plain step comes next, to measure
    assert not pace.wants_draft() and pace.wants_draft()
    pace.plain(0.001)
    pace.checked(5, 2, 0.006)  # 2 ms a token against 1 ms: drafting loses
    assert (pace.pause, pace.next_pause, pace.length) == (4, 8, 4)
    assert [pace.wants_draft() for _ in range(5)] == [False] * 4 + [True]
    pace.checked(4, 4, 0.008)  # 1.6 ms a token
    assert (pace.pause, pace.next_pause) == (8, 16)
    pace.pause = 0
    pace.checked(5, 5, 0.003)  # 0.5 ms a token: drafting pays
    assert (pace.pause, pace.next_pause) == (0, 4)
    for _ in range(12):
        pace.checked(1, 0, 0.005)
    assert pace.next_pause == 256  # the longest pause after slow drafts
    lookup = Pace(most=5, timed=False)  # prompt lookup: free drafts, paced by acceptance
    lookup.plain(0.001)
    lookup.checked(5, 0, 1.0)
    assert (lookup.pause, lookup.length, lookup.plain_cost) == (0, 4, None)


@pytest.mark.parametrize("settings", [{}, {"repetition_penalty": 1.3, "logit_bias": {3: 1.0}}])
def test_a_draft_model_gives_the_tokens_of_greedy_decoding(make_model, settings, untimed):
    """The target's own weights in int8, or another model of its vocabulary, propose their
    likeliest tokens; the tokens are plain greedy decoding's (the target chooses each), and
    the int8 self-draft's proposals are mostly kept; the target is left as it was."""
    model = looping(make_model, "plain", position="rope")
    small = looping(make_model, "plain", n_layers=1, seed=1)  # another model, same vocabulary
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        before = model(torch.tensor([prompt]))
    expected, _ = decode(model, prompt, GenerationConfig(max_new_tokens=30, **settings))
    for draft in ("int8", small):
        config = GenerationConfig(max_new_tokens=30, draft=draft, draft_tokens=4, **settings)
        got, sequence = decode(model, prompt, config)
        assert got == expected and sequence.checks > 0
        if draft == "int8":
            assert sequence.accepted >= 0.6 * sequence.drafted  # int8 agrees mostly
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([prompt])), before)


def test_a_sampled_row_draws_its_draft(make_model, untimed):
    """A sampled row's draft is drawn from the draft's distribution (the acceptance rule,
    `test_speculative_sampling.py`): the int8 self-draft's q is close to p, so at
    temperature 1 most of its tokens are kept, where the likeliest token alone would be
    kept less often; a seed gives the same tokens twice."""
    model = looping(make_model, "plain", position="rope")
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    config = GenerationConfig(max_new_tokens=40, do_sample=True, draft="int8", draft_tokens=4)
    first, sequence = decode(model, prompt, config, seed=3)
    again, _ = decode(model, prompt, config, seed=3)
    assert first == again and len(first) == 40
    assert sequence.accepted >= 0.8 * sequence.drafted and sequence.checks < 20


def test_a_draft_that_cannot_serve_is_refused_in_one_line(make_model):
    model = looping(make_model, "plain")
    other = make_model(vocab_size=50)
    with pytest.raises(ValueError, match="draft must share the target's tokenizer"):
        decode(model, [1, 2, 3], GenerationConfig(max_new_tokens=5, draft=other))
    packed = for_inference(make_model(), "float16")
    with pytest.raises(ValueError, match="keeps its weights in float16 only"):
        decode(packed, [1, 2, 3], GenerationConfig(max_new_tokens=5, draft="int8"))
    with pytest.raises(ValueError, match="one draft at a time"):
        GenerationConfig(prompt_lookup=2, draft="int8")


def test_the_command_line_drafts_and_refuses_another_tokenizer(
    make_model, tmp_path, capsys, untimed
):
    chars = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")
    save_run(tmp_path / "run", looping(make_model, "plain", vocab_size=chars.vocab_size), chars)
    other = CharTokenizer("abcdefghijklmnopqrstuvwxyz ,")
    save_run(tmp_path / "other", make_model(vocab_size=other.vocab_size), other)
    outputs = []
    for flags in (
        [],
        ["--draft", "int8"],
        ["--prompt-lookup", "2"],
        ["--draft", "int8", "--dtype", "int8"],
    ):
        command = ["generate", str(tmp_path / "run"), "--prompt", "the cat sat. the cat"]
        assert main([*command, "--max-new-tokens", "24", "--no-eos", *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) > 24
    command = ["generate", str(tmp_path / "run"), "--prompt", "the cat sat. the cat", "--json"]
    assert main([*command, "--max-new-tokens", "24", "--no-eos", "--prompt-lookup", "2"]) == 0
    (completion,) = json.loads(capsys.readouterr().out)["completions"]
    drafts = completion["speculation"]  # tokens drafted and kept, and the target's steps
    assert 0 < drafts["accepted"] <= drafts["drafted"] and len(completion["tokens"]) == 24
    assert drafts["target_steps"] + drafts["accepted"] == 24
    assert drafts["acceptance"] == round(drafts["accepted"] / drafts["drafted"], 4)
    assert drafts["tokens_per_step"] == round(24 / drafts["target_steps"], 4)
    assert main([*command, "--max-new-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["completions"][0]["speculation"] is None
    assert (
        main(
            ["generate", str(tmp_path / "run"), "--prompt", "a", "--draft", str(tmp_path / "other")]
        )
        == 2
    )
    assert "has another tokenizer" in capsys.readouterr().err


def test_the_server_engine_drafts_for_a_request_decoding_alone(make_model, untimed):
    """`tlm serve --prompt-lookup` (Engine(speculate=...)): a request's tokens are those
        of the engine without drafts, and /metrics counts the drafted and kept tokens, the
    share kept and the tokens per step that checked a draft."""
    import queue

    from tlm.serve import Engine, Metrics
    from tlm.serve.engine import Job

    chars = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")
    model = looping(make_model, "plain", vocab_size=chars.vocab_size)
    prompt = chars.encode("a cat. a cat")  # and 16 new: within the 32 positions
    got = []
    for speculate in (None, {"prompt_lookup": 2, "draft_tokens": 4}):
        engine, metrics = Engine(model, chars, 2, speculate=speculate), Metrics()
        metrics.watch(engine)
        events: queue.Queue = queue.Queue()
        try:
            engine.submit(Job(prompt, GenerationConfig(max_new_tokens=16), events.put))
            tokens = []
            while (event := events.get(timeout=60)) is not None:
                tokens.append(event.token)
        finally:
            engine.close()
        got.append(tokens)
        page = metrics.render().decode()
    assert got[0] == got[1] and len(got[0]) == 16
    names = ("tokens", "kept_tokens", "checks", "acceptance", "tokens_per_step")
    drafted, kept, checks, acceptance, per_step = (
        float(re.search(rf"^tlm_draft_{name} (\S+)$", page, re.M).group(1)) for name in names
    )
    assert drafted > 0 and 0 < kept <= drafted and acceptance == pytest.approx(kept / drafted)
    assert per_step == pytest.approx((kept + checks) / checks) and per_step > 1
