"""`step.c`, `products.c`, `q4.c`, `attention.c` and `attention32.c`, compiled for this machine
at first use, called through ctypes.

`step.c` holds the work between a decoding step's weight products (`step.py`), `products.c`
the products of weights kept in blocks (`blocked.py`), `q4.c` the 4-bit ones (`q4.py`),
`attention.c` and `attention32.c` causal attention for bf16 and fp32 training on a CPU
(`attention.py`). All five are compiled once per machine, into one library, with the
system's C compiler (`$CC`, else `cc`) for the host's own instruction set (-march=native),
or for the one `TLM_NATIVE_ARCH` names (`BUILDS`: `haswell` builds the AVX2 kernels, which
an AVX-512 host runs too, so that its tests cover both kinds; `builds_here` lists what this
host can run). Each source picks its kernels by what the compiler targets (`#if
__AVX512F__`, ...): one binding, one dispatch, made when the library is built on the host it
runs on. They are built with OpenMP (where the compiler has no OpenMP runtime, without it:
attention then runs on one core, and the blocked products are not used), into tlm's cache
folder (`$TLM_CACHE`, else ~/.cache/tlm; the temporary folder where that cannot be made),
under a name made of the sources, the flags and the CPU, so that a changed file or another
host compiles anew and a process that finds the library runs no compiler; the compiler
writes to a temporary name that is renamed when done. It takes about a second, and needs no
torch headers.

Where no compiler works, or `TLM_NATIVE=0`, `library()` is None: decoding runs the
model's own forward pass and training PyTorch's attention kernel, as before; one line
on stderr says so, once. `kernels()` names the instruction set a library's kernels use
(what every benchmark prints beside its figures).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from torch import Tensor

from tlm.errors import UserError

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("step.c", "products.c", "q4.c", "attention.c", "attention32.c")
]
HEADERS = [  # included by the sources: keyed too
    Path(__file__).with_name(name)
    for name in ("attention_rows.h", "blocks_avx512.h", "blocks_avx2.h")
    + ("blocks_q4.h", "store_half.h")  # q4_0's kernel (both builds), a store they share
]
# Compiled with -ffast-math (glibc's vector expf and friends need it) and linked without
# it: linking with it adds gcc's crtfastmath.o, whose loader sets flush-to-zero for the
# whole process, and every subnormal result of numpy and torch after the first decoding
# step became 0 (tested)
FLAGS = ["-O3", "-ffast-math", "-fPIC"]  # and -march= the build's (`arch`)
# OpenMP threads (attention's heads split across the cores), else SIMD pragmas only. With
# -fopenmp the library needs libgomp.so.1, which resolves to the copy torch has loaded: one
# thread pool for torch's ops and this file's, whose threads are still awake from the
# product before (tested: attention runs on torch's threads).
THREADS = ("-fopenmp", "-fopenmp-simd")

# TLM_NATIVE_ARCH: gcc's -march names tlm builds for, and the CPU flags each needs to run
BUILDS = {
    "native": set(),  # this CPU's own: AVX-512 kernels where it has AVX-512, AVX2 where AVX2
    "haswell": {"avx2", "fma", "f16c", "bmi2"},  # AVX2 kernels (int8 by vpmaddubsw)
    "alderlake": {"avx2", "fma", "f16c", "bmi2", "avx_vnni"},  # AVX2 with AVX-VNNI's int8
}
# `isa_here`'s bits: the instruction sets a build's kernels use
ISA = {1: "AVX-512", 2: "AVX-512 VNNI", 4: "AVX512_BF16", 8: "AVX2+FMA+F16C", 16: "AVX-VNNI"}

i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {  # name: (what it returns, its arguments)
    "add_norm": (None, [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, f32]),
    "attend_one": (
        None,
        [ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, ptr],
    ),
    "activate": (None, [ptr, i64, i64]),
    "greedy_pick": (i64, [ptr, i64, ptr]),
    "products_here": (i64, []),
    "isa_here": (i64, []),
    "int8_product": (i64, [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]),
    "float16_product": (i64, [ptr, ptr, ptr, i64, i64, i64, ptr]),
    "float32_product": (i64, [ptr, ptr, ptr, i64, i64, i64, ptr]),
    "float32_rows": (i64, [ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64]),
    "float32_panels": (i64, [ptr, i64, ptr, ptr, i64, i64, i64, ptr]),
    "q4_here": (i64, []),
    "q4_0_product": (i64, [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]),
    "q4_k_product": (i64, [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]),
    "q8_0_product": (i64, [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]),
    "float32_dots": (i64, [ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64]),
    "decode_step": (
        i64,
        [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr]
        + [i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr],
    ),
    "look_up": (i64, [ptr, ptr, i64, i64, ptr]),
    "decode_products": (i64, [ptr, i64, ptr, i64, i64, i64, i64, ptr]),
    "attention_here": (i64, []),
    "attention_forward": (i64, [ptr, ptr, ptr, *[i64] * 7, ptr, i64, i64, i64, ptr, i64]),
    "attention_backward": (
        i64,
        [ptr, ptr, ptr, *[i64] * 7, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, *[i64] * 4],
    ),
}
for name in ("forward", "backward"):  # attention32.c: attention.c's arguments, all fp32
    SIGNATURES[f"attention32_{name}"] = SIGNATURES[f"attention_{name}"]


class NativeError(UserError):
    """A TLM_NATIVE_ARCH that tlm does not build, or that this CPU cannot run."""


def arch() -> str:
    """The build `TLM_NATIVE_ARCH` asks for (`native` unless set), if this CPU runs it."""
    return _checked(os.environ.get("TLM_NATIVE_ARCH", "native") or "native")


@cache
def _checked(name: str) -> str:
    """`name` if tlm builds it and this CPU runs it (checked once a name: `library()` is
    asked every decoding step)."""
    if name not in BUILDS:
        raise NativeError(f"TLM_NATIVE_ARCH={name}: tlm builds {', '.join(BUILDS)}")
    missing = sorted(BUILDS[name] - _flags())
    if missing:
        raise NativeError(
            f"TLM_NATIVE_ARCH={name} needs {', '.join(missing)}, which this CPU lacks"
        )
    return name


def builds_here() -> list[str]:
    """The builds whose kernels this host can run, each a different instruction set:
    `native`, and `haswell` (AVX2) where native has AVX-512 or AVX-VNNI instead, and
    `alderlake` (AVX-VNNI) where native has AVX-512 and the CPU AVX-VNNI too."""
    flags, builds = _flags(), ["native"]
    if "avx512f" in flags or "avx_vnni" in flags:
        builds += [name for name in ("haswell", "alderlake") if BUILDS[name] <= flags]
    if "avx512f" not in flags and "alderlake" in builds:  # native is alderlake's kernels
        builds.remove("alderlake")
    return builds


def library() -> ctypes.CDLL | None:
    """The compiled `step.c` for `arch()`, or None (with one line on stderr) where it cannot
    be had."""
    if os.environ.get("TLM_NATIVE", "1") == "0":
        return None
    return _library(arch())


def kernels(lib: ctypes.CDLL | None = None) -> str:
    """The instruction sets of a library's kernels (this host's by default), as benchmarks
    print them: "AVX-512, AVX-512 VNNI, AVX512_BF16", "AVX2+FMA+F16C", or "none"."""
    lib = library() if lib is None else lib
    bits = 0 if lib is None else lib.isa_here()
    return ", ".join(name for bit, name in ISA.items() if bits & bit) or "none"


@cache
def _library(arch: str) -> ctypes.CDLL | None:
    for threads in THREADS:  # a compiler without OpenMP's runtime still gets the step
        try:
            lib = ctypes.CDLL(str(_compiled([*FLAGS, f"-march={arch}", threads])))
            break
        except (OSError, subprocess.SubprocessError) as error:
            reason = _first_line(error)
    else:
        print(f"tlm: running without its C kernels ({reason})", file=sys.stderr)
        return None
    for name, (returns, arguments) in SIGNATURES.items():
        getattr(lib, name).argtypes = arguments
        getattr(lib, name).restype = returns
    return lib


def _compiled(flags: list[str]) -> Path:
    """The compiled library: the cached one for this source, flags and CPU, else a new one
    (the compiler runs only then)."""
    key = hashlib.sha256()
    files = (path.read_bytes() for path in (*SOURCES, *HEADERS))
    for part in (*files, " ".join(flags).encode(), _cpu()):
        key.update(part)
    name = f"step-{key.hexdigest()[:16]}.so"
    folder = Path(os.environ.get("TLM_CACHE", Path.home() / ".cache" / "tlm")) / "native"
    if (folder / name).is_file():
        return folder / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # no cache folder to be had (a read-only home): the temporary folder
        folder = Path(tempfile.gettempdir()) / f"tlm-{os.getuid()}" / "native"
        folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    if target.is_file():
        return target
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=".so.part")
    os.close(handle)
    compiler = os.environ.get("CC", "cc")
    threads = [flag for flag in flags if "openmp" in flag]  # the runtime is linked too
    try:
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            objects = [str(Path(scratch) / f"{source.stem}.o") for source in SOURCES]
            steps = [
                [compiler, *flags, "-c", str(s), "-o", o]
                for s, o in zip(SOURCES, objects, strict=True)
            ]
            steps.append([compiler, "-shared", *threads, *objects, "-o", temporary, "-lm"])
            for command in steps:
                run = subprocess.run(command, capture_output=True, text=True, timeout=120)
                if run.returncode != 0:
                    raise OSError(f"{compiler} failed: {run.stderr.strip()[:200]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@cache
def _flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next(
        (set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set()
    )


def _cpu() -> bytes:
    """What -march=native depends on: the CPU's model and flags (or the machine type)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted).encode()


def threaded() -> bool:
    """Whether the library was built with OpenMP: its loops run on torch's threads
    (`products.c`'s products_here, bit 2)."""
    lib = library()
    return lib is not None and bool(lib.products_here() & 4)


def address(t: Tensor | None) -> int | None:
    """A tensor's data pointer for a C argument (None stays NULL)."""
    return None if t is None else t.data_ptr()
