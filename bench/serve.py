"""Serving benchmark (not a test): the continuous-batching engine behind `tlm serve`.

    nice python bench/serve.py             # GPT-2 124M shape, about 6 minutes on 2 CPU cores
    python bench/serve.py --quick          # a 2-layer, d=64 model: a smoke test in seconds

Random weights of the GPT-2 124M shape, fp32 prepacked (`for_inference(model, "float32")`), two
torch threads, greedy decoding of random 32-token prompts with no early stop. Requests go
through `Engine` (one thread stepping `Slots`, as `tlm serve` runs it) with no HTTP in
between; the tokenizer is a stub whose `decode` gives one "x" per token, since the engine
needs text only to stream it. Times are `time.perf_counter`, taken in each job's `deliver`
callback (the engine thread), from the moment the job is submitted. The model is built,
and runs, off the Python main thread throughout, each time on a thread that ends before the
next starts, as `tlm serve` loads its model in its engine thread: OpenMP keeps a pool of
workers per thread that has run torch's parallel work, and a second pool on two cores costs
a quiet machine a quarter to a third of its batch-1 speed (docs/benchmarks-history.md, "Goal 5").

1. clients: 1, 8 and 32 clients (as many slots), each submitting a request of 64 new
   tokens, waiting for it to end, and repeating; aggregate tok/s, time to first token
   (TTFT) and inter-token latency (ITL) percentiles.
2. mixed: 64 requests of 8/16/32/128 new tokens (drawn with seeds 0, 1, 2) on 8 slots, all
   submitted at once to the engine (a request joins as a row frees) against static batches
   of 8 on `Slots` (a batch runs until its longest request ends before the next starts);
   each schedule runs twice, in turns, and its better time counts (other processes share
   this machine's cores); the ratio of the two schedules' step counts is what a draw can
   gain at most, if a step costs the same with any number of rows. (With only 16
   requests, two batches, the last long request dominates both: the bound was 1.1-1.5x.)
3. join: TTFT of a request that arrives while 7 long ones decode, against one 7-row decode
   step plus the request's prefill alone (and the time of a step the request joins).
4. speculative (`--part speculative`, not in the default run): part 1's clients (1, 2 and
   4) against an engine with `speculate={"draft": "int8"}` (`tlm serve --draft int8`: a
   request decoding alone checks the int8 self-draft's tokens, busy batches take plain
   steps), the two engines in turns, the better of `--rounds` each.
5-7. the prefix cache and chunked prefill (`--part prefix`, in the default run too): a
   10-turn conversation's TTFT and 8 clients sharing a system prompt, with and without
   the cache; 7 streams' inter-token latency while a long prompt arrives, by
   `--prefill-chunk` (`serve_prefix.py`).
8. `--part llama`: part 5's conversation beside llama.cpp (llama-cpp-python, built once
   into --work) on the f32 GGUF export of the same weights.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tlm import ModelConfig, TransformerLM
from tlm.generate import GenerationConfig
from tlm.generate.slots import Slots
from tlm.inference import for_inference
from tlm.serve.engine import Engine, Job

PROMPT = 32
GPT2 = {"vocab_size": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "context_length": 1024}
TINY = {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 2, "context_length": 256}


class StubTokenizer:
    """All the engine asks of a tokenizer: one "x" per token (no 50257-id vocabulary needed)."""

    eot_id = 0

    def decode(self, ids: list[int]) -> str:
        return "x" * len(ids)


def prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(PROMPT)]


def run_job(engine: Engine, ids: list[int], new: int) -> list[float]:
    """Submit one request and wait for it: [submit time, then the time of each token]."""
    done, times = threading.Event(), []

    def deliver(event) -> None:
        if event is None:
            done.set()
        else:
            times.append(time.perf_counter())

    job = Job(ids, GenerationConfig(max_new_tokens=new), deliver)
    times.append(job.created)
    engine.submit(job)
    done.wait()
    return times


def client(engine: Engine, seed: int, requests: int, vocab: int, new: int, results) -> None:
    """One client: a request, wait for its end, the next."""
    rng = random.Random(seed)
    for _ in range(requests):
        results.append(run_job(engine, prompt(rng, vocab), new))


def together(target, calls: list[tuple]) -> None:
    """Run target(*args) for every args in `calls` at once, each in a thread; wait for all."""
    threads = [threading.Thread(target=target, args=args) for args in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def off_main(fn, *args):
    """fn(*args) in a new thread, as the engine runs the model (see the module docstring)."""
    out = []
    together(lambda: out.append(fn(*args)), [()])
    return out[0]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3  # ms


def part_clients(model, vocab: int, requests: int, new: int) -> None:
    print(f"1. clients: each sends {requests} x (prompt {PROMPT}, {new} new), one at a time")
    print("   clients  slots   tok/s   TTFT p50/p99 ms   ITL p50/p99 ms   wall s")
    rates = {}
    for clients in (1, 8, 32):
        engine = Engine(model, StubTokenizer(), slots=clients, max_queue=clients)
        run_job(engine, prompt(random.Random(-1), vocab), 2)  # warm up
        results: list[list[float]] = []
        started = time.perf_counter()
        together(client, [(engine, c, requests, vocab, new, results) for c in range(clients)])
        wall = time.perf_counter() - started
        engine.close()
        tokens = sum(len(times) - 1 for times in results)
        ttft = [times[1] - times[0] for times in results]
        itl = [gap for times in results for gap in np.diff(times[1:])]
        rates[clients] = tokens / wall
        print(
            f"   {clients:7d} {clients:6d} {rates[clients]:7.1f}   "
            f"{pct(ttft, 50):6.0f} / {pct(ttft, 99):6.0f}  "
            f"{pct(itl, 50):6.1f} / {pct(itl, 99):6.1f}  {wall:7.1f}"
        )
    print(f"   8 clients / 1 client throughput: {rates[8] / rates[1]:.2f}x (goal >= 3.5x)")


def part_mixed(model, vocab: int, mixes: int, count: int, rounds: int, slots: int = 8) -> None:
    print(
        f"2. mixed: {count} requests of 8/16/32/128 new tokens, {slots} slots, seeds 0-{mixes - 1}"
        f" (each schedule's best of {rounds}, taken in turns)"
    )
    print("  seed  tokens  continuous s  tok/s   static s  tok/s   ratio  steps static/continuous")
    ratios = []
    for mix in range(mixes):
        rng = random.Random(mix)
        lengths = [rng.choice([8, 16, 32, 128]) for _ in range(count)]
        prompts = [prompt(rng, vocab) for _ in lengths]
        tokens = sum(lengths)
        continuous = static = float("inf")
        for _ in range(rounds):  # in turns, so that a busy spell on the machine hits both
            continuous = min(continuous, engine_batches(model, prompts, lengths, slots))
            static = min(static, off_main(static_batches, model, prompts, lengths, slots))
        ratios.append(static / continuous)
        # steps each schedule needs (a step costs about the same with any number of rows)
        rows = [0] * slots
        for new in lengths:  # a request takes the row that frees first
            rows[rows.index(min(rows))] += new
        groups = sum(max(lengths[lo : lo + slots]) for lo in range(0, count, slots))
        print(
            f"   {mix:3d} {tokens:7d} {continuous:10.2f} {tokens / continuous:7.1f} "
            f"{static:10.2f} {tokens / static:6.1f}  {ratios[-1]:5.2f}x  "
            f"{groups} / {max(rows)} steps = {groups / max(rows):.2f}x"
        )
    print(f"   continuous / static, median: {statistics.median(ratios):.2f}x (goal >= 1.5x)")


def engine_batches(model, prompts: list[list[int]], lengths: list[int], slots: int) -> float:
    """Seconds for the engine to run the requests, all submitted at once (continuous)."""
    engine = Engine(model, StubTokenizer(), slots=slots, max_queue=len(prompts))
    run_job(engine, prompts[0], 2)  # warm up
    started = time.perf_counter()
    together(run_job, [(engine, ids, new) for ids, new in zip(prompts, lengths, strict=True)])
    seconds = time.perf_counter() - started
    engine.close()
    return seconds


def static_batches(model, prompts: list[list[int]], lengths: list[int], slots: int) -> float:
    """Seconds to run the requests in groups of `slots`, each group until its longest ends."""
    batch = Slots(model, slots)
    started = time.perf_counter()
    for lo in range(0, len(prompts), slots):
        for ids, new in zip(prompts[lo : lo + slots], lengths[lo : lo + slots], strict=True):
            batch.add(ids, GenerationConfig(max_new_tokens=new))
        while not batch.idle():
            batch.step()
    return time.perf_counter() - started


def alone(model, vocab: int, rng: random.Random, busy: int, repeats: int) -> tuple[float, ...]:
    """Median seconds of one `busy`-row decode step, of one such step with a prompt joining,
    and of one prompt's prefill on its own."""
    steps, joined, prefills = [], [], []
    batch = Slots(model, busy + 1)
    for _ in range(busy):
        batch.add(prompt(rng, vocab), GenerationConfig(max_new_tokens=2 * repeats + 3))
    batch.step()  # the prefill of the `busy` rows
    for _ in range(repeats + 2):
        started = time.perf_counter()
        batch.step()
        steps.append(time.perf_counter() - started)
        batch.add(prompt(rng, vocab), GenerationConfig(max_new_tokens=1))  # in and out
        started = time.perf_counter()
        batch.step()
        joined.append(time.perf_counter() - started)
    single = Slots(model, 1)
    for _ in range(repeats):
        single.add(prompt(rng, vocab), GenerationConfig(max_new_tokens=1))
        started = time.perf_counter()
        single.step()
        prefills.append(time.perf_counter() - started)
    return statistics.median(steps), statistics.median(joined), statistics.median(prefills)


def part_join(model, vocab: int, repeats: int, long: int) -> None:
    rng = random.Random(1)
    busy = 7
    step, joined, prefill = off_main(alone, model, vocab, rng, busy, repeats)

    # busy: 7 long requests decode in the engine while single requests arrive one by one
    engine = Engine(model, StubTokenizer(), slots=busy + 1, max_queue=busy + 1)
    run_job(engine, prompt(rng, vocab), 2)  # warm up
    longs = [Job(prompt(rng, vocab), GenerationConfig(max_new_tokens=long), lambda e: None)]
    longs += [Job(prompt(rng, vocab), longs[0].config, lambda e: None) for _ in range(busy - 1)]
    for job in longs:
        engine.submit(job)
    while engine.busy < busy or not all(c.last for j in longs for c in j.choices):
        time.sleep(0.01)
    ttfts, busy_then = [], []
    for _ in range(repeats):
        time.sleep(rng.uniform(0, 2 * step))  # arrive anywhere within a step
        busy_then.append(engine.busy)
        times = run_job(engine, prompt(rng, vocab), 1)
        ttfts.append(times[1] - times[0])
    still = min(busy_then + [engine.busy])
    for job in longs:
        engine.cancel(job)
    engine.close()
    print(f"3. join: a new request (prompt {PROMPT}) while {busy} long ones decode")
    expected = (step + prefill) * 1e3
    print(f"   alone: 7-row decode step {step * 1e3:.1f} ms + prefill {prefill * 1e3:.1f} ms")
    print(f"          = {expected:.1f} ms; the step with the prompt joining: {joined * 1e3:.1f} ms")
    print(
        f"   busy engine TTFT: median {statistics.median(ttfts) * 1e3:.1f} ms, max "
        f"{max(ttfts) * 1e3:.1f} ms ({repeats} arrivals, at least {still} rows busy throughout)"
    )


def part_speculative(model, vocab: int, requests: int, new: int, rounds: int) -> None:
    print(f"4. speculative: clients as in 1 ({requests} x {new} new), plain engine against")
    print("   `--draft int8` (rows decoding alone draft; greedy, random weights)")
    print("   clients   plain tok/s   draft tok/s   ratio   drafted  kept  checks")
    for clients in (1, 2, 4):
        best, counts = {}, (0, 0, 0)
        for _ in range(rounds):
            for speculate in (None, {"draft": "int8"}):
                engine = Engine(model, StubTokenizer(), clients, clients, speculate=speculate)
                run_job(engine, prompt(random.Random(-1), vocab), 8)  # warm up (and pack)
                before = (engine.slots.drafted, engine.slots.accepted, engine.slots.checks)
                results: list[list[float]] = []
                started = time.perf_counter()
                calls = [(engine, c, requests, vocab, new, results) for c in range(clients)]
                together(client, calls)
                rate = sum(len(times) - 1 for times in results) / (time.perf_counter() - started)
                engine.close()
                key = "draft" if speculate else "plain"
                best[key] = max(best.get(key, 0.0), rate)
                if speculate:
                    after = (engine.slots.drafted, engine.slots.accepted, engine.slots.checks)
                    counts = tuple(a - b for a, b in zip(after, before, strict=True))
        print(
            f"   {clients:7d} {best['plain']:13.1f} {best['draft']:13.1f} "
            f"{best['draft'] / best['plain']:6.2f}x  {counts[0]:8d} {counts[1]:5d} {counts[2]:7d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer, d=64 model")
    parser.add_argument("--requests", type=int, default=3, help="requests per client (part 1)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request (part 1)")
    parser.add_argument("--mixes", type=int, default=3, help="workloads drawn (part 2)")
    parser.add_argument("--count", type=int, default=64, help="requests per workload (part 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each schedule (part 2)")
    parser.add_argument("--repeats", type=int, default=7, help="arrivals measured (part 3)")
    parts = ["all", "speculative", "prefix", "llama"]  # llama: part 5 beside llama.cpp (8)
    parser.add_argument("--part", choices=parts, default="all")
    parser.add_argument("--work", type=Path, default=Path(__file__).parent.parent / "out/bench")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    shape = TINY if args.quick else GPT2
    if args.part in ("all", "prefix", "llama"):  # a 2,000-token prompt and its reply (part 7)
        shape = shape | {"context_length": 2304}
    config = ModelConfig(**shape, activation="gelu_tanh")  # built off the main thread, as below
    model = off_main(lambda: for_inference(TransformerLM(config), "float32"))
    name = "tiny (2 layers, d=64)" if args.quick else "GPT-2 124M shape"
    print(f"{name}, fp32 prepacked, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average {os.getloadavg()[0]:.2f} (other processes share these cores)")
    started = time.perf_counter()
    if args.part == "llama":
        from serve_prefix import part_llama

        part_llama(config, args.work, torch.get_num_threads())
        return
    if args.part == "speculative":
        part_speculative(model, shape["vocab_size"], args.requests, args.new, args.rounds)
        print(f"total {time.perf_counter() - started:.0f} s")
        return
    if args.part == "all":
        part_clients(model, shape["vocab_size"], args.requests, args.new)
        part_mixed(model, shape["vocab_size"], args.mixes, args.count, args.rounds)
        long = shape["context_length"] - PROMPT - 8
        part_join(model, shape["vocab_size"], args.repeats, long)
    from serve_prefix import part_arrival, part_conversation, part_shared  # uses this file

    part_conversation(model, shape["vocab_size"])
    part_shared(model, shape["vocab_size"])
    part_arrival(model, shape["vocab_size"])
    wall = time.perf_counter() - started
    print(f"total {wall:.0f} s, load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
