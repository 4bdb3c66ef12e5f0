"""The CUDA tier, decoding (issue 62): every path a user reaches on a GPU, held to the eager
run of the same seed, the uncached reference, or the CPU's tokens.

Run by `make test-gpu` on a machine with a GPU (`-m cuda`); skipped without one.
`TLM_TIER_DEVICE=cpu` runs the tier on the CPU, to check the tier itself where no GPU is
lent (no graph is recorded there: graphed and eager are the same path). That a path ran
is counted (replays of the recorded step, steps that carry draft figures), never inferred
from two results differing.
"""

from dataclasses import replace

import pytest
import torch

from conftest import V, tiny_config
from tlm import TransformerLM
from tlm.generate import GenerationConfig, beam_search, complete, generate, stream_completion
from tlm.inference.devices.cuda_graph import GraphedDecoder

pytestmark = pytest.mark.cuda

SETTINGS = {
    "greedy": {},
    "sample": {"do_sample": True},
    "temperature": {"do_sample": True, "temperature": 0.6},
    "top-k": {"do_sample": True, "top_k": 5},
    "top-p": {"do_sample": True, "top_p": 0.9},
    "repetition": {"repetition_penalty": 1.3},
    "frequency-presence": {"do_sample": True, "frequency_penalty": 0.8, "presence_penalty": 0.5},
    "bias": {"do_sample": True, "logit_bias": {3: 4.0, 7: -100.0}},
    "n": {"do_sample": True, "num_return_sequences": 3},
}
DRAFTS = {
    "lookup": {"prompt_lookup": 2},
    "lookup-sampled": {"prompt_lookup": 2, "do_sample": True, "top_k": 20},
    "draft-model": {"draft": "model"},
    "draft-model-sampled": {"draft": "model", "do_sample": True},
    "int8": {"draft": "int8"},
}


def varied(model: TransformerLM, seed: int = 0) -> TransformerLM:
    """Weights of std 0.3 (gains near 1): tokens that change from step to step."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("gamma") else 0.0, 0.3, generator=generator)
    return model.eval()


def on(device, seed: int = 0, **overrides) -> TransformerLM:
    torch.manual_seed(seed)
    return varied(TransformerLM(tiny_config(**overrides)), seed).to(device)


def decoded(model, ids, **settings):
    """(tokens [B,new], logprobs [B,new], the steps' draft figures) of one generation."""
    config = GenerationConfig(max_new_tokens=16, seed=5, **settings)
    steps = list(generate(model, ids, config))
    tokens = torch.stack([s.tokens for s in steps], 1)
    return tokens, torch.stack([s.logprobs for s in steps], 1), [s.drafts for s in steps]


@pytest.fixture
def replays(monkeypatch):
    """The number of graphed steps run since the test began."""
    count = [0]
    step = GraphedDecoder.step

    def counted(self, tokens):
        count[0] += 1
        return step(self, tokens)

    monkeypatch.setattr(GraphedDecoder, "step", counted)
    return count


def prompts(device):
    return torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.parametrize("name", SETTINGS)
def test_every_setting_graphed_equals_eager_for_the_same_seed(gpu, name, replays):
    model, ids = on(gpu), prompts(gpu)
    graphed, graphed_lp, _ = decoded(model, ids, cuda_graph=True, **SETTINGS[name])
    assert replays[0] > 0 or gpu.type != "cuda"  # the recorded step ran
    eager, eager_lp, _ = decoded(model, ids, cuda_graph=False, **SETTINGS[name])
    assert graphed.device.type == gpu.type  # a step's tensors are on the model's device
    assert torch.equal(graphed, eager)
    assert torch.allclose(graphed_lp, eager_lp, atol=1e-4)
    if not SETTINGS[name].get("do_sample"):  # greedy in fp32: the CPU's tokens
        cpu, _, _ = decoded(on("cpu"), ids.cpu(), **SETTINGS[name])
        assert torch.equal(graphed.cpu(), cpu)


def test_cached_equals_the_uncached_reference_on_the_gpu(gpu):
    model, ids = on(gpu), prompts(gpu)
    for settings in ({}, {"do_sample": True, "top_p": 0.8}):
        cached, cached_lp, _ = decoded(model, ids, **settings)
        reference, reference_lp, _ = decoded(model, ids, use_cache=False, **settings)
        assert torch.equal(cached, reference)
        assert torch.allclose(cached_lp, reference_lp, atol=1e-4)


@pytest.fixture
def untimed(monkeypatch):
    """Drafting paced by acceptance alone (the time rule depends on the host's speed)."""
    from tlm.generate.pace import Pace

    monkeypatch.setattr(Pace, "plain", lambda self, seconds: None)


@pytest.mark.parametrize("name", DRAFTS)
def test_drafts_are_taken_on_the_default_path_and_change_no_token(gpu, name, untimed):
    model = on(gpu, n_layers=1)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]], device=gpu)  # a text that repeats
    settings = dict(DRAFTS[name])
    if settings.get("draft") == "model":
        settings["draft"] = on(gpu, seed=1, n_layers=1)
    plain_settings = {k: v for k, v in settings.items() if k not in ("draft", "prompt_lookup")}
    plain, _, _ = decoded(model, ids, **plain_settings)
    drafted, _, figures = decoded(model, ids, **settings)  # cuda_graph=True, the default
    assert all(f is not None for f in figures)  # every step carries its draft figures
    assert figures[-1][0][0] > 0  # tokens were drafted
    if not settings.get("do_sample") or "prompt_lookup" in settings:  # chosen drafts: same draws
        assert torch.equal(drafted, plain)


def test_windowed_and_rope_scaled_models_decode_as_the_uncached_reference(gpu):
    windowed = on(gpu, position="rope", context_length=64, attention_window=16)
    ids = prompts(gpu)
    steps = GenerationConfig(max_new_tokens=150, seed=5)
    long_cached = torch.stack([s.tokens for s in generate(windowed, ids, steps)], 1)
    reference = generate(windowed, ids, GenerationConfig(max_new_tokens=150, use_cache=False))
    assert torch.equal(long_cached, torch.stack([s.tokens for s in reference], 1))
    base = on("cpu", position="rope")
    stretched = TransformerLM(base.config.stretched("yarn", 4.0)).eval()
    stretched.load_state_dict(base.state_dict())
    stretched = stretched.to(gpu)
    for graph in (True, False):
        ours = generate(stretched, ids, GenerationConfig(max_new_tokens=100, cuda_graph=graph))
        theirs = generate(stretched, ids, GenerationConfig(max_new_tokens=100, use_cache=False))
        assert torch.equal(
            torch.stack([s.tokens for s in ours], 1), torch.stack([s.tokens for s in theirs], 1)
        )


def test_whole_sequences_beams_and_best_of_come_back_on_the_models_device(gpu):
    model, cpu_model = on(gpu), on("cpu")
    ids = prompts("cpu")  # ids on the CPU, a model on the GPU: moved once, at the entry
    out = model.generate(ids, max_new_tokens=8)
    assert out.device.type == gpu.type
    assert torch.equal(out.cpu(), cpu_model.generate(ids, max_new_tokens=8))
    beams = beam_search(model, ids, GenerationConfig(num_beams=3, max_new_tokens=6))
    assert beams.sequences.device.type == gpu.type
    cpu_beams = beam_search(cpu_model, ids, GenerationConfig(num_beams=3, max_new_tokens=6))
    assert torch.equal(beams.sequences.cpu(), cpu_beams.sequences)
    settings = dict(max_new_tokens=8, do_sample=True, best_of=3, num_return_sequences=2, seed=4)
    best = model.generate(ids, **settings)
    assert best.shape == (4, 15) and best.device.type == gpu.type
    assert torch.equal(best, model.generate(ids, cuda_graph=False, **settings))


def test_stop_strings_streaming_and_grammar_on_the_gpu(gpu, bpe_tokenizer):
    model = on(gpu, vocab_size=V)
    sampled = GenerationConfig(max_new_tokens=24, do_sample=True, seed=7)
    texts = ["The for statement", "while"]
    graphed = complete(model, bpe_tokenizer, texts, sampled, stop=("e",))
    eager = complete(model, bpe_tokenizer, texts, replace(sampled, cuda_graph=False))
    assert [c.text.split("e")[0] for c in eager] == [c.text for c in graphed]
    streamed = "".join(stream_completion(model, bpe_tokenizer, texts[0], sampled))
    assert streamed == complete(model, bpe_tokenizer, texts[:1], sampled)[0].text
    pytest.importorskip("llguidance")
    from tlm.generate.constrain import Grammar

    grammar = Grammar.regex("(cat|dog|bird)s?", bpe_tokenizer)
    config = GenerationConfig(max_new_tokens=8, do_sample=True, seed=1, grammar=grammar)
    for c in complete(model, bpe_tokenizer, texts, config):
        assert c.text in {"cat", "dog", "bird", "cats", "dogs", "birds"}
