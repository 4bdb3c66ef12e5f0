"""ggml's GPT-2 example (C++), built from a checkout and fed the same checkpoint as tlm.

`build` compiles `gpt-2-backend` and `gpt-2-quantize` from a checkout of ggml-org/ggml (a
work tree, or a bare repository whose HEAD is exported), once: the binaries are kept in
the work folder with the commit they came from. It targets the instruction set tlm's own
kernels do (`TLM_NATIVE_ARCH`): this CPU's (GGML_NATIVE), or AVX2 alone for `haswell`
(with AVX-VNNI for `alderlake`), so that an AVX-512 host can run both sides as an AVX2-only
host does. `convert` writes a Hugging Face GPT-2
directory in the example's own file format (written here from the layout its loader
reads: magic, hyperparameters, a vocabulary, then named tensors), in f32 or f16; q8_0
comes from the example's quantizer. `rate` runs the example and reads its per-token
time. ggml is a peer to measure, not a dependency: nothing in `src/` uses it.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

MAGIC = 0x67676D6C  # "ggml"
FTYPES = {"f32": 0, "f16": 1}  # the file's weight type; q8_0 is made by gpt-2-quantize
TARGETS = ("gpt-2-backend", "gpt-2-quantize")
AVX2 = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
AVX2 += ["-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]
CPU = {  # TLM_NATIVE_ARCH -> ggml's options for the same instruction set
    "native": ["-DGGML_NATIVE=ON"],
    "haswell": AVX2,
    "alderlake": [*AVX2, "-DGGML_AVX_VNNI=ON"],
}


def build(source: Path, work: Path, arch: str = "native") -> Path:
    """The folder of the built binaries for the build `arch` of tlm's kernels names, made
    once per commit of `source`."""
    wanted = commit(source)
    out = work / ("ggml" if arch == "native" else f"ggml-{arch}")
    binaries = out / "build" / "bin"
    stamp = out / "commit"
    if stamp.is_file() and stamp.read_text() == wanted and (binaries / TARGETS[0]).is_file():
        return binaries
    shutil.rmtree(out, ignore_errors=True)
    tree = out / "src"
    tree.mkdir(parents=True)
    if (source / "CMakeLists.txt").is_file():
        shutil.copytree(source, tree, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git"))
    else:  # a bare repository: its HEAD
        archive = subprocess.run(
            ["git", "-C", str(source), "archive", "HEAD"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    configure = ["cmake", "-S", str(tree), "-B", str(out / "build"), "-DCMAKE_BUILD_TYPE=Release"]
    configure += [*CPU[arch], "-DGGML_BUILD_EXAMPLES=ON", "-DGGML_BUILD_TESTS=OFF"]
    subprocess.run(configure, capture_output=True, check=True)
    compile_ = ["cmake", "--build", str(out / "build"), "-j", "--target", *TARGETS]
    subprocess.run(compile_, capture_output=True, check=True)
    stamp.write_text(wanted)
    return binaries


def commit(source: Path) -> str:
    run = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if run.returncode != 0:
        raise SystemExit(f"{source}: not a git checkout of ggml (git rev-parse failed)")
    return run.stdout.strip()


def convert(folder: Path, out: Path, ftype: str) -> Path:
    """A Hugging Face GPT-2 directory (model.safetensors, config.json) as one ggml GPT-2
    file: the weight matrices in `ftype`, positions, biases and LayerNorms in f32."""
    if out.is_file():
        return out
    config = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    state = {name.removeprefix("transformer."): t for name, t in state.items()}
    L, V, d = config["n_layer"], config["vocab_size"], config["n_embd"]
    hparams = [V, config["n_positions"], d, config["n_head"], L, FTYPES[ftype]]
    part = out.with_suffix(".part")
    with part.open("wb") as f:
        f.write(struct.pack("<I6i", MAGIC, *hparams))
        f.write(struct.pack("<i", V))
        for i in range(V):  # single bytes first, so that any ASCII prompt tokenizes
            word = bytes([i]) if i < 256 else f"<{i}>".encode()
            f.write(struct.pack("<I", len(word)) + word)
        tensors = [("model/ln_f/g", "ln_f.weight"), ("model/ln_f/b", "ln_f.bias")]
        tensors += [("model/wte", "wte.weight"), ("model/wpe", "wpe.weight")]
        for layer in range(L):
            for ours, theirs in [
                ("ln_1/g", "ln_1.weight"),
                ("ln_1/b", "ln_1.bias"),
                ("ln_2/g", "ln_2.weight"),
                ("ln_2/b", "ln_2.bias"),
                ("attn/c_attn/w", "attn.c_attn.weight"),
                ("attn/c_attn/b", "attn.c_attn.bias"),
                ("attn/c_proj/w", "attn.c_proj.weight"),
                ("attn/c_proj/b", "attn.c_proj.bias"),
                ("mlp/c_fc/w", "mlp.c_fc.weight"),
                ("mlp/c_fc/b", "mlp.c_fc.bias"),
                ("mlp/c_proj/w", "mlp.c_proj.weight"),
                ("mlp/c_proj/b", "mlp.c_proj.bias"),
            ]:
                tensors.append((f"model/h{layer}/{ours}", f"h.{layer}.{theirs}"))
        for name, key in tensors:
            array = state[key]
            if name.endswith("/w"):  # Conv1D keeps [in, out]; the example reads [out, in]
                array = array.T
            matrix = name.endswith("/w") or name == "model/wte"
            _write_tensor(f, name, array, "f16" if matrix and ftype == "f16" else "f32")
    part.rename(out)
    return out


def _write_tensor(f, name: str, array: np.ndarray, ftype: str) -> None:
    """One tensor: dims, name length, type, sizes innermost first, name, data (row-major)."""
    data = np.ascontiguousarray(array, dtype=np.float16 if ftype == "f16" else np.float32)
    shape = data.shape[::-1]  # ggml's ne[0] is the contiguous dimension
    encoded = name.encode()
    f.write(struct.pack(f"<3i{len(shape)}i", len(shape), len(encoded), FTYPES[ftype], *shape))
    f.write(encoded)
    f.write(data.tobytes())


def quantize(binaries: Path, source: Path, out: Path, qtype: str = "q8_0") -> Path:
    if not out.is_file():
        command = [str(binaries / "gpt-2-quantize"), str(source), str(out), qtype]
        subprocess.run(command, capture_output=True, check=True)
    return out


def rate(binaries: Path, model: Path, threads: int, new: int, prompt: str) -> float:
    """Tokens/s of `gpt-2-backend` generating `new` tokens after `prompt` (one byte a
    token), from its own per-token figure (evaluation time over tokens evaluated)."""
    command = [str(binaries / "gpt-2-backend"), "-m", str(model), "-t", str(threads)]
    command += ["-n", str(new), "-p", prompt, "--ignore-eos", "--top_k", "1", "-s", "1"]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    per_token = re.search(r"predict time = .* / *([0-9.]+) ms per token", run.stdout)
    if per_token is None:
        raise SystemExit(f"no per-token time in gpt-2-backend's output:\n{run.stdout[-2000:]}")
    return 1000 / float(per_token.group(1))


def greedy_tokens(binaries: Path, model: Path, new: int, prompt: str) -> list[int]:
    """The ids `gpt-2-backend` prints after `prompt` with top-k 1 (greedy): the converted
    vocabulary writes ids below 256 as their byte and the rest as <id>."""
    command = [str(binaries / "gpt-2-backend"), "-m", str(model), "-t", "1", "-n", str(new)]
    command += ["-p", prompt, "--ignore-eos", "--top_k", "1", "-s", "1"]
    out = subprocess.run(command, capture_output=True, check=True).stdout.decode("latin-1")
    text = out.split("first 8 tokens:", 1)[1].split("\n", 2)[2].split("\n\nmain:", 1)[0]
    text = text.removeprefix(prompt)
    return [int(n) if n else ord(c) for n, c in re.findall(r"<(\d+)>|(.)", text, re.DOTALL)]
