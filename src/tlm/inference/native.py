"""`step.c`, `products.c`, `attention.c` and `attention32.c`, compiled for this machine at
first use, called through ctypes.

`step.c` holds the work between a decoding step's weight products (`step.py`),
`products.c` the products of weights kept in blocks (`blocked.py`), `attention.c` and
`attention32.c` causal attention for bf16 and fp32 training on a CPU (`attention.py`).
All four are compiled
once per machine, into one library, with the system's C compiler (`$CC`, else `cc`) for
the host's own instruction set (-march=native) and with OpenMP (where the compiler has no
OpenMP runtime, without it: attention then runs on one core, and the blocked products are
not used), into tlm's cache folder (`$TLM_CACHE`, else ~/.cache/tlm; the temporary folder
where that cannot be made), under a name made of the sources, the flags and the CPU, so
that a changed file or another host compiles anew and a process that finds the library
runs no compiler; the compiler writes to a temporary name that is renamed when done. It
takes about a second, and needs no torch headers.

Where no compiler works, or `TLM_NATIVE=0`, `library()` is None: decoding runs the
model's own forward pass and training PyTorch's attention kernel, as before; one line
on stderr says so, once.
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

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("step.c", "products.c", "attention.c", "attention32.c")
]
HEADERS = [Path(__file__).with_name("attention_rows.h")]  # included by the sources: keyed too
# Compiled with -ffast-math (glibc's vector expf and friends need it) and linked without
# it: linking with it adds gcc's crtfastmath.o, whose loader sets flush-to-zero for the
# whole process, and every subnormal result of numpy and torch after the first decoding
# step became 0 (tested)
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
# OpenMP threads (attention's heads split across the cores), else SIMD pragmas only. With
# -fopenmp the library needs libgomp.so.1, which resolves to the copy torch has loaded: one
# thread pool for torch's ops and this file's, whose threads are still awake from the
# product before (tested: attention runs on torch's threads).
THREADS = ("-fopenmp", "-fopenmp-simd")

i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {  # name: (what it returns, its arguments)
    "add_norm": (None, [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, f32]),
    "attend_one": (
        None,
        [ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32, ptr, ptr, ptr],
    ),
    "activate": (None, [ptr, i64, i64]),
    "greedy_pick": (i64, [ptr, i64, ptr]),
    "products_here": (i64, []),
    "int8_product": (i64, [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]),
    "float16_product": (i64, [ptr, ptr, ptr, i64, i64, i64, ptr]),
    "float32_product": (i64, [ptr, ptr, ptr, i64, i64, i64, ptr]),
    "float32_rows": (i64, [ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64]),
    "float32_dots": (i64, [ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64]),
    "decode_step": (
        i64,
        [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr]
        + [i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr],
    ),
    "look_up": (i64, [ptr, ptr, i64, i64, ptr]),
    "decode_products": (i64, [ptr, i64, ptr, i64, i64, i64, i64, ptr]),
    "attention_here": (i64, []),
    "attention_forward": (i64, [ptr, ptr, ptr, *[i64] * 7, ptr, i64, i64, i64, ptr]),
    "attention_backward": (
        i64,
        [ptr, ptr, ptr, *[i64] * 7, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64],
    ),
}
for name in ("forward", "backward"):  # attention32.c: attention.c's arguments, all fp32
    SIGNATURES[f"attention32_{name}"] = SIGNATURES[f"attention_{name}"]


@cache
def library() -> ctypes.CDLL | None:
    """The compiled `step.c`, or None (with one line on stderr) where it cannot be had."""
    if os.environ.get("TLM_NATIVE", "1") == "0":
        return None
    for threads in THREADS:  # a compiler without OpenMP's runtime still gets the step
        try:
            lib = ctypes.CDLL(str(_compiled([*FLAGS, threads])))
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
