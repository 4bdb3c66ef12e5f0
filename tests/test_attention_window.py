"""Sliding-window attention (model/window.py): each query sees at most W keys, in training
and in decoding, and every cache keeps a ring of W + SLACK positions however long the text.
Each path (written-out and fused attention, `KVCache`, `SlotCache`'s bands and ragged rows,
the C step, a draft's check and roll-back) is held to the forward pass over the whole text,
and the forward pass itself to the unwindowed model reading each window alone."""

import json

import pytest
import torch
from test_kv_cache import FORMAT_ERROR
from test_native_step import Spy, forward_only, needs_native

from conftest import save_run, tiny_config, written_out
from tlm import TransformerLM, load_model
from tlm.cli import main
from tlm.config import ConfigError
from tlm.generate import GenerationConfig, generate
from tlm.generate.slots import Slots
from tlm.inference import Decoder, SlotCache, for_decoding, for_inference
from tlm.model import window as window_module
from tlm.model.kv_cache import KVCache
from tlm.model.window import held, window_causal_mask, window_mask
from tlm.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("kernel_build")  # the C step on each instruction set

W, T = 6, 32  # the window; the context the model is made with


def windowed(make_model, window=W, **overrides):
    """A rotary model with an attention window and weights large enough that attention
    is far from uniform (so a key seen or not changes the output)."""
    model = make_model(**{"position": "rope", "attention_window": window, **overrides})
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


def without_window(model):
    twin = TransformerLM(model.config.replace(attention_window=None)).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def ids_of(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def whole(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.fixture(params=[3, 64], ids=["slack3", "slack64"])
def slack(request, monkeypatch):
    """The ring's entries past the window: tlm's 64, and 3, so that rings wrap every few
    steps and a pass of 4 tokens is the longest that writes before it reads."""
    monkeypatch.setattr(window_module, "SLACK", request.param)
    return request.param


def test_the_band_is_the_equation():
    mask = window_causal_mask(5, 9, 3)  # the last 5 of 9 positions query
    for t in range(5):
        for s in range(9):
            i = 4 + t
            assert bool(mask[t, s]) == (i - 3 < s <= i)
    keys = torch.tensor([4, 5, -1, 2, 3])  # a ring's positions; -1: never written
    assert window_mask(torch.tensor([5]), keys, 3).tolist() == [[True, True, False, False, True]]
    assert held(7, 5).tolist() == [5, 6, 2, 3, 4] and held(2, 4).tolist() == [0, 1, -1, -1]


def test_an_attention_window_needs_positions_without_a_table():
    for position in ("learned", "sinusoidal"):
        with pytest.raises(ConfigError, match="rope or none"):
            tiny_config(position=position, attention_window=8)
    with pytest.raises(ConfigError, match="attention_window must be a positive"):
        tiny_config(position="rope", attention_window=0)


@pytest.mark.parametrize("position", ["rope", "none"])
def test_one_layer_reads_its_window_as_the_unwindowed_model_reads_it_alone(make_model, position):
    """The oracle: a one-layer windowed model's logits at i are the unwindowed model's at
    the end of ids[i-W+1 : i+1] read alone (rotary scores depend on distances only)."""
    model = windowed(make_model, n_layers=1, position=position)
    ids = ids_of(T)
    got, plain = whole(model, ids), without_window(model)
    for i in range(T):
        alone = whole(plain, ids[:, max(0, i - W + 1) : i + 1])[:, -1]
        assert torch.allclose(got[:, i], alone, atol=1e-4), i
    assert not torch.allclose(got, whole(plain, ids), atol=1e-2)  # the window matters
    with torch.no_grad():  # the written-out attention (eq. 9.11-9.13) agrees with the fused
        assert torch.allclose(written_out(model)(ids), got, atol=1e-5)


def test_a_window_that_covers_the_text_changes_nothing(make_model):
    model = windowed(make_model, window=T)
    ids = ids_of(T)
    assert torch.equal(whole(model, ids), whole(without_window(model), ids))


def test_information_travels_one_window_per_layer(make_model):
    """Two layers of window W: position i reads tokens back to i - 2(W-1), no further."""
    model, ids, i = windowed(make_model), ids_of(T), T - 1
    reach = i - 2 * (W - 1)
    base = whole(model, ids)[0, i]
    beyond, inside = ids.clone(), ids.clone()
    beyond[0, reach - 1] = (ids[0, reach - 1] + 1) % 97
    inside[0, reach] = (ids[0, reach] + 1) % 97
    assert torch.allclose(whole(model, beyond)[0, i], base, atol=1e-6)
    assert not torch.allclose(whole(model, inside)[0, i], base, atol=1e-4)


@pytest.mark.parametrize("chunks", [[150], [40, 1, 1, 30, 5, 73], [1] * 150, [3] * 50, [100, 50]])
def test_the_kv_cache_ring_is_the_whole_forward_pass(make_model, slack, chunks):
    """Fed in pieces far past the context and the ring (W + SLACK entries), the cache gives
    the logits of the whole text read at once, and never grows."""
    model = windowed(make_model)
    ids = ids_of(150, batch=2)
    cache, out, at = KVCache(model.config, 2), [], 0
    with torch.no_grad():
        for n in chunks:
            out.append(model(ids[:, at : at + n], cache))
            at += n
    assert cache.k.shape[3] == W + slack and cache.length == 150
    assert torch.allclose(torch.cat(out, 1), whole(model, ids), atol=1e-5)


def test_left_padded_rows_in_a_ring(make_model, slack):
    """`model.generate` on a left-padded batch (`DecodeState` with a mask) decodes each row
    as it decodes alone without a cache."""
    model = windowed(make_model)
    a, b = ids_of(9)[0], ids_of(4, seed=2)[0]
    batch = torch.stack([a, torch.cat([torch.zeros(5, dtype=torch.long), b])])
    mask = torch.tensor([[1] * 9, [0] * 5 + [1] * 4])
    got = model.generate(batch, max_new_tokens=80, attention_mask=mask, num_beams=2)
    for row, prompt in enumerate((a, b)):
        alone = model.generate(prompt[None], max_new_tokens=80, num_beams=2, use_cache=False)
        assert got[row, -80:].tolist() == alone[0, -80:].tolist()


def run_slots(model, prompts: list[torch.Tensor], new: int) -> list:
    """A server's rows: three prompts joining at different steps, so rows decode at their
    own lengths (`Ragged`) beside a prompt's prefill (`Band`)."""
    slots, config = Slots(model, 3), GenerationConfig(max_new_tokens=new)
    sequences = [slots.add(prompts[0].tolist(), config), slots.add(prompts[1].tolist(), config)]
    for _ in range(7):
        slots.step()
    sequences.append(slots.add(prompts[2].tolist(), config))
    while not slots.idle():
        slots.step()
    assert slots.cache.k.shape[3] == W + window_module.SLACK
    return sequences


def plain_tokens(model, prompt, new: int) -> tuple[list[int], torch.Tensor]:
    config = GenerationConfig(max_new_tokens=new, use_cache=False)
    steps = list(generate(model, prompt[None], config))
    return [s.tokens.item() for s in steps], torch.cat([s.logprobs for s in steps])


@pytest.mark.parametrize("c_step", [True, False])
def test_slot_rows_decode_as_the_whole_text_is_read(make_model, monkeypatch, slack, c_step):
    model = for_decoding(windowed(make_model))
    prompts = [ids_of(5)[0], ids_of(40, seed=2)[0], ids_of(23, seed=3)[0]]
    if not c_step:
        forward_only(monkeypatch)
    spy = Spy(monkeypatch)
    sequences = run_slots(model, prompts, 100)
    assert (spy.calls > 100) == c_step  # the decoding steps took the C step, or none did
    for sequence, prompt in zip(sequences, prompts, strict=True):
        tokens, logprobs = plain_tokens(model, prompt, 100)
        assert sequence.tokens == tokens
        assert torch.allclose(torch.tensor(sequence.logprobs), logprobs, atol=1e-4)


@needs_native
@pytest.mark.parametrize("fmt", ["float32", "float16", "int8"])
@pytest.mark.parametrize("whole_step", [True, False])
def test_the_c_step_reads_the_ring_past_its_tables(make_model, monkeypatch, slack, whole_step, fmt):
    """One token per step from position 5 to 120: the C step (the whole step in C, or
    step.py's loop between the products; each weight format) writes each key at its entry
    of the ring, reads the window, and rotates positions past the rotary tables (32) as
    `rotary_tables` does."""
    from tlm.inference.decoding import program

    exact = windowed(make_model, qk_norm=True)
    model = windowed(make_model, qk_norm=True)
    model = for_decoding(model) if fmt == "float32" else for_inference(model, fmt)
    if not whole_step:
        monkeypatch.setattr(program, "program", lambda *a: None)
    ids, spy = ids_of(120, batch=2), Spy(monkeypatch)
    cache, decoder, out = KVCache(model.config, 2), Decoder(model), []
    with torch.no_grad():
        model(ids[:, :5], cache)
        for t in range(5, 120):
            out.append(decoder.logits(ids[:, t : t + 1], cache, None))
    assert spy.calls == 115
    if fmt == "int8":  # activations rounded to 8 bits: within the format's own error
        error = torch.stack(out, 1).log_softmax(-1) - whole(exact, ids)[:, 5:].log_softmax(-1)
        assert error.abs().max() < FORMAT_ERROR["int8"][1]
    else:
        assert torch.allclose(torch.stack(out, 1), whole(model, ids)[:, 5:], atol=1e-4)


@needs_native
@pytest.mark.parametrize("c_step", [True, False])
def test_checks_and_roll_backs_in_a_ring(make_model, monkeypatch, c_step):
    """With SLACK 3, drafts of up to 3 tokens (checks of 4) are checked at a wrapped ring
    and rolled back, and the row then decodes as if they never were; going back further
    than SLACK is refused."""
    monkeypatch.setattr(window_module, "SLACK", 3)
    model = for_decoding(windowed(make_model))
    if not c_step:
        forward_only(monkeypatch)
    ids = ids_of(60)[0]
    expected = whole(model, ids[None])[0]
    cache, decoder = SlotCache(model.config, 1), Decoder(model)
    with torch.no_grad():
        model(ids[None, :30], cache.feed([0], [30]))
    at = 30
    for k in (4, 1, 3, 2, 4):
        draft = torch.randint(0, 97, (k,)).tolist()
        draft[0] = ids[at].item()  # the next real token, then a wrong draft
        logits, _ = decoder.check(cache, 0, draft)
        assert torch.allclose(logits[0], expected[at], atol=1e-4)
        cache.truncate(0, at + 1)  # keep the real token only
        at += 1
    logits, _ = decoder.check(cache, 0, ids[at : at + 4].tolist())
    assert torch.allclose(logits, expected[at : at + 4], atol=1e-4)
    with pytest.raises(ValueError, match="goes back at most 3"):
        cache.truncate(0, at)


def test_prompt_lookup_in_a_ring_gives_the_plain_tokens(make_model):
    model = windowed(make_model)
    prompt = ids_of(12)[0].repeat(4)  # repeats: lookup finds drafts
    config = GenerationConfig(max_new_tokens=150, prompt_lookup=3)
    steps = list(generate(model, prompt[None], config))
    got = [t for s in steps for t in s.tokens.tolist()]
    assert got == plain_tokens(model, prompt, 150)[0]
    assert steps[-1].drafts[0][0] > 0  # it drafted


def test_memory_stays_flat_however_long_the_generation(make_model, monkeypatch):
    """Generating 4T, 8T or 16T tokens, the cache is the same W + SLACK entries per row
    (a shorter text gets a ring of its own length)."""
    model, sizes = windowed(make_model), []
    real = SlotCache.__init__

    def recorded(self, *args, **kwargs):
        real(self, *args, **kwargs)
        sizes.append(self.k.numel() + self.v.numel())

    monkeypatch.setattr(SlotCache, "__init__", recorded)
    for new in (4 * T, 8 * T, 16 * T):
        list(generate(model, ids_of(4), GenerationConfig(max_new_tokens=new)))
    assert sizes == [2 * 2 * 4 * (W + 64) * 16] * 3  # K, V; L, H, entries, d_head
    sizes.clear()
    plain = without_window(model)  # without a window the cache grows to the context
    list(generate(plain, ids_of(4), GenerationConfig(max_new_tokens=T - 4)))
    assert sizes[0] == 2 * 2 * 4 * T * 16


def test_commands_train_generate_and_refuse_export(tmp_path, docs_chars, capsys):
    chars = load_tokenizer(docs_chars)
    flags = ["--data", str(docs_chars), "--device", "cpu", "--max-steps", "2", "--batch-size", "2"]
    shape = ["--position", "rope", "--context-length", "32", "--n-layers", "1", "--d-model", "32"]
    run = tmp_path / "run"
    assert main(["train", *flags, *shape, "--attention-window", "8", "--out", str(run)]) == 0
    assert load_model(run).config.attention_window == 8
    capsys.readouterr()
    prompt = "a" * 100  # longer than the context: a windowed model reads it all
    command = ["generate", str(run), "--prompt", prompt, "--max-new-tokens", "300", "--json"]
    assert main([*command, "--no-eos"]) == 0
    out = json.loads(capsys.readouterr().out)["completions"][0]
    assert len(out["tokens"]) == 300
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 2
    assert "attention_window=8: GPT-NeoX attends to every earlier position" in (
        capsys.readouterr().err
    )
    torch.manual_seed(0)  # a window given at load, to a rotary model trained without one
    plain = load_model(run).config.replace(attention_window=None)
    save_run(tmp_path / "plain", TransformerLM(plain), chars)
    assert load_model(tmp_path / "plain", attention_window=4).config.attention_window == 4
    long = ["generate", str(tmp_path / "plain"), "--prompt", prompt, "--max-new-tokens", "2"]
    assert main(long) == 2  # the context refuses the prompt...
    assert main([*long, "--attention-window", "4"]) == 0  # ...a window reads it
    assert main([*long, "--attention-window", "0"]) == 2
