"""The C step between a decoding step's products (inference/decoding/step.py, step.c) means what the
model's forward pass means: the same logits, the same keys and values in the cache."""

import pytest
import torch
from test_kv_cache import FORMAT_ERROR

from conftest import POSITIONS
from tlm.generate.sampling import greedy_logprob
from tlm.inference import Decoder, SlotCache, for_decoding, for_inference, native
from tlm.inference.decoding import program as whole_program
from tlm.inference.decoding import step as native_step
from tlm.inference.formats import blocked, q4
from tlm.model.kv_cache import KVCache

# each instruction set this host runs, at one thread and at two
pytestmark = pytest.mark.usefixtures("kernel_build", "each_thread_count")

needs_native = pytest.mark.skipif(
    native.library() is None, reason="no C compiler here: decoding runs the forward pass"
)


class Spy:
    """Counts the passes that took the C step."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        for name in ("run", "scratch_step"):  # a slot step's whole step takes the second
            monkeypatch.setattr(native_step, name, self.counted(getattr(native_step, name)))

    def counted(self, real):
        def counted(*args):
            self.calls += 1
            return real(*args)

        return counted


def forward_only(monkeypatch):
    """Decoding as it was before the C step: the model's forward pass every time."""
    monkeypatch.setattr(native, "library", lambda: None)


def stepped(model, ids, prefill: int, decoder: Decoder | None = None):
    """Logits [B,T-prefill,V] of decoding ids [B,T] one token at a time after a prefill, as
    a decoding loop steps (`Decoder.logits`), and the cache."""
    decoder = decoder or Decoder(model)
    cache = KVCache(model.config, len(ids))
    with torch.no_grad():
        model(ids[:, :prefill], cache)
    out = []
    for t in range(prefill, ids.shape[1]):
        out.append(decoder.logits(ids[:, t : t + 1], cache, None)[:, None])
    return torch.cat(out, 1), cache


def both(model, ids, prefill, monkeypatch):
    """(C step, forward pass) of the same decoding, and how many passes the C step took."""
    spy = Spy(monkeypatch)
    native_logits, native_cache = stepped(model, ids, prefill)
    with monkeypatch.context() as m:
        forward_only(m)
        forward_logits, forward_cache = stepped(model, ids, prefill)
    return (native_logits, native_cache), (forward_logits, forward_cache), spy.calls


@needs_native
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("qk_norm, bias", [(False, True), (True, False)])
def test_the_c_step_equals_the_forward_pass(make_model, monkeypatch, position, qk_norm, bias):
    model = for_decoding(make_model(position=position, qk_norm=qk_norm, bias=bias))
    ids = torch.randint(0, 97, (2, 20))
    (got, got_cache), (expected, cache), calls = both(model, ids, 5, monkeypatch)
    assert calls == 15  # every one-token pass took the C step
    assert torch.allclose(got, expected, atol=1e-5)
    n = cache.length
    assert got_cache.length == n == 20
    assert torch.allclose(got_cache.k[:, :, :, :n], cache.k[:, :, :, :n], atol=1e-6)
    assert torch.allclose(got_cache.v[:, :, :, :n], cache.v[:, :, :, :n], atol=1e-6)


@needs_native
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "relu2"])
def test_every_activation(make_model, monkeypatch, activation):
    model = for_decoding(make_model(activation=activation))
    for p in model.parameters():  # large enough that the activations reach both signs' tails
        torch.nn.init.normal_(p, std=0.3)
    (got, _), (expected, _), calls = both(model, torch.randint(0, 97, (1, 12)), 4, monkeypatch)
    assert calls == 8 and torch.allclose(got, expected, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", FORMAT_ERROR)
def test_every_format_steps_within_its_own_error(make_model, monkeypatch, dtype):
    model = make_model(position="learned", activation="gelu_tanh")
    for p in model.parameters():  # weights of the size a trained model has
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        exact = model(ids)[:, 6:].log_softmax(-1)
    packed = make_model(position="learned", activation="gelu_tanh")
    packed.load_state_dict(model.state_dict())
    packed = for_inference(packed, dtype)
    (got, _), (forward, _), calls = both(packed, ids, 6, monkeypatch)
    assert calls == 10
    low, high = FORMAT_ERROR[dtype]
    error = (got.log_softmax(-1) - exact).abs().max().item()
    assert low <= error < high
    if dtype in ("float32", "float16"):  # fp32 activations into the same kernels
        assert torch.allclose(got, forward, atol=1e-5)


@needs_native
def test_rows_at_their_own_lengths(make_model, monkeypatch):
    """A server's rows: slots 0 and 2 decode at lengths 7 and 3 while slot 1 sits idle."""
    model = for_decoding(make_model(position="rope"))
    prompts = {0: torch.randint(0, 97, (7,)), 2: torch.randint(0, 97, (3,))}
    nxt = torch.randint(0, 97, (4, 2))

    def run(direct: bool = False) -> tuple[torch.Tensor, SlotCache]:
        """Through the forward pass, or (direct) `Decoder.slot_step`, as `Slots` steps."""
        cache, out, decoder = SlotCache(model.config, 3, capacity=16), [], Decoder(model)
        for slot, prompt in prompts.items():
            with torch.no_grad():
                model(prompt[None], cache.feed([slot], [len(prompt)]))
        for tokens in nxt:
            if direct:
                logits, _ = decoder.slot_step(cache, [0, 2], tokens.tolist())
                out.append(logits.clone()[None])  # a view of the decoder's scratch
                continue
            with torch.no_grad():
                out.append(model(tokens[None], cache.feed([0, 2], [1, 1]), last_only=True))
        return torch.cat(out), cache

    spy = Spy(monkeypatch)
    got, got_cache = run()
    direct, direct_cache = run(direct=True)
    with monkeypatch.context() as m:
        forward_only(m)
        expected, cache = run()
    assert spy.calls == 4 and got.shape == direct.shape == (4, 2, 97)  # the direct steps
    for logits, store in ((got, got_cache), (direct, direct_cache)):
        assert torch.allclose(logits, expected, atol=1e-5)
        assert store.lengths == cache.lengths == [11, 0, 7]
        assert torch.allclose(store.k, cache.k, atol=1e-6)
        assert torch.allclose(store.v, cache.v, atol=1e-6)


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_steps_greedy_choices_are_the_logits_own(make_model, dtype):
    """The whole step's greedy choice per row is `greedy_logprob` of that row's logits."""
    if not (native.threaded() if dtype == "float32" else blocked.here(dtype)):
        pytest.skip(f"no whole step in C for {dtype} with this build ({native.kernels()})")
    model = for_inference(make_model(), dtype)
    cache = SlotCache(model.config, 3, capacity=16)
    for slot in range(3):
        with torch.no_grad():
            model(torch.randint(0, 97, (1, 2 + slot)), cache.feed([slot], [2 + slot]))
    decoder = Decoder(model)
    for _ in range(3):
        logits, picks = decoder.slot_step(cache, [0, 1, 2], [5, 6, 7], greedy=True)
        assert picks == [greedy_logprob(row) for row in logits]
        assert len({token for token, _ in picks}) > 1  # rows of their own, not one row thrice


@needs_native
def test_a_hooked_model_runs_the_forward_pass(make_model, monkeypatch):
    model = for_decoding(make_model())
    seen = []
    handle = model.blocks[1].attn.pattern.register_forward_hook(lambda m, i, o: seen.append(o))
    spy = Spy(monkeypatch)
    stepped(model, torch.randint(0, 97, (1, 8)), 4)
    assert spy.calls == 0 and len(seen) == 5  # the prefill and every step reached the hook
    handle.remove()
    decoder = Decoder(model)
    stepped(model, torch.randint(0, 97, (1, 8)), 4, decoder)
    assert spy.calls == 4
    handle = model.blocks[1].attn.pattern.register_forward_hook(lambda m, i, o: seen.append(o))
    stepped(model, torch.randint(0, 97, (1, 8)), 4, decoder)  # a hook added since: heard
    assert spy.calls == 4 and len(seen) == 10
    handle.remove()


@needs_native
def test_a_model_in_training_mode_keeps_its_dropout(make_model, monkeypatch):
    """Decoding a plain model left in training mode runs the forward pass, dropout and all."""
    model = make_model(dropout=0.5).train()
    spy = Spy(monkeypatch)
    torch.manual_seed(1)
    first = model.generate(torch.randint(0, 97, (1, 4)), max_new_tokens=6, do_sample=True)
    assert spy.calls == 0 and first.shape == (1, 10)
    model.eval()
    model.generate(torch.randint(0, 97, (1, 4)), max_new_tokens=6)
    assert spy.calls == 5


@needs_native
def test_the_c_step_keeps_the_cache_bounds(make_model):
    model = for_decoding(make_model(context_length=32))
    cache = KVCache(model.config, 1, capacity=4)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)), cache)
    with pytest.raises(ValueError, match="holds 4 positions"):
        Decoder(model).logits(torch.randint(0, 97, (1, 1)), cache, None)


WHOLE = [("float32", 1, "learned"), ("float32", 2, "rope"), ("float16", 1, "rope")]
WHOLE += [("float16", 3, "learned"), ("int8", 1, "learned"), ("int8", 2, "rope")]
WHOLE += [("float32 blocks", 4, "rope")]  # for_inference(model, "float32"): a copy in blocks
WHOLE += [("q4_0", 1, "learned"), ("q4_0", 3, "rope"), ("q4_k", 2, "rope"), ("q8_0", 2, "learned")]


@needs_native
@pytest.mark.parametrize("dtype, rows, position", WHOLE)
def test_the_whole_step_in_c_equals_the_loop(make_model, monkeypatch, dtype, rows, position):
    """Where every product has a C kernel, one call runs the step (products included); it
    computes what step.py's loop computes with the same kernels."""
    fmt = dtype.split()[0]
    ready = native.threaded() if dtype == "float32" else blocked.here(fmt)
    if not (q4.here() if fmt.startswith("q4") else ready):
        pytest.skip(f"no C kernels for {dtype} on this host")
    model = make_model(position=position, qk_norm=position == "rope", bias=True)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model = for_decoding(model) if dtype == "float32" else for_inference(model, fmt)
    lib, calls = native.library(), []
    real = lib.decode_step
    monkeypatch.setattr(lib, "decode_step", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, 97, (rows, 12))
    got, got_cache = stepped(model, ids, 4)
    assert len(calls) == 8
    with monkeypatch.context() as m:
        m.setattr(whole_program, "program", lambda *a: None)  # step.py's own loop
        expected, cache = stepped(model, ids, 4)
    assert len(calls) == 8
    assert torch.allclose(got, expected, atol=1e-5)
    n = cache.length  # the positions past it were never written
    assert got_cache.length == n == 12
    assert torch.allclose(got_cache.k[:, :, :, :n], cache.k[:, :, :, :n], atol=1e-6)
    assert torch.allclose(got_cache.v[:, :, :, :n], cache.v[:, :, :, :n], atol=1e-6)


@needs_native
def test_a_replaced_parameter_is_read_at_the_next_step(make_model):
    """An fp32 model decodes on its own parameters: one replaced by assignment (a new
    tensor, at a new address) is what the next step reads."""
    model = make_model()
    fast, ids = for_decoding(model), torch.randint(0, 97, (1, 6))
    decoder = Decoder(fast)  # one decoder throughout: its Program is made at the first step
    stepped(fast, ids, 3, decoder)  # the step described, at the parameters' addresses then
    for block in model.blocks:
        block.ffn.W_2.data = torch.randn_like(block.ffn.W_2) * 0.5
        block.ln2.gamma.data = torch.rand_like(block.ln2.gamma)
    stepped_logits, _ = stepped(fast, ids, 3, decoder)
    with torch.no_grad():
        assert torch.allclose(stepped_logits, model(ids)[:, 3:], atol=1e-5)
