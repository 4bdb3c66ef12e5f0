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
fine-tune at 4T (5% of its steps, the same mixture).

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
    base = work / "runs" / f"passkey-{PASSKEYS}-{LINES}-{T}-{steps}"
    seconds = train(data, base, {**MODEL, "context_length": T}, {**TRAIN, "max_steps": steps})
    tuned = work / "runs" / f"passkey-{PASSKEYS}-{LINES}-yarn-{T}-{steps}-{tune}"
    scaling = {"context_length": 4 * T, "rope_scaling": "yarn", "rope_factor": 4.0}
    spent = train(data, tuned, scaling, {**TUNE, "max_steps": tune, "init_from": str(base)})
    print(
        f"passkey retrieval: trained {steps} steps at T = {T} ({seconds:.0f} s), YaRN fine-tune "
        f"{tune} steps at 4T ({spent:.0f} s); share of 10 keys retrieved, depths 0 / 0.5 / 1"
    )
    print("  " + " " * 22 + "".join(f"{f'{k}T':>16s}" for k in (1, 2, 4, 8)))
    readings = {
        "no scaling": lambda k: load_model(base, context_length=k * T),
        "yarn, s = k": lambda k: load_model(
            base, rope_scaling="yarn", rope_factor=k, context_length=k * T
        ) if k > 1 else load_model(base),
        "yarn, fine-tuned": lambda k: load_model(tuned, context_length=k * T),
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


def row(label: str, values: list[float], first: float) -> None:
    cells = "  ".join(f"{v:8.2f} ({v / first:4.2f})" for v in values)
    print(f"  {label:22s} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 32, 100 steps")
    parser.add_argument("--steps", type=int, help="pretraining steps (800)")
    parser.add_argument("--context", type=int, help="the trained context T (64)")
    parser.add_argument("--work", default=str(ROOT / "out" / "bench" / "long-context"))
    parser.add_argument("--part", choices=["perplexity", "passkey", "llama"], default="perplexity")
    args = parser.parse_args()
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
    data = data_folder(work)
    base = work / "runs" / f"base-{T}-{steps}"
    seconds = train(data, base, {**MODEL, "context_length": T}, {**TRAIN, "max_steps": steps})
    print(
        f"rotary model, 4 layers of d 128, trained {steps} steps at T = {T} ({seconds:.0f} s; "
        "0 s: read from --work); validation perplexity, and its ratio to the model's at T"
    )
    lengths = [T, 2 * T, 4 * T, 8 * T]
    print("  " + " " * 22 + "  ".join(f"{f'{k}T':>15s}" for k in (1, 2, 4, 8)))
    plain = [perplexity(base, data, n) for n in lengths]
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
