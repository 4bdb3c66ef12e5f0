"""Decoding benchmark (not a test): tlm against Hugging Face `GPT2LMHeadModel.generate`.

    python bench/generate.py                   # all parts
    python bench/generate.py --part peer       # tok/s vs transformers, GPT-2 124M shape
    python bench/generate.py --part cache      # KV cache against recomputation at 1024 tokens
    python bench/generate.py --part dtypes     # float32 / float16 / bfloat16 / int8 weights
    python bench/generate.py --part imported   # a GPT-2 checkpoint directory, read by both
    python bench/generate.py --part limit      # batch 1 against the read-bandwidth limit
    python bench/generate.py --part memory     # peak resident memory, tlm beside transformers
    python bench/generate.py --part ggml --ggml PATH   # beside ggml's GPT-2 example (C++)

Random weights of the GPT-2 124M shape, fp32, greedy decoding of a 32-token prompt with no
early stop, in one process; the two sides alternate, and medians are reported. The dtype
part also trains a small model (python-docs, once, in --work) to show how much each
weight format changes the validation loss.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from _decoding import (
    GPT2,
    PROMPT,
    ROOT,
    hf_gpt2,
    hf_rate,
    read_bandwidth,
    saved_gpt2,
    tlm_gpt2,
    tlm_rate,
    user_models,
    weight_bytes,
)
from _peers import host
from _speculative import part_self_draft, part_speculative
from _verify import part_verify

from tlm import ModelConfig, load_model
from tlm.generate import generate
from tlm.inference import Decoder, for_inference, native
from tlm.inference.devices.threads import on_threads
from tlm.inference.formats import blas
from tlm.model.kv_cache import KVCache


def part_peer(rounds: int) -> None:
    ours, theirs = for_inference(tlm_gpt2(), "float32"), hf_gpt2()
    ours = Decoder(ours)  # kept across the calls, as a program that generates again keeps it
    tlm_rate(ours.model, 1, 4, decoder=ours), hf_rate(theirs, 1, 4)  # warm up
    print("GPT-2 124M shape, fp32, greedy, prompt 32; tokens/s (median of alternating rounds)")
    for batch, new in [(1, 128), (8, 128), (1, 512), (8, 512)]:
        rates = alternate(ours, theirs, batch, new, rounds if new <= 128 else max(1, rounds - 1))
        print(f"  batch {batch}, {new:3d} new: {rates}")


def alternate(ours: Decoder, theirs, batch: int, new: int, rounds: int) -> str:
    """tok/s of each side, alternating rounds (so drifts in machine speed hit both), medians."""
    a, b = [], []
    for _ in range(rounds):
        b.append(hf_rate(theirs, batch, new))
        a.append(tlm_rate(ours.model, batch, new, decoder=ours))
    mine, peer = statistics.median(a), statistics.median(b)
    return f"tlm {mine:6.1f}, transformers {peer:6.1f}, ratio {mine / peer:.2f}x"


def part_cache(rounds: int) -> None:
    """One decoding step at position 1024: the cached step against a full recomputation."""
    model = for_inference(tlm_gpt2(), "float32")
    ids = torch.randint(0, GPT2["vocab_size"], (1, 1024))
    cached, recomputed = [], []
    with torch.no_grad():
        for _ in range(rounds):
            cache = KVCache(model.config, 1, capacity=1024)
            model(ids[:, :1023], cache, last_only=True)
            started = time.perf_counter()
            model(ids[:, 1023:], cache, last_only=True)
            cached.append(time.perf_counter() - started)
            started = time.perf_counter()
            model(ids, last_only=True)
            recomputed.append(time.perf_counter() - started)
    step, full = statistics.median(cached), statistics.median(recomputed)
    times = f"cached step {step * 1e3:.1f} ms, recomputing the window {full * 1e3:.0f} ms"
    print(f"token 1024: {times}: the cache is {full / step:.0f}x faster")
    with_cache = tlm_rate(model, 1, 128, decoder=Decoder(model))
    without = tlm_rate(model, 1, 128, use_cache=False)
    print(f"128 new tokens, batch 1: {with_cache:.1f} tok/s with the cache, {without:.1f} without")


def part_dtypes(rounds: int, work: Path) -> None:
    from tlm.evaluate import evaluate_tokens
    from tlm.tokenizer import load_tokenizer

    run, data = small_model(work)
    print("weights     batch 1 tok/s   batch 8 tok/s   validation loss (small trained model)")
    for dtype in ("float32", "float16", "bfloat16", "int8"):
        model = for_inference(tlm_gpt2(), dtype)
        decoder = Decoder(model)
        one = statistics.median(tlm_rate(model, 1, 128, decoder=decoder) for _ in range(rounds))
        eight = statistics.median(tlm_rate(model, 8, 128, decoder=decoder) for _ in range(rounds))
        small = for_inference(load_model(run), dtype)
        loss = evaluate_tokens(small, data.split("val"), load_tokenizer(run).token_bytes())["loss"]
        print(f"  {dtype:9s} {one:13.1f} {eight:15.1f}   {loss:.4f}")


def small_model(work: Path):
    """A 4-layer model trained briefly on python-docs (made once, then reused)."""
    from tlm.data import TokenData, prepare
    from tlm.train import new_run_configs, open_run

    data_dir, run = work / "data" / "python-docs-bpe", work / "runs" / "decode_small"
    if not (data_dir / "meta.json").is_file():
        prepare(["python-docs"], data_dir, vocab_size=1024, force=True, progress=False)
    if not (run / "model.safetensors").is_file():
        shape = {"n_layers": 4, "d_model": 128, "n_heads": 4, "context_length": 128}
        values = {"data": str(data_dir), "out": str(run), "max_steps": 400, "batch_size": 16}
        model_config, train_config, data = new_run_configs(shape, values)
        tokenizer = (data_dir / "tokenizer.json").read_text()
        open_run(model_config, train_config, data, tokenizer, progress_bar=False).fit()
    return run, TokenData(data_dir)


def part_imported(rounds: int, work: Path) -> None:
    """The same GPT-2 checkpoint directory read by both: load time, equal tokens, tok/s."""
    from transformers import GPT2LMHeadModel

    folder = work / "gpt2-124m-random"
    if not (folder / "model.safetensors").is_file():
        hf_gpt2().save_pretrained(folder)
    started = time.perf_counter()
    theirs = GPT2LMHeadModel.from_pretrained(folder).eval()
    loaded_hf = time.perf_counter()
    ours = load_model(folder)
    loaded = time.perf_counter()
    ours = for_inference(ours, "float32")
    packed = time.perf_counter()
    print(
        f"{folder.name}: loaded by transformers in {loaded_hf - started:.2f} s, by tlm in "
        f"{loaded - loaded_hf:.2f} s (+ {packed - loaded:.2f} s packing for inference)"
    )
    ids = torch.randint(
        0, GPT2["vocab_size"], (2, PROMPT), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = theirs.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False
        )
    same = torch.equal(ours.generate(ids, max_new_tokens=64), expected)
    print(f"greedy, 2 prompts x 64 new tokens: {'identical' if same else 'DIFFERENT'} tokens")
    for batch in (1, 8):
        print(f"  batch {batch}, 128 new: {alternate(ours, theirs, batch, 128, rounds)}")


def part_limit(rounds: int, work: Path) -> None:
    """Batch-1 decoding against the read-bandwidth limit, and the time between products.
    A step is the time from one token to the next in `generate` (everything a token costs:
    the model, the choice, the loop; the prompt's pass is its own column); "products" is
    one row through the step's weight products alone, back to back (`products_only`).
    Each round times both, and the medians over rounds are reported. The limit of every
    format is its weight bytes over one bandwidth: the fastest reading of weights seen in
    the run, by the plain readers (`read_bandwidth`) or by a format's products alone."""
    threads = torch.get_num_threads()
    models = user_models(saved_gpt2(work), ("float16", "int8", "q8_0", "q4_0", "q4_k"))
    smallest = min(weight_bytes(model.config, fmt) for fmt, model in models.items())
    rows = {}
    for fmt, model in models.items():
        decoder = Decoder(model)
        tlm_rate(model, 1, 4, decoder=decoder)
        rates, prompts, steps, products = [], [], [], []
        for _ in range(rounds):
            rates.append(tlm_rate(model, 1, 64, decoder=decoder))
            prompt, step = token_times(decoder, 64)
            prompts.append(prompt), steps.append(step), products.append(products_only(decoder))
        eight = tlm_rate(model, 8, 32, decoder=decoder)
        many = tlm_rate(model, 32, 32, decoder=decoder)
        medians = [statistics.median(v) for v in (rates, prompts, steps, products)]
        rows[fmt] = (*medians, eight, many, step_at(decoder, 1024))
    readers = read_bandwidth(threads, smallest)
    for fmt, row in rows.items():  # bytes over seconds of the products alone
        readers[f"{fmt} products"] = weight_bytes(models[fmt].config, fmt) / row[3]
    best = max(readers, key=readers.get)
    bandwidth = readers[best]
    print(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({best}); readers, best of 8 on {threads} "
        f"threads ({smallest / 1e6:.0f} MB read again and again), and each format's products "
        f"alone: {', '.join(f'{n} {r / 1e9:.1f}' for n, r in readers.items())} GB/s; "
        "limit = bandwidth / weight bytes"
    )
    print("GPT-2 124M shape, greedy, prompt 32, 64 new tokens; median of rounds")
    print(
        "format    weights MB  limit tok/s  batch 1 tok/s  share  prompt ms  step ms"
        "  products ms  between  batch 8  batch 32  step@1024"
    )
    for fmt, (rate, prompt, step, alone, eight, many, late) in rows.items():
        nbytes = weight_bytes(models[fmt].config, fmt)
        print(
            f"{fmt:9s} {nbytes / 1e6:10.0f} {bandwidth / nbytes:12.1f} {rate:14.1f}"
            f" {rate * nbytes / bandwidth:6.0%} {prompt * 1e3:10.1f}"
            f" {step * 1e3:8.2f} {alone * 1e3:12.2f} {(step - alone) / step:8.0%}"
            f" {eight:8.1f} {many:9.1f} {late * 1e3:8.1f} ms"
        )
    hf = statistics.median(hf_rate(hf_gpt2(), 1, 64) for _ in range(rounds))
    print(f"transformers fp32 batch 1: {hf:.1f} tok/s")


def token_times(decoder: Decoder, new: int) -> tuple[float, float]:
    """(seconds to the first token, the median seconds from one token to the next) of
    batch-1 greedy `generate` from a random 32-token prompt."""
    ids = torch.randint(0, GPT2["vocab_size"], (1, PROMPT))
    started = time.perf_counter()
    steps = generate(decoder.model, ids, max_new_tokens=new, decoder=decoder)
    stamps = [time.perf_counter() for _ in steps]
    return stamps[0] - started, statistics.median(b - a for a, b in itertools.pairwise(stamps))


def part_ggml(rounds: int, work: Path, source: Path | None) -> None:
    """tlm beside ggml's GPT-2 example (C++) on the same random GPT-2 124M checkpoint,
    f32 / f16 / q8_0 against tlm's float32 / float16 / int8: batch 1, greedy, a 1-token
    prompt and 128 new tokens, the two alternating, best of `rounds`. ggml is built from
    the checkout at `source` (--ggml) and the checkpoint converted, once (kept in --work)."""
    import _ggml

    if source is None:
        raise SystemExit("--part ggml needs --ggml PATH, a checkout of ggml-org/ggml")
    binaries, folder = _ggml.build(source, work, native.arch()), saved_gpt2(work)
    files = {fmt: _ggml.convert(folder, work / f"ggml-{fmt}.bin", fmt) for fmt in ("f32", "f16")}
    files["q8_0"] = _ggml.quantize(binaries, files["f32"], work / "ggml-q8_0.bin")
    threads, new = torch.get_num_threads(), 128
    print(
        f"ggml {_ggml.commit(source)[:10]} ({native.arch()}), gpt-2-backend -t {threads}; "
        "tlm load_model(path"
        ", dtype=...) + generate; batch 1, greedy, 1-token prompt, 128 new; tok/s, best of "
        f"{rounds}"
    )
    ids = torch.tensor([[ord("a")]])
    same = _ggml.greedy_tokens(binaries, files["f32"], 16, "a") == (
        load_model(folder).generate(ids, max_new_tokens=16)[0, 1:].tolist()
    )
    print(f"the same 16 greedy tokens from both, fp32: {'yes' if same else 'NO'}")
    print("tlm format   ggml type   tlm tok/s   ggml tok/s   tlm / ggml")
    pairs = {"float32": "f32", "float16": "f16", "int8": "q8_0"}
    for fmt, model in user_models(folder).items():
        ours, theirs, decoder = [], [], Decoder(model)
        tlm_rate(model, 1, 4, prompt=1, decoder=decoder)
        for _ in range(rounds):
            theirs.append(_ggml.rate(binaries, files[pairs[fmt]], threads, new, "a"))
            ours.append(tlm_rate(model, 1, new, prompt=1, decoder=decoder))
        mine, peer = max(ours), max(theirs)
        print(f"{fmt:12s} {pairs[fmt]:9s} {mine:11.1f} {peer:12.1f} {mine / peer:11.2f}x")


def products_only(decoder: Decoder) -> float:
    """Seconds for one row through every product of a decoding step and nothing else (no
    attention, LayerNorm or loop), in the step's order, run as the step runs them (in one
    C call where the whole step is one, `inference/decoding/program.py`): the most the kernels
    allow (median of 5)."""
    model = decoder.model
    whole = decoder.program(1) if native.library() else None
    x, h = torch.randn(1, 1, model.config.d_model), torch.randn(1, 1, model.config.d_ff)
    one_thread = model.inference_format == "float32" and blas.needs_one_thread()
    times = []
    for _ in range(5):
        with torch.no_grad(), on_threads(1) if one_thread else nullcontext():
            started = time.perf_counter()
            if whole is not None:
                config, logits = model.config, torch.empty(whole.head.out)
                native.library().decode_products(
                    ctypes.addressof(whole.blocks), len(whole.blocks),
                    ctypes.addressof(whole.head), 1, config.d_model, config.d_ff,
                    config.n_heads * config.d_head, logits.data_ptr(),
                )  # fmt: skip
            else:
                for block in model.blocks:
                    block.attn.qkv_kernel.step(x), block.attn.out_kernel.step(x)
                    block.ffn.up_kernel.step(x), block.ffn.down_kernel.step(h)
                model.head.step(x)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_at(decoder: Decoder, position: int) -> float:
    """Seconds of one cached batch-1 step with `position` tokens of context (median of 5)."""
    model = decoder.model
    ids = torch.randint(0, GPT2["vocab_size"], (1, position))
    cache = KVCache(model.config, 1, capacity=position)
    with torch.no_grad():
        model(ids[:, : position - 5], cache)
    times = []
    for t in range(position - 5, position):
        started = time.perf_counter()
        decoder.logits(ids[:, t : t + 1], cache, None)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


MEMORY_SCRIPT = """
import resource, sys, torch
side, folder, fmt = sys.argv[1:]
ids = torch.randint(0, 50257, (1, 32))
if side == "transformers":
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
else:
    from tlm import load_model
    if side == "load":  # read whole, then packed
        model = load_model(folder)
        if fmt != "none":
            from tlm.inference import for_inference
            model = for_inference(model, fmt)
    else:  # packed part by part as it is read
        model = load_model(folder, dtype=fmt)
    model.generate(ids, max_new_tokens=32)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6)  # KiB -> MB
"""


def part_memory(work: Path) -> None:
    """Peak resident memory (MB) of a fresh process that loads the GPT-2 124M shape from a
    Hugging Face directory and generates 32 tokens; the goal is the weights in the chosen
    format + the KV cache + 300 MB."""
    import subprocess

    folder = saved_gpt2(work)
    config = ModelConfig(**GPT2, activation="gelu_tanh")
    cache = 2 * config.n_layers * 64 * config.d_model * 4  # K and V of 64 positions, fp32
    print("side                                        peak MB   goal MB")
    formats = ("float32", "float16", "bfloat16", "int8")
    sides = [("transformers", "none"), ("load", "none")]
    sides += [("load", fmt) for fmt in formats] + [("stream", fmt) for fmt in formats]
    for side, fmt in sides:
        command = [sys.executable, "-c", MEMORY_SCRIPT, side, str(folder), fmt]
        peak = float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        name = {
            "transformers": "transformers",
            "load": "tlm load_model(path)" + ("" if fmt == "none" else f", for_inference {fmt}"),
            "stream": f"tlm load_model(path, dtype={fmt!r})",
        }[side]
        weights = weight_bytes(config, "float32" if fmt == "none" else fmt)
        goal = (weights + config.context_length * config.d_model * 4 + cache) / 1e6 + 300
        print(f"{name:43s} {peak:7.0f} {goal:9.0f}")


PARTS = ["peer", "cache", "dtypes", "imported", "limit", "memory", "verify", "ggml"]
PARTS += ["speculative"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=["all", *PARTS])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default=str(ROOT / "out" / "bench"))
    parser.add_argument("--ggml", type=Path, help="a checkout of ggml-org/ggml (--part ggml)")
    args = parser.parse_args()
    print(f"{host()}, {torch.get_num_threads()} threads")
    every = [p for p in PARTS if (p != "ggml" or args.ggml) and p != "speculative"]
    chosen = every if args.part == "all" else [args.part]
    for part in chosen:
        if part == "peer":
            part_peer(args.rounds)
        elif part == "cache":
            part_cache(args.rounds)
        elif part == "imported":
            part_imported(args.rounds, Path(args.work))
        elif part == "limit":
            part_limit(args.rounds, Path(args.work))
        elif part == "memory":
            part_memory(Path(args.work))
        elif part == "ggml":
            part_ggml(args.rounds, Path(args.work), args.ggml)
        elif part == "verify":
            part_verify(args.rounds, Path(args.work))
        elif part == "speculative":
            demo, data = ROOT / "runs" / "demo", ROOT / "data" / "demo"
            part_speculative(args.rounds, demo, data, Path(args.work))
            part_self_draft(args.rounds, saved_gpt2(Path(args.work)))
        else:
            part_dtypes(args.rounds, Path(args.work))


if __name__ == "__main__":
    main()
