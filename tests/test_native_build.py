"""Building tlm's C kernels (inference/native/): for this CPU or the build TLM_NATIVE_ARCH
names, once, from every file it is made of, with or without OpenMP or a compiler or a cache
folder, leaving the process's arithmetic alone. How the library is made, not what its
kernels compute (the kernel tests, which run once per build, hold those)."""

import fnmatch
import functools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
from test_native_step import needs_native

from tlm.inference import native


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
    shipped = project["tool"]["setuptools"]["package-data"]["tlm.inference.native"]
    for path in (*native.SOURCES, *native.HEADERS):
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in shipped), path.name


def fake_compiler(folder: Path) -> tuple[Path, Path]:
    """A C compiler that writes an empty file where -o says, and a line per call to a log:
    what `_compiled` decides (compile or not, and where) without a real compile's seconds."""
    log, script = folder / "compiler-calls", folder / "fake-cc"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> "{log}"\n'
        'while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n'
    )
    script.chmod(0o755)
    return script, log


def calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_changed_header_compiles_anew(tmp_path, monkeypatch):
    cc, log = fake_compiler(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("TLM_CACHE", str(tmp_path / "cache"))
    flags = [*native.FLAGS, "-march=native", "-fopenmp-simd"]
    first = len(native.SOURCES) + 1  # each source, then the link
    before = native._compiled(flags)
    assert calls(log) == first and before.is_file()
    assert native._compiled(flags) == before and calls(log) == first  # found: no compiler
    header = tmp_path / "attention_rows.h"  # the same headers, one of them one line longer
    header.write_text(native.HEADERS[0].read_text() + "/* changed */\n")
    monkeypatch.setattr(native, "HEADERS", [header, *native.HEADERS[1:]])
    native._compiled(flags)
    assert calls(log) == 2 * first  # compiled anew
    assert len(list((tmp_path / "cache" / "native").glob("step-*.so"))) == 2


def test_an_unusable_cache_folder_builds_in_the_temporary_one(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache path below a file cannot be made, even by root
    cc, log = fake_compiler(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("TLM_CACHE", str(blocker / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # gettempdir()'s answer
    built = native._compiled([*native.FLAGS, "-march=native", native.THREADS[0]])
    assert built.parent == tmp_path / "tmp" / f"tlm-{os.getuid()}" / "native"
    assert built.is_file() and calls(log) == len(native.SOURCES) + 1


FRESH_SCRIPT = """
import os, numpy as np, torch
from tlm import ModelConfig, TransformerLM
from tlm.inference import native

def openmp():  # how many OpenMP runtimes are loaded (None: no /proc to tell)
    if not os.path.exists("/proc/self/maps"):
        return None
    return len({l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l})

before = openmp()
assert native.library() is not None
torch.manual_seed(0)
model = TransformerLM(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4,
                                  context_length=16)).eval()
model.generate(torch.tensor([[1, 2]]), max_new_tokens=3)
print(before, openmp())
print(np.float32(1e-38) / np.float32(10), float(torch.tensor(1e-38) / 10) > 0)
"""


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory):
    """One new process that builds the library into an empty cache, loads it and decodes
    with it: what loading it did to a process (read by the two tests below)."""
    env = os.environ | {"TLM_CACHE": str(tmp_path_factory.mktemp("native-cache"))}
    command = [sys.executable, "-c", FRESH_SCRIPT]
    return subprocess.run(command, capture_output=True, text=True, env=env)


@needs_native
def test_attention_threads_are_torchs_own(fresh_process):
    """The library built with OpenMP uses the OpenMP runtime torch has loaded (one thread
    pool for both), not a second copy of it."""
    run = fresh_process
    assert run.returncode == 0, run.stderr
    before, after = run.stdout.splitlines()[0].split()
    if before == "None":
        pytest.skip("needs Linux's /proc to list the loaded libraries")
    if before == "0":
        pytest.skip("this torch runs without libgomp")
    assert before == after == "1"
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
    monkeypatch.setattr(native, "_checked", functools.cache(native._checked.__wrapped__))
    monkeypatch.setenv("TLM_NATIVE_ARCH", "haswell")
    with pytest.raises(native.NativeError, match="needs bmi2, which this CPU lacks"):
        native.library()


@needs_native
def test_a_compiler_without_openmp_still_builds_the_step(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TLM_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "THREADS", ("-fno-such-openmp-flag", *native.THREADS[1:]))
    monkeypatch.setattr(native, "_library", functools.cache(native._library.__wrapped__))
    lib = native.library()
    assert lib is not None and not lib.products_here() & 4  # built without OpenMP (`threaded`)
    assert capfd.readouterr().err == ""
    assert len(list(tmp_path.glob("native/step-*.so"))) == 1


@needs_native
def test_loading_the_c_step_leaves_the_processs_arithmetic_alone(fresh_process):
    """The library is built with -ffast-math's parts, not -ffast-math: gcc links that into a
    shared library with a loader that sets flush-to-zero for the whole process, and numpy's
    and torch's subnormal results became 0 after the first decoding step."""
    run = fresh_process
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[1].split() == ["1e-39", "True"], run.stdout


@pytest.mark.skipif(
    not native.BUILDS["alderlake"]
    or shutil.which(os.environ.get("CC", "cc")) is None
    or platform.machine() != "x86_64",
    reason="needs an x86 C compiler",
)
def test_the_avx_vnni_kernels_compile(tmp_path):
    """The int8 kernel of CPUs with AVX-VNNI but no AVX-512 (alderlake) runs on neither kind
    of host the suite meets; that it compiles is what can be checked here."""
    source = native.SOURCES[1]
    assert source.name == "products.c"
    command = [os.environ.get("CC", "cc"), *native.FLAGS, "-march=alderlake", "-fopenmp-simd"]
    run = subprocess.run(
        [*command, "-c", str(source), "-o", str(tmp_path / "products.o")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    code = subprocess.run(["objdump", "-d", str(tmp_path / "products.o")], capture_output=True)
    assert b"vpdpbusd" in code.stdout  # AVX-VNNI's product, not vpmaddubsw's
