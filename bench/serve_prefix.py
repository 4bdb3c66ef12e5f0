"""The prefix cache's scenarios (`python bench/serve.py --part prefix`): the engine behind `tlm
serve` with its prefix cache (the default size) against the same engine without (0 bytes),
on the same model and requests, in turns.

1. conversation: one client, 10 turns; each turn sends the conversation so far and 60 new
   tokens, and gets 60 back (greedy, no early stop). TTFT of each turn with and without the
   cache. The 10th turn's prompt is 1,140 tokens: past GPT-2's 1,024 positions, so the
   model here has 2,304 (the 124M shape otherwise; a token's work is the same). Each
   side holds two conversations, in turns; a turn's TTFT is the better of its two.
2. shared system prompt: 8 clients at once, each a 400-token system prompt shared by all
   and 16 tokens of its own, 64 new tokens each, on 8 slots: prefill tokens the engine
   computed (`Slots.prefilled`), aggregate tok/s, TTFT.
3. arrival (chunked prefill): 7 streams of 128 new tokens decode; after their 8th token a
   2,000-token prompt arrives (8 new tokens). The streams' inter-token latency, median and
   p99, and the long prompt's TTFT, for each `--prefill-chunk` (0: the whole prompt in one
   step). The model here has 2,304 positions.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from serve import StubTokenizer, off_main, pct, together

from tlm.generate import GenerationConfig
from tlm.serve.engine import Engine, Job

TURNS, TURN_IN, TURN_OUT, ROUNDS = 10, 60, 60, 2
CLIENTS, SYSTEM, OWN, NEW = 8, 400, 16, 64


def ask(engine: Engine, ids: list[int], new: int) -> tuple[float, float, list[int]]:
    """One request, waited for: (TTFT, seconds in all, its tokens)."""
    done, times, tokens = threading.Event(), [], []

    def deliver(event) -> None:
        if event is None:
            done.set()
        else:
            times.append(time.perf_counter())
            tokens.append(event.token)

    job = Job(ids, GenerationConfig(max_new_tokens=new), deliver)
    engine.submit(job)
    done.wait()
    return times[0] - job.created, times[-1] - job.created, tokens


def conversation(model, vocab: int, cache: int | None) -> tuple[list[float], list[list[int]]]:
    """Each turn's TTFT and reply, with a prefix cache of `cache` bytes (None: the default)."""
    engine = Engine(model, StubTokenizer(), slots=1, max_queue=1, prefix_cache=cache)
    ask(engine, [1, 2, 3], 2)  # warm up, on an unrelated prompt
    rng, text, ttfts, replies = random.Random(3), [], [], []
    for _ in range(TURNS):
        text += [rng.randrange(vocab) for _ in range(TURN_IN)]
        first, _, reply = ask(engine, text, TURN_OUT)
        ttfts.append(first)
        replies.append(reply)
        text += reply
    engine.close()
    return ttfts, replies


def part_conversation(model, vocab: int) -> None:
    print(
        f"5. conversation: {TURNS} turns of {TURN_IN} tokens in, {TURN_OUT} out (greedy); each "
        f"turn's best TTFT of {ROUNDS} conversations a side, in turns"
    )
    plain = cached = [float("inf")] * TURNS
    for _ in range(ROUNDS):
        ttfts, plain_replies = conversation(model, vocab, 0)
        plain = [min(a, b) for a, b in zip(plain, ttfts, strict=True)]
        ttfts, cached_replies = conversation(model, vocab, None)
        cached = [min(a, b) for a, b in zip(cached, ttfts, strict=True)]
    same = "the same replies" if cached_replies == plain_replies else "REPLIES DIFFER"
    print("   turn  prompt  TTFT ms: without   with   ratio")
    for turn in range(TURNS):
        length = (turn + 1) * TURN_IN + turn * TURN_OUT
        print(
            f"   {turn + 1:4d} {length:7d} {plain[turn] * 1e3:16.0f} {cached[turn] * 1e3:6.0f} "
            f"{plain[turn] / cached[turn]:6.2f}x"
        )
    print(
        f"   turn {TURNS}: {plain[-1] / cached[-1]:.1f}x lower with the cache (goal >= 5x), "
        f"{cached[-1] / cached[0]:.2f}x turn 1's TTFT (goal <= 1.2x); {same}"
    )


def shared(model, vocab: int, cache: int | None) -> tuple[float, list[float], int, list]:
    """8 clients at once, one system prompt: (seconds, TTFTs, prefill tokens, replies)."""
    rng = random.Random(4)
    system = [rng.randrange(vocab) for _ in range(SYSTEM)]
    prompts = [system + [rng.randrange(vocab) for _ in range(OWN)] for _ in range(CLIENTS)]
    engine = Engine(model, StubTokenizer(), CLIENTS, CLIENTS, prefix_cache=cache)
    ask(engine, [1, 2, 3], 2)  # warm up, on an unrelated prompt
    before = engine.slots.prefilled
    results: list = [None] * CLIENTS
    started = time.perf_counter()

    def client(i: int) -> None:
        results[i] = ask(engine, prompts[i], NEW)

    together(client, [(i,) for i in range(CLIENTS)])
    seconds = time.perf_counter() - started
    prefilled = engine.slots.prefilled - before
    engine.close()
    return seconds, [r[0] for r in results], prefilled, [r[2] for r in results]


def part_shared(model, vocab: int) -> None:
    print(
        f"6. shared system prompt: {CLIENTS} clients at once, {SYSTEM} shared + {OWN} own "
        f"tokens, {NEW} new each, {CLIENTS} slots"
    )
    print("   cache    seconds   tok/s   prefill tokens   TTFT p50/max ms")
    rows = {}
    for name, cache in (("without", 0), ("with", None)):
        seconds, ttfts, prefilled, replies = shared(model, vocab, cache)
        rows[name] = (seconds, prefilled, replies)
        print(
            f"   {name:7s} {seconds:8.2f} {CLIENTS * NEW / seconds:7.1f} {prefilled:16d}   "
            f"{pct(ttfts, 50):6.0f} / {max(ttfts) * 1e3:6.0f}"
        )
    (slow, plain, a), (fast, cached, b) = rows["without"], rows["with"]
    print(
        f"   prefill computed with / without: {cached / plain:.2f} (goal <= 0.25); tok/s "
        f"{slow / fast:.2f}x (goal >= 1.5x); {'the same replies' if a == b else 'REPLIES DIFFER'}"
    )


STREAMS, STREAM_NEW, LONG, LONG_NEW, CHUNKS = 7, 128, 2000, 8, (0, 16, 32, 64, 128)


def arrival(model, vocab: int, chunk: int) -> tuple[list[float], float]:
    """The streams' gaps between tokens, and the long prompt's TTFT, with `chunk`."""
    rng = random.Random(5)
    engine = Engine(model, StubTokenizer(), STREAMS + 1, STREAMS + 1, prefill_chunk=chunk or None)
    ask(engine, [1, 2, 3], 2)  # warm up
    times: list[list[float]] = [[] for _ in range(STREAMS)]
    started = threading.Event()

    def stream(i: int) -> None:
        def deliver(event) -> None:
            if event is not None:
                times[i].append(time.perf_counter())
                if i == 0 and len(times[0]) == 8:
                    started.set()
            else:
                done.set()

        done = threading.Event()
        ids = [rng.randrange(vocab) for _ in range(32)]
        engine.submit(Job(ids, GenerationConfig(max_new_tokens=STREAM_NEW), deliver))
        done.wait()

    def long_prompt() -> None:
        started.wait()
        ttft.append(ask(engine, [rng.randrange(vocab) for _ in range(LONG)], LONG_NEW)[0])

    ttft: list[float] = []
    together(lambda f, *a: f(*a), [(stream, i) for i in range(STREAMS)] + [(long_prompt,)])
    engine.close()
    gaps = [b - a for t in times for a, b in zip(t[:-1], t[1:], strict=True)]
    return gaps, ttft[0]


def part_arrival(model, vocab: int) -> None:
    print(
        f"7. arrival: {STREAMS} streams of {STREAM_NEW} new tokens; a {LONG}-token prompt "
        f"arrives after their 8th"
    )
    print("   chunk   ITL p50 ms   p99 ms   p99/p50   max ms   long prompt's TTFT s")
    for chunk in CHUNKS:
        gaps, ttft = arrival(model, vocab, chunk)
        p50, p99 = pct(gaps, 50), pct(gaps, 99)
        print(
            f"   {chunk or 'whole':>5} {p50:11.1f} {p99:8.1f} {p99 / p50:8.2f}x "
            f"{max(gaps) * 1e3:8.0f} {ttft:15.2f}"
        )
    print("   (goal: the streams' p99 <= 2.5x their median)")


def part_llama(config, work: Path, threads: int) -> None:
    """Part 5's conversation against llama.cpp (`llama-cpp-python`'s `Llama.generate`, which
    keeps its context's tokens and evaluates only what a prompt adds after the longest
    prefix they share: llama.cpp's prompt cache) on the f32 GGUF export of the same random
    weights; each side goes on with its own replies (the prompts' lengths are the same)."""
    from pydoc_data.topics import topics

    from _llama import llama_cpp

    from tlm import TransformerLM
    from tlm.inference import for_inference
    from tlm.interop.gguf import export_gguf
    from tlm.tokenizer import train_tokenizer

    here = Path(__file__).resolve().parent  # bench/gguf.py: the gguf package comes first
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here] + [str(here)]
    llama = llama_cpp(work)
    torch.manual_seed(0)
    model = TransformerLM(replace(config, position="learned"))
    path = work / "gguf" / f"gpt2-124m-{config.context_length}-f32.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    export_gguf(model, train_tokenizer("bpe", list(topics.values()), 1024), path, "f32")
    T = config.context_length
    llm = llama.Llama(
        str(path), n_ctx=T, n_batch=T, n_threads=threads, n_threads_batch=threads, verbose=False
    )  # fmt: skip
    theirs = [float("inf")] * TURNS
    ours = [float("inf")] * TURNS
    packed = off_main(lambda: for_inference(model, "float32"))
    for _ in range(ROUNDS):  # in turns
        ours = [
            min(a, b)
            for a, b in zip(ours, conversation(packed, config.vocab_size, None)[0], strict=True)
        ]
        theirs = [
            min(a, b)
            for a, b in zip(theirs, llama_conversation(llm, config.vocab_size), strict=True)
        ]
    print(f"8. conversation against llama.cpp {llama.__version__} (f32 GGUF, its prompt cache)")
    print("   turn  TTFT ms: llama.cpp   tlm   llama.cpp / tlm")
    for turn, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        print(f"   {turn + 1:4d} {a * 1e3:18.0f} {b * 1e3:5.0f} {a / b:9.2f}x")
    a, b = theirs[-1] * 1e3, ours[-1] * 1e3
    print(f"   turn {TURNS}: tlm {b:.0f} ms, llama.cpp {a:.0f} ms (goal: tlm's <= llama.cpp's)")


def llama_conversation(llm, vocab: int) -> list[float]:
    """Part 5's turns on llama.cpp: each turn's TTFT (greedy, its own replies)."""
    llm.reset()
    rng, text, ttfts = random.Random(3), [], []
    for _ in range(TURNS):
        text += [rng.randrange(vocab) for _ in range(TURN_IN)]
        started, reply = time.perf_counter(), []
        for token in llm.generate(text, temp=0.0, top_k=1, top_p=1.0, min_p=0.0):
            if not reply:
                ttfts.append(time.perf_counter() - started)
            reply.append(token)
            if len(reply) == TURN_OUT:
                break
        text += reply
    return ttfts
