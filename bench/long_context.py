"""Long context (not a test): a rotary model read past the context it was trained at, with
each of tlm's scalings (docs/long-context.md), measured by validation perplexity.

    python bench/long_context.py            # T = 64, 800 steps: about 6 minutes on 2 cores
    python bench/long_context.py --quick    # T = 32, 100 steps: a smoke test

1. The model: the demo's shape (4 layers of d 128, rotary) trained `--steps` steps at
   context T on the built-in python-stdlib corpus (byte-level BPE of 1024, prepared once
   into --work), with the demo's settings.
2. Without fine-tuning: the validation split's perplexity in non-overlapping windows of T,
   2T, 4T and 8T tokens (every token of a window scored, so a window of 4T scores 3T tokens
   past the trained context), with no scaling (the angles extrapolated) and with each
   method at factor s = the window's multiple of T (`load_model(run, rope_scaling=M,
   rope_factor=s, context_length=kT)`).
3. After a fine-tune: each method at s = 4, fine-tuned at 4T from the model for 5% of its
   pretraining steps (`tlm train --init-from`, the same data, lr 3e-4), then read at T…8T
   (past 4T with its own scaling, the window longer than s·T).

The goal (issue 54): YaRN with a fine-tune of at most 5% of the pretraining steps keeps
the perplexity at 4T within 10% of the perplexity at T.

`--part passkey`: passkey retrieval (`tlm.tasks.passkey`: a 5-digit key hidden at a depth of
filler text, asked for at the end), by length (T…8T) and depth (0, 0.5, 1), 10 keys a
cell, for a model of the same shape trained at T = 128 (`--steps`, 2000 here) on
python-stdlib mixed with 6,000 passkey texts of 0-4 filler lines (up to T: it learns the
task within its context), read with no scaling, with YaRN at s = k, and with YaRN after a
fine-tune at 4T (5% and 15% of its steps, lr 1e-3, python-stdlib with 6,000 passkey
texts of 10-21 lines, up to 4T). Both train with `--windows documents` (each window
starts at a document, so a passkey text is read whole: at random offsets a text of 110
tokens is whole in one window of 128 one time in thirteen).

`--part window`: sliding-window attention (`--attention-window`). (a) A model of the same
shape trained `--steps` steps at T = 64 with a window of W = 16, its validation
perplexity at T…8T beside the model without a window (no scaling). (b) Memory and speed
while generating T…8T tokens (greedy, from one token) with a model of 8 layers of d 512
(random weights: memory does not depend on training), T = 256, in a fresh process each:
the resident memory's rise during generation (sampled every 2 ms) and tokens/s, for the
model with a window of W = 64 (a ring of W + 64 entries), the same weights read without
a window at --context 8T (a cache of every position), and without a window at T (the
text slides past T: the last T tokens are read again at each step).

`--part llama`: the demo's model (`make demo`: rotary, T = 128) read at 4T with each method
that GGUF carries (none, linear, ntk, yarn), exported to GGUF f32 (`rope.scaling.*`) and
run by llama.cpp (llama-cpp-python, installed or built in out/bench by bench/gguf.py), on 4
validation windows of 4T: both sides' perplexity, and the largest logit difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _peers import host

from tlm import load_model, load_tokenizer
from tlm.data import TokenData, prepare
from tlm.evaluate import evaluate_tokens
from tlm.tasks.passkey import passkey_accuracy, passkey_documents
from tlm.train import new_run_configs, open_run

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("linear", "ntk", "dynamic", "yarn")
MODEL = {"n_layers": 4, "d_model": 128, "n_heads": 4, "position": "rope"}
TRAIN = {"batch_size": 16, "lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 50, "eval_interval": 100}
PASSKEYS, LINES = 6000, 4  # passkey texts mixed into the corpus, their most filler lines
FEWEST, LONG_LINES = 10, 21  # the fine-tune's passkey texts: 10-21 lines, up to 4T = 512
TUNE = {"batch_size": 16, "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 4}


def data_folder(work: Path, passkeys: bool = False) -> Path:
    """python-stdlib prepared once (BPE 1024); with `passkeys`, mixed with passkey texts."""
    folder = work / (f"data-passkey-{PASSKEYS}-{LINES}" if passkeys else "data")
    if not (folder / "meta.json").is_file():
        inputs = ["python-stdlib"]
        if passkeys:
            texts = work / "passkeys.jsonl"
            work.mkdir(parents=True, exist_ok=True)
            lines = (json.dumps({"text": t}) for t in passkey_documents(PASSKEYS, LINES, seed=0))
            texts.write_text("\n".join(lines) + "\n")
            inputs.append(str(texts))
        prepare(inputs, folder, vocab_size=1024, val_fraction=0.1, progress=False)
    return folder


def long_passkeys(work: Path, tokenizer: Path) -> Path:
    """python-stdlib mixed with passkey texts of up to LONG_LINES lines (a fine-tune at
    4T), with the tokenizer of the base's data."""
    folder = work / f"data-passkey-{PASSKEYS}-{FEWEST}-{LONG_LINES}"
    if not (folder / "meta.json").is_file():
        texts = work / f"passkeys-{FEWEST}-{LONG_LINES}.jsonl"
        documents = passkey_documents(PASSKEYS, LONG_LINES, seed=1, least_lines=FEWEST)
        texts.write_text("\n".join(json.dumps({"text": t}) for t in documents) + "\n")
        inputs = ["python-stdlib", str(texts)]
        prepare(inputs, folder, tokenizer=str(tokenizer), val_fraction=0.1, progress=False)
    return folder


def train(data: Path, out: Path, model: dict, values: dict) -> float:
    """Seconds to train a run into `out` (kept: a second call reads it)."""
    if (out / "model.safetensors").is_file():
        return 0.0
    started = time.perf_counter()
    values = {**values, "data": str(data), "out": str(out)}
    model_config, train_config, tokens = new_run_configs(model, values)
    tokenizer = load_tokenizer(data).to_json()
    open_run(model_config, train_config, tokens, tokenizer, progress_bar=False).fit()
    return time.perf_counter() - started


def perplexity(run: Path, data: Path, length: int, **scaling) -> float:
    model = load_model(run, context_length=length, **scaling)
    tokens = TokenData(data).split("val")
    token_bytes = load_tokenizer(data).token_bytes()
    with torch.no_grad():
        scores = evaluate_tokens(model, tokens, token_bytes, batch_size=8)
    return float(np.exp(scores["loss"]))


def part_passkey(work: Path, steps: int) -> None:
    T, tune = 128, max(1, steps // 20)
    data = data_folder(work, passkeys=True)
    tokenizer = load_tokenizer(data)
    aligned = {"windows": "documents"}  # each window starts at a document: a text seen whole
    base = work / "runs" / f"passkey-docs-{PASSKEYS}-{LINES}-{T}-{steps}"
    shape, values = {**MODEL, "context_length": T}, {**TRAIN, "max_steps": steps, **aligned}
    seconds = train(data, base, shape, values)
    longer = long_passkeys(work, data / "tokenizer.json")
    scaling = {"context_length": 4 * T, "rope_scaling": "yarn", "rope_factor": 4.0}
    tuned, spent = {}, {}
    for share in (5, 15):  # % of the pretraining steps
        n = steps * share // 100
        out = work / "runs" / f"passkey-docs-{FEWEST}-{LONG_LINES}-yarn-{T}-{steps}-{n}"
        values = {**TUNE, "lr": 1e-3, "min_lr": 1e-4, "max_steps": n, "init_from": str(base)}
        spent[share] = train(longer, out, {**MODEL, **scaling}, {**values, **aligned})
        tuned[share] = out
    print(
        f"passkey retrieval: trained {steps} steps at T = {T} ({seconds:.0f} s), windows at "
        f"documents' starts; YaRN fine-tunes at 4T of {tune} steps ({spent[5]:.0f} s) and "
        f"{steps * 15 // 100} ({spent[15]:.0f} s), lr 1e-3; share of 10 keys retrieved, "
        "depths 0 / 0.5 / 1"
    )
    print("  " + " " * 22 + "".join(f"{f'{k}T':>16s}" for k in (1, 2, 4, 8)))
    readings = {
        "no scaling": lambda k: load_model(base, context_length=k * T),
        "yarn, s = k": lambda k: load_model(
            base, rope_scaling="yarn", rope_factor=k, context_length=k * T
        ) if k > 1 else load_model(base),
        "yarn, fine-tuned 5%": lambda k: load_model(tuned[5], context_length=k * T),
        "yarn, fine-tuned 15%": lambda k: load_model(tuned[15], context_length=k * T),
    }  # fmt: skip
    for label, read in readings.items():
        cells = []
        for k in (1, 2, 4, 8):
            model = read(k)
            found = [passkey_accuracy(model, tokenizer, k * T, d, 10) for d in (0.0, 0.5, 1.0)]
            cells.append(" / ".join(f"{f:.1f}" for f in found))
        print(f"  {label:22s}" + "".join(f"{c:>16s}" for c in cells))


def part_llama(work: Path) -> None:
    here = Path(__file__).resolve().parent  # bench/gguf.py would pass for the gguf package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here] + [str(here)]
    from _llama import llama_cpp

    from tlm.interop.gguf import export_gguf

    llama = llama_cpp(ROOT / "out" / "bench", build=False)
    run, data = ROOT / "runs" / "demo", ROOT / "data" / "demo"
    if llama is None or not (run / "model.safetensors").is_file():
        raise SystemExit("--part llama needs `make demo` and llama-cpp-python (bench/gguf.py)")
    work.mkdir(parents=True, exist_ok=True)
    tokenizer, val = load_tokenizer(run), TokenData(data).split("val")
    n = 4 * load_model(run).config.context_length
    print(f"llama.cpp {llama.__version__} beside tlm, the demo's model at 4T = {n}, 4 windows")
    for method in ("none", "linear", "ntk", "yarn"):
        scaling = {} if method == "none" else {"rope_scaling": method, "rope_factor": 4.0}
        model = load_model(run, context_length=n, **scaling)
        path = work / f"demo-{method}.gguf"
        path.unlink(missing_ok=True)
        export_gguf(model, tokenizer, path, "f32")
        shape = {"n_ctx": n, "n_batch": n, "n_threads": 2, "logits_all": True}
        llm = llama.Llama(str(path), verbose=False, **shape)
        ours = theirs = 0.0
        largest = 0.0
        for w in range(4):
            ids = [int(t) for t in val[w * n : (w + 1) * n]]
            with torch.no_grad():
                mine = model(torch.tensor([ids]))[0].float()
            llm.reset()
            llm.eval(ids)
            other = torch.from_numpy(np.array(llm.scores[:n], dtype=np.float32))
            largest = max(largest, float((mine - other).abs().max()))
            target = torch.tensor(ids[1:])
            ours += float(F.cross_entropy(mine[:-1], target, reduction="sum"))
            theirs += float(F.cross_entropy(other[:-1], target, reduction="sum"))
        count = 4 * (n - 1)
        a, b = np.exp(ours / count), np.exp(theirs / count)
        print(f"  {method:7s} tlm {a:8.3f}  llama.cpp {b:8.3f}  ratio {b / a:.4f}  "
              f"max |logit difference| {largest:.1e}")  # fmt: skip


MEMORY_WORKER = """
import resource, sys, threading, time
import torch
from tlm import load_model
from tlm.generate import GenerationConfig, generate
torch.set_num_threads(2)
run, new, window, context = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
flags = {"attention_window": int(window)} if window != "-" else {}
model = load_model(run, context_length=int(context) if context != "-" else None, **flags)
page = resource.getpagesize()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
peak, going = [0], [True]
def watch():
    while going[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
list(generate(model, torch.tensor([[1, 2]]), GenerationConfig(max_new_tokens=8)))  # warm
before = rss()
thread = threading.Thread(target=watch)
thread.start()
started = time.perf_counter()
for step in generate(model, torch.tensor([[1]]), GenerationConfig(max_new_tokens=new)):
    pass  # each step dropped: only the decoding's own memory counts
seconds = time.perf_counter() - started
going[0] = False
thread.join()
print(max(peak[0], rss()) - before, new / seconds)
"""


def generation_memory(run: Path, new: int, window: int | None, context: int | None):
    """(MB the resident memory rose while generating `new` tokens, tokens/s), in a fresh
    process."""
    import subprocess

    flags = [str(window) if window else "-", str(context) if context else "-"]
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_WORKER, str(run), str(new), *flags],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return int(out[0]) / 2**20, float(out[1])


def part_window(work: Path, steps: int) -> None:
    T, W = 64, 16
    data, base, seconds = base_run(work, T, steps)
    windowed = work / "runs" / f"window-{W}-{T}-{steps}"
    shape = {**MODEL, "context_length": T, "attention_window": W}
    spent = train(data, windowed, shape, {**TRAIN, "max_steps": steps})
    print(
        f"(a) trained {steps} steps at T = {T} without a window ({seconds:.0f} s) and with W = "
        f"{W} ({spent:.0f} s; 0 s: read from --work); validation perplexity (ratio to the "
        "model without a window at T)"
    )
    lengths, plain = unscaled(base, data, T)
    row("no window", plain, plain[0])
    row(f"window W = {W}", [perplexity(windowed, data, n) for n in lengths], plain[0])
    T, W = 256, 64
    big = work / "runs" / "random-8x512"
    if not (big / "model.safetensors").is_file():
        from tlm import ModelConfig, TransformerLM
        from tlm.checkpoint import save_weights, write_config

        torch.manual_seed(0)
        vocab = load_tokenizer(data).vocab_size
        shape = {"n_layers": 8, "d_model": 512, "n_heads": 8, "position": "rope"}
        model = TransformerLM(ModelConfig(vocab_size=vocab, context_length=T, **shape))
        big.mkdir(parents=True, exist_ok=True)
        save_weights(big / "model.safetensors", model)
        write_config(big, model.config, {})
        load_tokenizer(data).save(big / "tokenizer.json")
    print(
        f"(b) generating n tokens, 8 layers of d 512 (random weights), T = {T}: the resident "
        "memory's rise (MB) and tokens/s, a fresh process each"
    )
    print("  " + " " * 26 + "".join(f"{f'n = {k}T':>18s}" for k in (1, 2, 4, 8)))
    readings = {
        f"window W = {W} (a ring)": (W, None),
        "no window, --context 8T": (None, 8 * T),
        "no window, slides at T": (None, None),
    }
    for label, (window, context) in readings.items():
        cells = [generation_memory(big, k * T, window, context) for k in (1, 2, 4, 8)]
        print(
            f"  {label:26s}"
            + "".join(f"{f'{mb:6.1f} MB {rate:5.0f}/s':>18s}" for mb, rate in cells)
        )


def base_run(work: Path, T: int, steps: int) -> tuple[Path, Path, float]:
    """python-stdlib's data, the rotary model trained `steps` steps at T on it (kept in
    --work), and the seconds its training took (0: read from --work)."""
    data = data_folder(work)
    base = work / "runs" / f"base-{T}-{steps}"
    seconds = train(data, base, {**MODEL, "context_length": T}, {**TRAIN, "max_steps": steps})
    return data, base, seconds


def unscaled(run: Path, data: Path, T: int) -> tuple[list[int], list[float]]:
    """The lengths T…8T, the table's header printed, and `run`'s perplexity at each."""
    lengths = [T, 2 * T, 4 * T, 8 * T]
    print("  " + " " * 22 + "  ".join(f"{f'{k}T':>15s}" for k in (1, 2, 4, 8)))
    return lengths, [perplexity(run, data, n) for n in lengths]


def row(label: str, values: list[float], first: float) -> None:
    cells = "  ".join(f"{v:8.2f} ({v / first:4.2f})" for v in values)
    print(f"  {label:22s} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 32, 100 steps")
    parser.add_argument("--steps", type=int, help="pretraining steps (800)")
    parser.add_argument("--context", type=int, help="the trained context T (64)")
    parser.add_argument("--work", default=str(ROOT / "out" / "bench" / "long-context"))
    parts = ["perplexity", "passkey", "window", "llama"]
    parser.add_argument("--part", choices=parts, default="perplexity")
    args = parser.parse_args()
    if args.part == "window":
        torch.set_num_threads(2)
        print(host())
        return part_window(Path(args.work), args.steps or (100 if args.quick else 800))
    if args.part == "llama":
        torch.set_num_threads(2)
        print(host())
        return part_llama(Path(args.work))
    if args.part == "passkey":
        torch.set_num_threads(2)
        print(host())
        return part_passkey(Path(args.work), args.steps or (100 if args.quick else 800))
    T = args.context or (32 if args.quick else 64)
    steps = args.steps or (100 if args.quick else 800)
    tune = max(1, steps // 20)  # 5% of the pretraining steps
    torch.set_num_threads(2)
    print(host())
    work = Path(args.work)
    data, base, seconds = base_run(work, T, steps)
    print(
        f"rotary model, 4 layers of d 128, trained {steps} steps at T = {T} ({seconds:.0f} s; "
        "0 s: read from --work); validation perplexity, and its ratio to the model's at T"
    )
    lengths, plain = unscaled(base, data, T)
    row("no scaling", plain, plain[0])
    for method in METHODS:
        values = [plain[0]]
        for n in lengths[1:]:
            values.append(perplexity(base, data, n, rope_scaling=method, rope_factor=n / T))
        row(f"{method}, s = k", values, values[0])
    print(f"after a fine-tune at 4T, s = 4, {tune} steps (5% of {steps}), lr 3e-4:")
    for method in METHODS:
        out = work / "runs" / f"{method}-{T}-{steps}-{tune}"
        scaling = {"context_length": 4 * T, "rope_scaling": method, "rope_factor": 4.0}
        spent = train(data, out, scaling, {**TUNE, "max_steps": tune, "init_from": str(base)})
        values = [perplexity(out, data, n) for n in lengths]
        row(f"{method} ({spent:.0f} s)", values, plain[0])
        if method == "yarn":
            ratio = values[2] / plain[0]
            verdict = "met" if ratio <= 1.10 else "not met"
            goal = f"YaRN + fine-tune at 4T / the model at T = {ratio:.3f}"
            print(f"  goal: {goal} (<= 1.10: {verdict})")


if __name__ == "__main__":
    main()
