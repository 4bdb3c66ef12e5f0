"""`bench/generate.py --part verify`: what checking a draft's k tokens in one step costs.

Speculative decoding (issue 53) pays one step of the target model for k proposed tokens,
so every speedup it can give rests on T(k)/T(1), the time of a step that checks k tokens of
one sequence (`Decoder.check`) over that of a step of one: a batch-1 step reads every weight
once either way, and the k rows share the read.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from _decoding import GPT2, saved_gpt2, user_models

from tlm import load_model
from tlm.inference import Decoder, SlotCache

CONTEXT = 64  # tokens in the cache before each check


def check_seconds(model, k: int, repeats: int) -> float:
    """Median seconds of `Decoder.check` with k tokens at position CONTEXT, rolled back
    after each, batch 1."""
    decoder, cache = Decoder(model), SlotCache(model.config, 1, capacity=CONTEXT + 16)
    ids = torch.randint(0, GPT2["vocab_size"], (CONTEXT + k,))
    with torch.no_grad():
        model(ids[None, :CONTEXT], cache.feed([0], [CONTEXT]))
    draft, times = ids[CONTEXT:].tolist(), []
    for _ in range(repeats + 1):  # the first makes the decoder's program and scratch
        started = time.perf_counter()
        decoder.check(cache, 0, draft)
        times.append(time.perf_counter() - started)
        cache.truncate(0, CONTEXT)
    return statistics.median(times[1:])


def part_verify(rounds: int, work: Path) -> None:
    """T(k)/T(1) for k = 1…8 per format, GPT-2 124M shape (random weights), batch 1, the
    k's of each format taking turns for `rounds` rounds, medians. "float32" is the model
    as `load_model` reads it (its parameters in place), "fp32 prep." as `load_model(...,
    dtype="float32")` prepares it (a copy in blocks for steps of several rows)."""
    folder = saved_gpt2(work)
    models = user_models(folder, ("float16", "bfloat16", "int8"))
    models["fp32 prep."] = load_model(folder, dtype="float32")  # may copy its weights in blocks
    print(f"checking k tokens in one step, GPT-2 124M shape, batch 1, at position {CONTEXT}")
    print("format     T(1) ms  " + "  ".join(f"k={k}" for k in range(2, 9)) + "   (T(k) / T(1))")
    for fmt, model in models.items():
        times: dict[int, list[float]] = {k: [] for k in range(1, 9)}
        for _ in range(rounds):
            for k in times:
                times[k].append(check_seconds(model, k, 5))
        one = statistics.median(times[1])
        ratios = "  ".join(f"{statistics.median(times[k]) / one:4.2f}" for k in range(2, 9))
        print(f"{fmt:9s} {one * 1e3:7.1f}   {ratios}")
