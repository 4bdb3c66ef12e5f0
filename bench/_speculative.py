"""`bench/generate.py --part speculative`: prompt lookup beside plain decoding, in tlm and in
Hugging Face's `generate` (`prompt_lookup_num_tokens=`), on the demo's model.

Batch 1, greedy, the two sides alternating in one process, medians of `rounds`. Tasks:
"grounded", a passage of the demo's validation text followed by a newline and its first 8
tokens again (the model is asked to continue a text the prompt quotes); "free", the
passage's first 8 tokens alone. tlm's acceptance is read from its sequences (tokens kept
of those drafted, and tokens per target step); both sides' outputs are checked equal to
their own plain decoding.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tlm import load_model, load_tokenizer
from tlm.generate import GenerationConfig
from tlm.generate.slots import Slots
from tlm.inference import Decoder
from tlm.kinds import export_hf

NGRAM, DRAFT = 3, 6  # the n-gram matched, the tokens proposed (both sides)


def prompts(data: Path, count: int, passage: int) -> dict[str, list[list[int]]]:
    """`count` prompts of each task, from passages of `passage` tokens of data's val.bin."""
    ids = np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64)
    newline = load_tokenizer(data).encode("\n")
    starts = np.linspace(0, len(ids) - passage - 1, count).astype(int)
    texts = [ids[s : s + passage].tolist() for s in starts]
    return {
        "grounded": [text + newline + text[:8] for text in texts],
        "free": [text[:8] for text in texts],
    }


def tlm_side(model, decoder, prompt, new: int, lookup: bool) -> tuple[list[int], float, tuple]:
    """(tokens, seconds, (drafted, kept, target steps)) of one greedy decode on `Slots`."""
    config = GenerationConfig(
        max_new_tokens=new, prompt_lookup=NGRAM if lookup else None, draft_tokens=DRAFT
    )
    slots = Slots(model, 1, decoder=decoder)
    started = time.perf_counter()
    sequence, steps = slots.add(prompt, config), 0
    while not sequence.done:
        slots.step()
        steps += 1
    seconds = time.perf_counter() - started
    return sequence.tokens, seconds, (sequence.drafted, sequence.accepted, steps)


def hf_side(model, prompt, new: int, lookup: bool) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    extra = {"prompt_lookup_num_tokens": DRAFT, "max_matching_ngram_size": NGRAM} if lookup else {}
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **extra
        )
    return out[0, len(prompt) :].tolist(), time.perf_counter() - started


def part_speculative(rounds: int, run: Path, data: Path) -> None:
    from transformers import AutoModelForCausalLM

    if not (run / "model.safetensors").is_file():
        raise SystemExit(f"--part speculative reads the demo's model: run `tlm demo` ({run})")
    model = load_model(run)
    new = min(64, model.config.context_length // 2)
    with tempfile.TemporaryDirectory() as folder:
        export_hf(model, load_tokenizer(run), folder)
        theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
    decoder, tasks = Decoder(model), prompts(data, 8, model.config.context_length // 2 - 10)
    print(
        f"speculative decoding, {run} ({model.num_parameters():,} parameters), batch 1, "
        f"greedy, {new} new tokens, n-gram {NGRAM}, {DRAFT} drafted"
    )
    print(
        "task       tlm plain  tlm lookup  speedup  kept/drafted  tok/step   HF plain  "
        "HF lookup  speedup   (tok/s, medians)"
    )
    for task, batch in tasks.items():
        rates = {name: [] for name in ("tlm", "tlm lookup", "hf", "hf lookup")}
        drafted = kept = steps = tokens = 0
        for _ in range(rounds):
            for prompt in batch:
                plain, seconds, _ = tlm_side(model, decoder, prompt, new, False)
                rates["tlm"].append(new / seconds)
                fast, seconds, (d, k, s) = tlm_side(model, decoder, prompt, new, True)
                assert fast == plain, "prompt lookup changed tlm's greedy tokens"
                rates["tlm lookup"].append(new / seconds)
                drafted, kept, steps, tokens = drafted + d, kept + k, steps + s, tokens + new
                hf_plain, seconds = hf_side(theirs, prompt, new, False)
                rates["hf"].append(new / seconds)
                hf_fast, seconds = hf_side(theirs, prompt, new, True)
                rates["hf lookup"].append(new / seconds)
        m = {name: statistics.median(values) for name, values in rates.items()}
        print(
            f"{task:9s} {m['tlm']:10.1f} {m['tlm lookup']:11.1f} "
            f"{m['tlm lookup'] / m['tlm']:7.2f}x {kept / max(drafted, 1):12.2f} "
            f"{tokens / steps:9.2f} {m['hf']:10.1f} {m['hf lookup']:10.1f} "
            f"{m['hf lookup'] / m['hf']:7.2f}x"
        )
