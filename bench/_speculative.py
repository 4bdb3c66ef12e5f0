"""`bench/generate.py --part speculative`: prompt lookup beside plain decoding, in tlm, in
Hugging Face's `generate` (`prompt_lookup_num_tokens=`) and, where llama-cpp-python is
installed or built in --work (`bench/gguf.py`), in llama.cpp (`LlamaPromptLookupDecoding`
on the model exported to GGUF f32), on the demo's model.

Batch 1, greedy, the two sides alternating in one process, medians of `rounds`. Tasks:
"grounded", a passage of the demo's validation text followed by a newline and its first 8
tokens again (the model is asked to continue a text the prompt quotes); "free", the
passage's first 8 tokens alone. tlm's acceptance is read from its sequences (tokens kept
of those drafted, and tokens per target step); both sides' outputs are checked equal to
their own plain decoding. The tokens per step prompt lookup would give with drafts of
the length the target keeps (`lookup_steps`) bound its speedup on the task, whatever a
check costs.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tlm import load_model, load_tokenizer
from tlm.generate import GenerationConfig
from tlm.generate.drafts import prompt_lookup
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


def tlm_side(
    model, decoder, prompt, new: int, lookup: bool, draft=None
) -> tuple[list[int], float, tuple]:
    """(tokens, seconds, (drafted, kept, target steps), seconds of the first step: the
    prompt's and the first token's) of one greedy decode on `Slots`."""
    config = GenerationConfig(
        max_new_tokens=new, prompt_lookup=NGRAM if lookup else None, draft_tokens=DRAFT,
        draft=draft,
    )  # fmt: skip
    slots = Slots(model, 1, decoder=decoder)
    started = time.perf_counter()
    sequence, steps, first = slots.add(prompt, config), 0, None
    while not sequence.done:
        slots.step()
        steps += 1
        first = first or time.perf_counter() - started
    seconds = time.perf_counter() - started
    return sequence.tokens, seconds, (sequence.drafted, sequence.accepted, steps), first


def hf_side(model, prompt, new: int, **extra) -> tuple[list[int], float]:
    """(tokens, seconds) of Hugging Face's greedy `generate`, `extra` its speculative
    settings (prompt_lookup_num_tokens=, assistant_model=)."""
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **extra
        )
    return out[0, len(prompt) :].tolist(), time.perf_counter() - started


def llama_side(llm, prompt: list[int], new: int) -> tuple[list[int], float]:
    """(tokens, seconds) of llama-cpp-python's greedy `generate` (with the prompt lookup
    draft `llm` was opened with, if any)."""
    started, out = time.perf_counter(), []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == new:
            break
    return out, time.perf_counter() - started


def open_llamas(run: Path, work: Path, context: int) -> dict | None:
    """llama.cpp on the demo model exported to GGUF (f32), plain and with
    `LlamaPromptLookupDecoding`; None where llama-cpp-python is neither installed nor built
    in --work (`bench/gguf.py` builds it)."""
    here = Path(__file__).resolve().parent  # bench/gguf.py would pass for the gguf package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here] + [str(here)]
    from _llama import llama_cpp

    llama = llama_cpp(work, build=False)
    if llama is None:
        return None
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from tlm.interop.gguf import export_gguf

    path = work / "demo-speculative-f32.gguf"
    path.unlink(missing_ok=True)
    export_gguf(load_model(run), load_tokenizer(run), path, "f32")
    room = context + 2 * DRAFT  # a draft may run past the last token the answer needs
    shape = {"n_ctx": room, "n_batch": room, "n_threads": 2, "n_threads_batch": 2}
    lookup = LlamaPromptLookupDecoding(max_ngram_size=NGRAM, num_pred_tokens=DRAFT)
    return {
        "plain": llama.Llama(str(path), verbose=False, **shape),
        "lookup": llama.Llama(str(path), verbose=False, draft_model=lookup, **shape),
    }


def draft_run(data: Path, work: Path) -> Path:
    """The draft model: 1 layer of d 64, rotary, 400 steps on the demo's data with its
    tokenizer (made once, kept in --work)."""
    from tlm.train import new_run_configs, open_run

    out = work / "runs" / "demo-draft"
    if not (out / "model.safetensors").is_file():
        shape = {"n_layers": 1, "d_model": 64, "n_heads": 2, "context_length": 128}
        values = {"data": str(data), "out": str(out), "max_steps": 400, "batch_size": 16}
        model_config, train_config, tokens = new_run_configs({**shape, "position": "rope"}, values)
        tokenizer = (data / "tokenizer.json").read_text()
        open_run(model_config, train_config, tokens, tokenizer, progress_bar=False).fit()
    return out


def lookup_steps(prompt: list[int], tokens: list[int]) -> int:
    """The fewest target steps prompt lookup could decode `tokens` in: each draft cut to
    the length the target keeps whole (a draft that knew its length), so every step gives
    its kept tokens and one more. Tokens over steps bounds lookup's speedup, with checks
    and drafts free."""
    steps = i = 0
    while i < len(tokens):
        draft = prompt_lookup(prompt + tokens[:i], NGRAM, min(DRAFT, len(tokens) - i - 1))
        kept = 0
        while kept < len(draft) and draft[kept] == tokens[i + kept]:
            kept += 1
        i, steps = i + kept + 1, steps + 1
    return steps


WAYS = ("plain", "lookup", "draft")  # tlm's and Hugging Face's, in the same order


def part_speculative(rounds: int, run: Path, data: Path, work: Path) -> None:
    from transformers import AutoModelForCausalLM

    if not (run / "model.safetensors").is_file():
        raise SystemExit(f"--part speculative reads the demo's model: run `tlm demo` ({run})")
    model, small = load_model(run), load_model(draft_run(data, work))
    new = min(64, model.config.context_length // 2)
    hf = {}
    for name, source in (("target", model), ("draft", small)):
        with tempfile.TemporaryDirectory() as folder:
            export_hf(source, load_tokenizer(run), folder)
            hf[name] = AutoModelForCausalLM.from_pretrained(folder).eval()
    decoder, tasks = Decoder(model), prompts(data, 8, model.config.context_length // 2 - 10)
    llamas = open_llamas(run, work, model.config.context_length)
    sides = ("tlm", "HF") if llamas is None else ("tlm", "HF", "llama.cpp")
    hf_ways = {
        "plain": {},
        "lookup": {"prompt_lookup_num_tokens": DRAFT, "max_matching_ngram_size": NGRAM},
        "draft": {"assistant_model": hf["draft"]},
    }
    print(
        f"speculative decoding, {run} ({model.num_parameters():,} parameters; the draft model "
        f"{small.num_parameters():,}), batch 1, greedy, {new} new tokens, n-gram {NGRAM}, "
        f"drafts of up to {DRAFT}; tok/s, medians; speedups over each side's plain decoding"
    )
    if llamas is None:
        print("llama.cpp: llama-cpp-python is not installed (python bench/gguf.py builds it)")
    for task, batch in tasks.items():
        rates = {(side, way): [] for side in sides for way in WAYS}
        decoding = {key: [] for key in rates}  # tokens after the first, over their time
        counts = {way: [0, 0, 0] for way in WAYS[1:]}  # drafted, kept, target steps
        fewest = 0  # lookup's fewest steps (`lookup_steps`)
        for _ in range(rounds):
            for prompt in batch:
                expected = None
                for way in WAYS:
                    draft = small if way == "draft" else None
                    tokens, seconds, stats, first = tlm_side(
                        model, decoder, prompt, new, way == "lookup", draft
                    )
                    if expected is None:
                        expected, fewest = tokens, fewest + lookup_steps(prompt, tokens)
                    assert tokens == expected, f"tlm's {way} changed its greedy tokens"
                    rates["tlm", way].append(new / seconds)
                    decoding["tlm", way].append((new - 1) / (seconds - first))
                    if way != "plain":
                        counts[way] = [a + b for a, b in zip(counts[way], stats, strict=True)]
                    _, first = hf_side(hf["target"], prompt, 1)  # the prompt and a token
                    _, seconds = hf_side(hf["target"], prompt, new, **hf_ways[way])
                    rates["HF", way].append(new / seconds)
                    decoding["HF", way].append((new - 1) / (seconds - first))
                    if llamas is not None and way in llamas:  # no draft model in its API
                        _, first = llama_side(llamas["plain"], prompt, 1)
                        _, seconds = llama_side(llamas[way], prompt, new)
                        rates["llama.cpp", way].append(new / seconds)
                        decoding["llama.cpp", way].append((new - 1) / (seconds - first))
        for label, table in (("", rates), (" (decoding: after the first token)", decoding)):
            m = {key: statistics.median(values) for key, values in table.items() if values}
            for side in sides:
                cells = [f"plain {m[side, 'plain']:7.1f}"]
                for way in (w for w in WAYS[1:] if (side, w) in m):
                    ratio = m[side, way] / m[side, "plain"]
                    cells.append(f"{way} {m[side, way]:7.1f} ({ratio:.2f}x)")
                print(f"{task:9s} {side:9s}  " + "   ".join(cells) + label)
        total = rounds * len(batch) * new
        kept = ", ".join(
            f"{way}: {k / max(d, 1):.2f} of drafted tokens kept, {total / s:.2f} a step"
            for way, (d, k, s) in counts.items()
        )
        print(f"{'':9s} tlm  {kept}")
        print(f"{'':9s}      lookup with drafts of the right length: {total / fewest:.2f} a step")


def part_self_draft(rounds: int, folder: Path) -> None:
    """The int8 self-draft (`draft=` the same checkpoint read in int8) for the fp32 and fp16
    targets, GPT-2 124M shape (random weights), batch 1, greedy, random 32-token prompts,
    64 new tokens; the two ways alternating, medians."""
    draft = load_model(folder, dtype="int8")
    print(f"int8 self-draft, GPT-2 124M shape, batch 1, greedy, 64 new, drafts of up to {DRAFT}")
    print("target     plain tok/s  with draft  speedup  kept/drafted  tok/step")
    for fmt in ("float32", "float16"):
        model = load_model(folder) if fmt == "float32" else load_model(folder, dtype=fmt)
        decoder, plain, fast = Decoder(model), [], []
        drafted = kept = steps = 0
        for round_ in range(rounds + 1):  # the first warms both up
            prompt = torch.randint(0, model.config.vocab_size, (32,)).tolist()
            tokens, seconds, _, _ = tlm_side(model, decoder, prompt, 64, False)
            same, fast_seconds, (d, k, s), _ = tlm_side(model, decoder, prompt, 64, False, draft)
            assert same == tokens, "the int8 self-draft changed the target's greedy tokens"
            if round_:
                plain.append(64 / seconds), fast.append(64 / fast_seconds)
                drafted, kept, steps = drafted + d, kept + k, steps + s
        a, b = statistics.median(plain), statistics.median(fast)
        print(f"{fmt:9s} {a:12.1f} {b:11.1f} {b / a:7.2f}x {kept / max(drafted, 1):12.2f} "
              f"{rounds * 64 / steps:9.2f}")  # fmt: skip
