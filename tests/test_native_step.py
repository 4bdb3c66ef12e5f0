"""The C step between a decoding step's products (inference/step.py, step.c) means what the
model's forward pass means: the same logits, the same keys and values in the cache."""

import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from test_kv_cache import FORMAT_ERROR

from conftest import POSITIONS
from tlm.generate.sampling import greedy_logprob
from tlm.inference import SlotCache, blocked, decoding_step, for_decoding, for_inference, native
from tlm.inference import program as whole_program
from tlm.inference import step as native_step
from tlm.model.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("kernel_build")  # each instruction set this host runs

needs_native = pytest.mark.skipif(
    native.library() is None, reason="no C compiler here: decoding runs the forward pass"
)


class Spy:
    """Counts the passes that took the C step."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        for name in ("run", "_scratch_step"):  # slot_step's whole step takes the second
            monkeypatch.setattr(native_step, name, self.counted(getattr(native_step, name)))

    def counted(self, real):
        def counted(*args):
            self.calls += 1
            return real(*args)

        return counted


def forward_only(monkeypatch):
    """Decoding as it was before the C step: the model's forward pass every time."""
    monkeypatch.setattr(native, "library", lambda: None)


def stepped(model, ids, prefill: int, rows: int | None = None) -> tuple[torch.Tensor, KVCache]:
    """Logits [B,T-prefill,V] of decoding ids [B,T] one token at a time after a prefill."""
    cache = KVCache(model.config, len(ids))
    with torch.no_grad():
        model(ids[:, :prefill], cache)
    out = []
    for t in range(prefill, ids.shape[1]):
        with decoding_step(model, len(ids)):
            out.append(model(ids[:, t : t + 1], cache, last_only=True))
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
        """Through the forward pass, or (direct) `slot_step`, as `Slots` steps."""
        cache, out = SlotCache(model.config, 3, capacity=16), []
        for slot, prompt in prompts.items():
            with torch.no_grad():
                model(prompt[None], cache.feed([slot], [len(prompt)]))
        for tokens in nxt:
            if direct:
                logits, _ = native_step.slot_step(model, cache, [0, 2], tokens.tolist())
                out.append(logits.clone()[None])  # a view of the cache's scratch
                continue
            with decoding_step(model, 2):
                out.append(model(tokens[None], cache.feed([0, 2], [1, 1]), last_only=True))
        return torch.cat(out), cache

    spy = Spy(monkeypatch)
    got, got_cache = run()
    direct, direct_cache = run(direct=True)
    with monkeypatch.context() as m:
        forward_only(m)
        expected, cache = run()
    assert spy.calls == 8 and got.shape == direct.shape == (4, 2, 97)
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
    for _ in range(3):
        logits, picks = native_step.slot_step(model, cache, [0, 1, 2], [5, 6, 7], greedy=True)
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
    stepped(model, torch.randint(0, 97, (1, 8)), 4)
    assert spy.calls == 4


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
    with pytest.raises(ValueError, match="holds 4 positions"), decoding_step(model, 1):
        model(torch.randint(0, 97, (1, 1)), cache, last_only=True)


def test_a_compiler_here_builds_the_step():
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on this machine")
    assert native.library() is not None


def test_without_a_compiler_decoding_says_so_once_and_goes_on(tmp_path):
    script = (
        "import torch; from tlm import ModelConfig, TransformerLM; torch.manual_seed(0);"
        "m = TransformerLM(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2,"
        " context_length=16)).eval();"
        "print(m.generate(torch.tensor([[1, 2]]), max_new_tokens=4).shape);"
        "print(m.generate(torch.tensor([[3]]), max_new_tokens=2).shape)"
    )
    env = os.environ | {"CC": "no-such-compiler", "TLM_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["torch.Size([1,", "6])", "torch.Size([1,", "3])"]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tlm: running without its C kernels (")


def test_every_file_the_library_is_compiled_from_ships_with_the_package():
    """An installed (not editable) tlm compiles from its package's own copies."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    shipped = project["tool"]["setuptools"]["package-data"]["tlm.inference"]
    for path in (*native.SOURCES, *native.HEADERS):
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in shipped), path.name


@needs_native
def test_a_changed_header_compiles_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("TLM_CACHE", str(tmp_path))
    flags = [*native.FLAGS, "-march=native", "-fopenmp-simd"]
    before = native._compiled(flags)
    header = tmp_path / "attention_rows.h"
    header.write_text(native.HEADERS[0].read_text() + "/* changed */\n")
    monkeypatch.setattr(native, "HEADERS", [header])
    assert native._compiled(flags) != before


@needs_native
def test_an_unusable_cache_folder_builds_in_the_temporary_one(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache path below a file cannot be made, even by root
    script = "from tlm.inference import native; print(native.library() is not None)"
    env = os.environ | {"TLM_CACHE": str(blocker / "cache"), "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.stdout.strip() == "True", run.stderr
    assert list(tmp_path.glob("tlm-*/native/step-*.so"))


GOMP_SCRIPT = """
import torch
from tlm import ModelConfig, TransformerLM
from tlm.inference import native

def openmp():
    return sorted({l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l})

before = openmp()
assert native.library() is not None
torch.manual_seed(0)
model = TransformerLM(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4,
                                  context_length=16)).eval()
model.generate(torch.tensor([[1, 2]]), max_new_tokens=3)
print(len(before), len(openmp()))
"""


@needs_native
def test_attention_threads_are_torchs_own(tmp_path):
    """The library built with OpenMP uses the OpenMP runtime torch has loaded (one thread
    pool for both), not a second copy of it."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs Linux's /proc to list the loaded libraries")
    env = os.environ | {"TLM_CACHE": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", GOMP_SCRIPT], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    before, after = map(int, run.stdout.split())
    if before == 0:
        pytest.skip("this torch runs without libgomp")
    assert before == after == 1
    assert not run.stderr


@needs_native
def test_each_build_this_host_runs_has_its_own_instruction_set(monkeypatch):
    """`builds_here` names different kernels (an AVX-512 host: its own and haswell's AVX2
    ones, both tested by every kernel test); a build tlm does not make, or one this CPU
    cannot run, is refused in one line."""
    builds = native.builds_here()
    seen = {}
    for build in builds:
        monkeypatch.setenv("TLM_NATIVE_ARCH", build)
        seen[build] = native.kernels()
    assert len(set(seen.values())) == len(builds) and "none" not in seen.values()
    if "haswell" in builds:
        assert seen["haswell"] == "AVX2+FMA+F16C"
    monkeypatch.setenv("TLM_NATIVE_ARCH", "pentium4")
    with pytest.raises(native.NativeError, match="^TLM_NATIVE_ARCH=pentium4: tlm builds native"):
        native.library()
    monkeypatch.setattr(native, "_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv("TLM_NATIVE_ARCH", "haswell")
    with pytest.raises(native.NativeError, match="needs bmi2, which this CPU lacks"):
        native.library()


@needs_native
def test_a_compiler_without_openmp_still_builds_the_step(tmp_path):
    script = (
        "from tlm.inference import native; native.THREADS = ('-fno-such-openmp-flag',"
        " *native.THREADS[1:]); print(native.library() is not None)"
    )
    env = os.environ | {"TLM_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.stdout.strip() == "True" and not run.stderr, run.stderr
    assert len(list(tmp_path.glob("native/step-*.so"))) == 1


WHOLE = [("float32", 1, "learned"), ("float32", 2, "rope"), ("float16", 1, "rope")]
WHOLE += [("float16", 3, "learned"), ("int8", 1, "learned"), ("int8", 2, "rope")]
WHOLE += [("float32 blocks", 4, "rope")]  # for_inference(model, "float32"): a copy in blocks


@needs_native
@pytest.mark.parametrize("dtype, rows, position", WHOLE)
def test_the_whole_step_in_c_equals_the_loop(make_model, monkeypatch, dtype, rows, position):
    """Where every product has a C kernel, one call runs the step (products included); it
    computes what step.py's loop computes with the same kernels."""
    fmt = dtype.split()[0]
    ready = native.threaded() if dtype == "float32" else blocked.here(fmt)
    if not ready:
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
    stepped(fast, ids, 3)  # the step described, at the parameters' addresses then
    for block in model.blocks:
        block.ffn.W_2.data = torch.randn_like(block.ffn.W_2) * 0.5
        block.ln2.gamma.data = torch.rand_like(block.ln2.gamma)
    stepped_logits, _ = stepped(fast, ids, 3)
    with torch.no_grad():
        assert torch.allclose(stepped_logits, model(ids)[:, 3:], atol=1e-5)


@needs_native
def test_loading_the_c_step_leaves_the_processs_arithmetic_alone():
    """The library is built with -ffast-math's parts, not -ffast-math: gcc links that into a
    shared library with a loader that sets flush-to-zero for the whole process, and numpy's
    and torch's subnormal results became 0 after the first decoding step."""
    code = (
        "import numpy as np, torch; from tlm.inference import native; "
        "assert native.library() is not None; "
        "print(np.float32(1e-38) / np.float32(10), float(torch.tensor(1e-38) / 10) > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1e-39", "True"], out.stdout
