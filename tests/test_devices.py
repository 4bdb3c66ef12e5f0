"""One source of device (issue 62): every tensor a decoding loop makes is on the model's.

Sampling on a GPU crashed because `choose` made its tokens with `torch.tensor([...])` and no
device: on the CPU. A CPU host finds that class of bug without a GPU: each loop runs here
with torch's default device set to `meta`, so a tensor made without naming its device lands
there, and the first operation that meets it with the model's (CPU) tensors raises. The
results must also equal the same run's without it. Then `--device`: one place decides it
(`tlm.device.pick_device`), every command that runs a model takes it and names it first.
"""

import pytest
import torch

from conftest import V, save_run
from tlm.cli import main
from tlm.device import DeviceError, pick_device
from tlm.generate import GenerationConfig, beam_search, complete, generate
from tlm.generate.constrain import Grammar
from tlm.generate.slots import Slots

SETTINGS = {
    "greedy": {},
    "sample": {"do_sample": True},
    "top-k": {"do_sample": True, "top_k": 5},
    "top-p": {"do_sample": True, "top_p": 0.9, "temperature": 0.7},
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "bias": {"do_sample": True, "logit_bias": {3: 5.0}},
    "n": {"do_sample": True, "num_return_sequences": 2},
    "lookup": {"prompt_lookup": 2},
    "lookup-sampled": {"do_sample": True, "prompt_lookup": 2},
    "int8 draft": {"draft": "int8", "do_sample": True},
    "uncached": {"do_sample": True, "top_k": 9, "repetition_penalty": 1.2, "use_cache": False},
}


def varied(make_model, **overrides):
    """Weights of std 0.3: tokens that change from step to step."""
    model = make_model(**overrides)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("gamma") else 0.0, 0.3, generator=generator)
    return model


def on_meta(run):
    """run() with torch's default device `meta`, then without: the same result."""
    with torch.device("meta"):
        off = run()
    return off, run()


def decoded(model, ids, mask=None, **settings):
    """Each step's tokens, log-probabilities to 4 places (the thread count a step runs on
    moves their last bits), finished flags and draft figures."""
    config = GenerationConfig(max_new_tokens=12, seed=3, **settings)
    steps = list(generate(model, ids, config, mask))
    lists = [(t, [round(x, 4) for x in lp], f) for t, lp, f in (s.lists() for s in steps)]
    return lists, [s.drafts for s in steps]


@pytest.mark.parametrize("name", SETTINGS)
def test_no_loop_makes_a_tensor_off_the_models_device(make_model, name):
    model = varied(make_model)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    got, want = on_meta(lambda: decoded(model, ids, mask, **SETTINGS[name]))
    assert got == want


def test_grammar_beam_best_of_stops_and_top_logprobs_name_their_device(make_model, bpe_tokenizer):
    model = varied(make_model, vocab_size=V)
    ids = torch.tensor([bpe_tokenizer.encode("the cat")])
    grammar = Grammar.regex("(cat|dog|bird)s?", bpe_tokenizer)

    def run():
        constrained = decoded(model, ids, grammar=grammar, do_sample=True)
        beams = beam_search(model, ids, GenerationConfig(num_beams=3, max_new_tokens=6))
        best = model.generate(ids, max_new_tokens=6, do_sample=True, best_of=3, seed=1)
        config = GenerationConfig(max_new_tokens=10, do_sample=True, seed=2)
        stopped = complete(model, bpe_tokenizer, ["the cat", "a"], config, stop=("e",))
        slots = Slots(model, 2)
        rows = [slots.add([5, 6, 7], GenerationConfig(max_new_tokens=4), top_logprobs=3)]
        rows.append(slots.add([8, 9], GenerationConfig(max_new_tokens=4, do_sample=True), 0, 4))
        while not slots.idle():
            slots.step()
        return (
            constrained,
            beams.sequences.tolist(),
            best.tolist(),
            [c.text for c in stopped],
            [row.tokens for row in rows],
        )

    got, want = on_meta(run)
    assert got == want


def test_pick_device_decides_once_and_refuses_in_one_line(monkeypatch):
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="no CUDA device is available"):
        pick_device("cuda")
    with pytest.raises(DeviceError, match="auto, cpu, cuda or cuda:N"):
        pick_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("auto") == torch.device("cuda")
    assert pick_device("auto", "int8") == torch.device("cpu")  # int8's kernels: the CPU's
    assert pick_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="this machine has 1 GPU"):
        pick_device("cuda:1")


RUNS_A_MODEL = [
    "generate", "serve", "chat", "eval", "score", "classify", "ask", "summarize", "inspect",
    "audit", "lm-eval", "translate", "train", "demo",
]  # fmt: skip


@pytest.mark.parametrize("command", RUNS_A_MODEL)
def test_every_command_that_runs_a_model_takes_device(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--device" in capsys.readouterr().out


def test_a_command_names_its_device_first_and_refuses_one_it_lacks(
    make_model, tmp_path, capsys, monkeypatch
):
    from tlm.tokenizer import CharTokenizer

    run = save_run(tmp_path / "run", make_model(), CharTokenizer("abcdefgh"))
    generate = ["generate", str(run), "--prompt", "ab", "--max-new-tokens", "3"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a host without a GPU
    assert main(generate) == 0
    assert capsys.readouterr().err == ""  # the CPU goes without saying
    code = main([*generate, "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        "tlm: error: device cuda was asked for, but no CUDA device is available"
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, and the CPU chosen
    assert main([*generate, "--device", "cpu"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == "tlm generate: on cpu"
