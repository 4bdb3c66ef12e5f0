"""llama-cpp-python for the benchmarks that run llama.cpp beside tlm (`bench/gguf.py`,
`bench/generate.py --part speculative`): installed, or built once into --work."""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

import _ggml

from tlm.inference import native

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def llama_cpp(work: Path, build: bool = True):
    """The llama_cpp module, its log silenced: installed, or built once into
    work/llama-cpp-<a hash of this CPU's flags>[-<build>] for the instruction set tlm's
    kernels use (`TLM_NATIVE_ARCH`: haswell builds llama.cpp for AVX2 alone too). With
    `build` False, None where it is neither installed nor built."""
    arch = native.arch()
    try:
        if arch != "native":
            raise ImportError  # an installed one is built for this CPU
        module = importlib.import_module("llama_cpp")
    except ImportError:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if "flags" in line
        )
        suffix = "" if arch == "native" else f"-{arch}"
        target = work / f"llama-cpp-{hashlib.sha256(flags.encode()).hexdigest()[:10]}{suffix}"
        if not (target / "llama_cpp").is_dir():
            if not build:
                return None
            print(
                f"building {LLAMA_CPP_PYTHON} for {arch} into {target} (once; minutes)",
                flush=True,
            )
            pip = [  # no wheel cache: it would hand one build's wheel to another build
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-cache-dir",
                "--target",
                str(target),
            ]
            env = os.environ | {"CMAKE_ARGS": " ".join(_ggml.CPU[arch])}
            subprocess.run([*pip, "--no-deps", LLAMA_CPP_PYTHON, "diskcache"], check=True, env=env)
        sys.path.insert(0, str(target))
        module = importlib.import_module("llama_cpp")
    SILENCE.append(module.llama_log_callback(lambda level, text, data: None))
    module.llama_log_set(SILENCE[-1], ctypes.c_void_p(0))
    return module


SILENCE = []  # the log callback, kept alive for as long as llama.cpp may call it
