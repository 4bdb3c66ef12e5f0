"""Rotary positions past the trained context (model/positions.py): linear, NTK, dynamic NTK
and YaRN, each held to its equation, to `transformers`' frequencies and logits at 4x the
trained context, applied at load and kept through a GPT-NeoX round trip."""

import json
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import V, save_run, tiny_config
from tlm import TransformerLM, load_model
from tlm.cli import main
from tlm.config import ConfigError
from tlm.inference import Decoder, SlotCache
from tlm.model.positions import Rotary, rotary_frequencies, rotary_tables

T, S = 32, 4  # the trained context, the factor: read at 128 positions


def rotary(**overrides):
    return tiny_config(**{"vocab_size": V, "position": "rope", "context_length": T, **overrides})


def unscaled_theta(config):
    d = config.d_head
    return config.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def test_linear_reads_position_m_as_m_over_s():
    config = rotary().stretched("linear", S)
    assert config.context_length == S * T and config.rope_original_context == T
    scaled = rotary_tables(config, torch.arange(0, S * T, S))  # positions 0, s, 2s, ...
    plain = rotary_tables(rotary(), torch.arange(T))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(scaled, plain, strict=True))


def test_ntk_keeps_the_fastest_pair_and_slows_the_slowest_by_s():
    config = rotary().stretched("ntk", S)
    theta, factor = rotary_frequencies(config)
    plain = unscaled_theta(config)
    assert factor == 1.0 and theta[0] == plain[0]
    assert torch.isclose(theta[-1], plain[-1] / S, rtol=1e-12)
    assert (theta[1:] < plain[1:]).all()  # every other pair turns slower


def test_dynamic_is_the_model_within_t_and_ntk_of_the_length_past_it():
    config = rotary().stretched("dynamic", S)
    assert torch.equal(rotary_frequencies(config, T)[0], unscaled_theta(config))
    L, d = 3 * T, config.d_head
    ntk = config.replace(rope_scaling="ntk", rope_factor=S * L / T - (S - 1))
    assert torch.allclose(rotary_frequencies(config, L)[0], rotary_frequencies(ntk)[0])
    module, q = Rotary(config), torch.randn(1, 2, L, d)
    tables = rotary_tables(ntk, torch.arange(L))  # angles of the pass's length
    x1, x2 = q.chunk(2, dim=-1)
    expected = torch.cat((x1 * tables[0] - x2 * tables[1], x1 * tables[1] + x2 * tables[0]), -1)
    assert torch.allclose(module(q, torch.arange(L)), expected, atol=1e-5)
    assert torch.equal(
        module(q[..., :T, :], torch.arange(T)), Rotary(rotary())(q[..., :T, :], torch.arange(T))
    )


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_scales_the_logits():
    trained = 2048  # long enough for the fastest pairs to turn more than 32 times
    shape = {"d_model": 128, "n_heads": 2, "context_length": trained}  # d_head 64: 32 pairs
    config = tiny_config(position="rope", **shape).stretched("yarn", S)
    theta, factor = rotary_frequencies(config)
    plain = unscaled_theta(config)
    turns = trained * plain / (2 * math.pi)  # each pair's rotations over the trained context
    fast, slow = turns > 32 * 1.5, turns < 1 / 1.5  # clear of the rounded ramp ends
    assert fast.any() and slow.any()
    assert torch.allclose(theta[fast], plain[fast]) and torch.allclose(theta[slow], plain[slow] / S)
    between = ~fast & ~slow
    assert ((theta[between] <= plain[between]) & (theta[between] >= plain[between] / S)).all()
    assert factor == pytest.approx(0.1 * math.log(S) + 1)
    cos, sin = rotary_tables(config, torch.arange(10))
    assert torch.allclose(cos**2 + sin**2, torch.full_like(cos, factor**2))  # q·k times t⁻¹


@pytest.mark.parametrize("method", ["linear", "dynamic", "yarn"])
def test_frequencies_equal_transformers(method):
    config = rotary(rope_base=500.0).stretched(method, S)
    parameters = {"rope_type": method, "rope_theta": 500.0, "factor": float(S)}
    positions = T if method == "dynamic" else S * T
    if method == "yarn":
        parameters["original_max_position_embeddings"] = T
    hf = transformers.GPTNeoXConfig(
        hidden_size=config.d_model, num_attention_heads=config.n_heads, rotary_pct=1.0,
        max_position_embeddings=positions, rope_parameters=parameters,
    )  # fmt: skip
    length = 3 * T if method == "dynamic" else None
    theirs, their_factor = ROPE_INIT_FUNCTIONS[method](hf, "cpu", length)
    ours, factor = rotary_frequencies(config, length)
    assert torch.allclose(ours.float(), theirs, rtol=1e-6) and factor == pytest.approx(their_factor)


def scaled_run(folder, bpe_tokenizer, method):
    """A random rotary model trained (notionally) at T, saved, and read at S·T with method."""
    torch.manual_seed(1)
    model = TransformerLM(rotary(rope_base=500.0))
    save_run(folder, model, bpe_tokenizer)
    return load_model(folder, rope_scaling=method, rope_factor=S)


@pytest.mark.parametrize("method", ["linear", "ntk", "dynamic", "yarn"])
def test_a_scaled_model_exports_to_gptneox_with_equal_logits_at_4t(tmp_path, bpe_tokenizer, method):
    model = scaled_run(tmp_path / "run", bpe_tokenizer, method)
    assert model.config.context_length == S * T
    from tlm.kinds import export_hf

    export_hf(model, bpe_tokenizer, tmp_path / "hf")
    hf = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, V, (2, S * T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0)
    back = load_model(tmp_path / "hf")  # the directory's rope_parameters are honoured
    fields = ("context_length", "rope_scaling", "rope_factor", "rope_original_context")
    if method == "ntk":  # written as the default rotation at the raised base
        assert back.config.rope_scaling is None and back.config.context_length == S * T
    else:
        assert [getattr(back.config, f) for f in fields] == [
            getattr(model.config, f) for f in fields
        ]
    with torch.no_grad():
        assert torch.allclose(back(ids), ours, atol=1e-5, rtol=0)


def test_the_c_step_reads_the_scaled_tables(tmp_path, bpe_tokenizer):
    """A YaRN model's decoding step in C equals its forward pass past T; dynamic NTK, whose
    angles change with the length, takes the forward pass."""
    model = scaled_run(tmp_path / "run", bpe_tokenizer, "yarn")
    ids = torch.randint(0, V, (1, 3 * T), generator=torch.Generator().manual_seed(2))
    decoder, cache = Decoder(model), SlotCache(model.config, 1, S * T)
    assert decoder.can_step(cache.k)
    logits, _ = decoder.check(cache, 0, ids[0].tolist())
    with torch.no_grad():
        assert torch.allclose(logits, model(ids)[0], atol=1e-4, rtol=0)
    dynamic = load_model(tmp_path / "run", rope_scaling="dynamic", rope_factor=S)
    assert not Decoder(dynamic).can_step(SlotCache(dynamic.config, 1, S * T).k)


def test_what_cannot_be_scaled_or_written_is_refused(tmp_path, bpe_tokenizer, capsys):
    with pytest.raises(ConfigError, match="rope_scaling applies to rotary positions"):
        tiny_config(rope_scaling="yarn", rope_factor=2.0)
    with pytest.raises(ConfigError, match="rope_factor must be >= 1"):
        rotary(rope_scaling="linear", rope_factor=0.5)
    torch.manual_seed(0)
    save_run(tmp_path / "learned", TransformerLM(tiny_config(vocab_size=V)), bpe_tokenizer)
    with pytest.raises(ConfigError, match="rope scaling applies to rotary positions"):
        load_model(tmp_path / "learned", rope_scaling="linear", rope_factor=2.0)
    save_run(tmp_path / "dyn", TransformerLM(rotary().stretched("dynamic", S)), bpe_tokenizer)
    saved = json.loads((tmp_path / "dyn" / "config.json").read_text())["model"]
    assert (saved["rope_scaling"], saved["rope_original_context"]) == ("dynamic", T)
    assert main(["export-gguf", str(tmp_path / "dyn"), str(tmp_path / "m.gguf")]) == 2
    assert "llama.cpp has no dynamic NTK" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_a_scaled_model_keeps_its_scaling_through_gguf(tmp_path, bpe_tokenizer, method):
    """export-gguf writes linear and yarn to `gptneox.rope.scaling.*` (type, factor,
    original_context_length, yarn_beta_*), ntk to a raised rope.freq_base; reading the file
    gives the same model at 4T."""
    import gguf

    model = scaled_run(tmp_path / "run", bpe_tokenizer, method)
    flags = ["--rope-scaling", method, "--rope-factor", str(S)]
    assert main(["export-gguf", str(tmp_path / "run"), str(tmp_path / "m.gguf"), *flags]) == 0
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    written = fields.get("gptneox.rope.scaling.type")
    if method == "ntk":
        assert written is None
    else:
        assert bytes(written.parts[written.data[0]]).decode() == method
    back = load_model(tmp_path / "m.gguf")
    assert back.config.context_length == S * T
    if method != "ntk":
        fields = ("rope_scaling", "rope_factor", "rope_original_context", "yarn_beta_fast")
        assert [getattr(back.config, f) for f in fields] == [
            getattr(model.config, f) for f in fields
        ]
    ids = torch.randint(0, V, (1, S * T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(back(ids), model(ids), atol=1e-4, rtol=0)


def test_every_command_that_reads_a_model_takes_the_scaling(tmp_path, bpe_tokenizer, capsys):
    """`tlm generate` past the trained context with --rope-scaling, the same text as the
    Python reading; `tlm export-hf` writes the scaling; a factor alone is refused."""
    model = scaled_run(tmp_path / "run", bpe_tokenizer, "yarn")
    prompt = bpe_tokenizer.decode(list(range(60, 60 + 2 * T)))  # twice the trained context
    flags = ["--rope-scaling", "yarn", "--rope-factor", str(S)]
    command = ["generate", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "8"]
    assert main([*command, "--no-eos", "--json", *flags]) == 0
    (completion,) = json.loads(capsys.readouterr().out)["completions"]
    ids = bpe_tokenizer.encode(prompt)
    assert len(ids) > T
    expected = model.generate(torch.tensor([ids]), max_new_tokens=8)[0, len(ids) :].tolist()
    assert completion["tokens"] == expected
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf"), *flags]) == 0
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == "yarn"
    assert written["rope_parameters"]["original_max_position_embeddings"] == T
    assert main([*command, "--rope-factor", "4"]) == 2
    assert "--rope-scaling and --rope-factor go together" in capsys.readouterr().err


def test_eval_reads_a_model_with_a_longer_context(tmp_path, docs_chars, capsys):
    """`tlm eval --context N` scores windows of N tokens, past the trained context with or
    without a scaling; learned positions end where they were trained: one line."""
    from tlm import load_tokenizer

    chars = load_tokenizer(docs_chars)
    torch.manual_seed(0)
    save_run(tmp_path / "rope", TransformerLM(rotary(vocab_size=chars.vocab_size)), chars)
    losses = []
    for flags in ([], ["--context", "64"], ["--context", "128", *YARN]):
        command = ["eval", str(tmp_path / "rope"), "--data", str(docs_chars), "--json"]
        assert main([*command, "--batch-size", "4", *flags]) == 0
        losses.append(json.loads(capsys.readouterr().out)["loss"])
    assert len(set(losses)) == 3 and all(math.isfinite(x) for x in losses)
    assert load_model(tmp_path / "rope", context_length=64).config.context_length == 64
    save_run(tmp_path / "learned", TransformerLM(tiny_config(vocab_size=chars.vocab_size)), chars)
    command = ["eval", str(tmp_path / "learned"), "--data", str(docs_chars), "--context", "64"]
    assert main(command) == 2
    assert "learned positions end at 32" in capsys.readouterr().err


YARN = ["--rope-scaling", "yarn", "--rope-factor", str(S)]


def test_a_rotary_run_fine_tunes_at_a_longer_context(tmp_path, docs_chars, capsys):
    """`tlm train --init-from BASE --context-length 4T --rope-scaling yarn --rope-factor 4`:
    the trained context is read as 4T / 4 = T, the weights are BASE's; a model with learned
    positions cannot grow its context: one line."""
    from tlm import load_tokenizer

    chars = load_tokenizer(docs_chars)
    torch.manual_seed(0)
    save_run(tmp_path / "base", TransformerLM(rotary(vocab_size=chars.vocab_size)), chars)
    longer = ["--context-length", str(S * T), "--max-steps", "2", "--batch-size", "2"]
    flags = ["--data", str(docs_chars), "--device", "cpu", *longer, "--eval-interval", "2"]
    command = ["train", "--init-from", str(tmp_path / "base"), *flags]
    assert main([*command, *YARN, "--out", str(tmp_path / "ft")]) == 0
    tuned = load_model(tmp_path / "ft").config
    assert (tuned.context_length, tuned.rope_scaling, tuned.rope_original_context) == (
        S * T,
        "yarn",
        T,
    )
    save_run(tmp_path / "learned", TransformerLM(tiny_config(vocab_size=chars.vocab_size)), chars)
    command[2] = str(tmp_path / "learned")
    assert main([*command, "--out", str(tmp_path / "ft2")]) == 2
    assert "context_length: 32 there, 128 given" in capsys.readouterr().err
