"""What the decoding benchmarks share (`generate.py`, `gpu.py`, `threads.py`): the GPT-2 124M
shape with random weights on both sides, saved once as a Hugging Face directory, the
tokens/s of greedy `generate` on each side, and the read-bandwidth limit of decoding."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tlm import ModelConfig, TransformerLM, load_model
from tlm.generate import GenerationConfig, generate
from tlm.inference import Decoder
from tlm.inference.formats import blas
from tlm.inference.formats.kernels import BYTES, wider
from tlm.interop.gpt2 import gpt2_config

ROOT = Path(__file__).resolve().parent.parent
GPT2 = {"vocab_size": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "context_length": 1024}
PROMPT = 32


def tlm_gpt2() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**GPT2, activation="gelu_tanh")).eval()


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = ModelConfig(**GPT2, activation="gelu_tanh")  # the shape of tlm_gpt2, in GPT-2's names
    return GPT2LMHeadModel(GPT2Config(**gpt2_config(config, None))).eval()


def timed(run, device: torch.device) -> float:
    """Seconds of `run()`, the work it queued on a GPU included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    started = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - started


def tlm_rate(
    model: TransformerLM,
    batch: int,
    new: int,
    use_cache: bool = True,
    prompt: int = PROMPT,
    decoder: Decoder | None = None,
    **settings,
) -> float:
    """Tokens/s of greedy `generate` from random prompts, on the model's device; `settings`
    go to `GenerationConfig` (bench/gpu.py: cuda_graph). A caller that measures one model
    again and again passes its `decoder`, as a program that generates again and again
    keeps one (its thread choice, its prepared step, its recorded CUDA graph)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, GPT2["vocab_size"], (batch, prompt), device=device)
    config = GenerationConfig(max_new_tokens=new, use_cache=use_cache, **settings)
    steps = []
    elapsed = timed(lambda: steps.extend(generate(model, ids, config, decoder=decoder)), device)
    return batch * len(steps) / elapsed


def hf_rate(model, batch: int, new: int) -> float:
    ids = torch.randint(0, GPT2["vocab_size"], (batch, PROMPT), device=model.device)

    def run():
        with torch.no_grad():
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )

    return batch * new / timed(run, model.device)


def saved_gpt2(work: Path) -> Path:
    """A Hugging Face directory of the random GPT-2 124M shape (`hf_gpt2`), saved once."""
    folder = work / "gpt2-124m-random"
    if not (folder / "model.safetensors").is_file():
        hf_gpt2().save_pretrained(folder)
    return folder


def user_models(folder: Path, formats=("float16", "int8")) -> dict[str, TransformerLM]:
    """What a user gets: `load_model(path)` (fp32, no for_inference call) and
    `load_model(path, dtype=...)` of a Hugging Face directory in each of `formats`."""
    return {"float32": load_model(folder)} | {f: load_model(folder, dtype=f) for f in formats}


def read_bandwidth(threads: int, nbytes: int, repeats: int = 8) -> dict[str, float]:
    """Bytes/s of reading memory the way decoding does: the same `nbytes` read again and
    again, every byte once a pass, nothing written back, on the run's threads. Two readers
    of an fp32 matrix of that size, best of `repeats` each: torch.sum, and one row times
    the matrix through the fp32 decoding route (tlm's own loops, or numpy's BLAS:
    `inference/formats/blas.py`): {reader: bytes/s}. A working set this size is partly served from
    the CPU's caches from one pass to the next, as the weights of a step are."""
    big, previous = torch.randn(nbytes // 4096, 1024), torch.get_num_threads()
    row, rates = torch.randn(1, 1024), {}
    torch.set_num_threads(threads)
    try:
        for name, read in (
            ("torch.sum", big.sum),
            ("x E^T", lambda: blas.product(row, big.t(), None)),
        ):
            read()
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                read()
                times.append(time.perf_counter() - started)
            rates[name] = big.numel() * big.element_size() / min(times)
    finally:
        torch.set_num_threads(previous)
    return rates


def weight_bytes(config: ModelConfig, fmt: str) -> int:
    """Bytes a decoding step reads: every matrix once (the head's E^T too), biases and
    LayerNorms in fp32."""
    d, L, V = config.d_model, config.n_layers, config.vocab_size
    blocks, head = L * (4 * d * d + 2 * d * config.d_ff), V * d
    size, head_size = BYTES[fmt], BYTES[wider(fmt)]  # the 4-bit formats keep the head q8_0
    return int(blocks * size + head * head_size) + 4 * L * (4 * d + config.d_ff + d + 4 * d)
