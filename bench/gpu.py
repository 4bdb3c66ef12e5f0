"""What a lent GPU is for (not a test; CI has no GPU): decoding and training figures on CUDA.

    python bench/gpu.py --part decode   # issue 26: CUDA-graph decoding against transformers
    python bench/gpu.py --part mfu      # issue 33: GPT-2 124M shape, bf16, compiled: MFU
    python bench/gpu.py --part recipe   # issue 33: Shakespeare-char on a GPU: time to 1.47

decode: GPT-2 124M shape, random weights, greedy, a 32-token prompt, 128 new tokens, no
early stop; tlm's `generate` (each step one replay of a CUDA graph, and with
`cuda_graph=False` the step's kernels launched one by one) against `transformers`'
`generate`, alternating, medians of 3; `torch.cuda.synchronize()` around each generation.

mfu: `tlm train` on the GPT-2 124M shape (12 layers, d 768, context 1024, vocabulary
50304) over a corpus that fills such a vocabulary: the Python sources of the installed
`transformers`' models (~10M tokens, prepared in the run), `--precision auto` (bf16 autocast on
CUDA), compiled and not; tokens/s from the training clock between two log
lines after the compilation, × training FLOPs a token (6N plus attention,
`flops_per_token`), over the bf16 matmul peak measured here (8192³).

recipe: nanoGPT's Shakespeare-char GPU settings (6 layers, d 384, context 256, batch 64,
dropout 0.2, lr 1e-3 -> 1e-4 over 5000 steps), the same with rotary positions, and tlm's
budget flags at the same size, each compiled and eager; each run is watched and stopped at
its first validation (whole split) <= 1.47 or after --limit seconds: the wall time from
launch (the compilation counted) and the training clock at that point are printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch
from _decoding import GPT2, PROMPT, hf_gpt2, hf_rate, timed, tlm_gpt2, tlm_rate

from tlm import ModelConfig, TransformerLM
from tlm.generate import generate
from tlm.inference import Decoder

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda")


def part_decode(rounds: int = 3, new: int = 128) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"GPT-2 124M shape, greedy, prompt {PROMPT}, {new} new tokens; tok/s, medians")
    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = tlm_gpt2().to("cuda", dtype), hf_gpt2().to("cuda", dtype)
        ids = torch.randint(0, GPT2["vocab_size"], (2, PROMPT), device="cuda")
        graphed, stepped = (
            torch.stack([s.tokens for s in generate(ours, ids, max_new_tokens=64, cuda_graph=g)])
            for g in (True, False)
        )
        same = "identical" if torch.equal(graphed, stepped) else "DIFFERENT"
        print(f"{str(dtype)[6:]}: graphed and step-by-step tokens {same} (2 x 64 greedy)")
        for batch in (1, 8):
            decoder = Decoder(ours)  # keeps the recorded step from one call to the next
            first = timed(partial(tlm_rate, ours, batch, 4, decoder=decoder), CUDA)  # records
            tlm_rate(ours, batch, 4, cuda_graph=False), hf_rate(theirs, batch, 4)  # warm up
            rates = {"graph": [], "steps": [], "hf": []}
            for _ in range(rounds):
                rates["hf"].append(hf_rate(theirs, batch, new))
                rates["steps"].append(tlm_rate(ours, batch, new, cuda_graph=False))
                rates["graph"].append(tlm_rate(ours, batch, new, decoder=decoder))
            m = {name: statistics.median(r) for name, r in rates.items()}
            print(
                f"  batch {batch}: tlm {m['graph']:7.1f} (step by step {m['steps']:6.1f}), "
                f"transformers {m['hf']:6.1f}; ratio {m['graph'] / m['hf']:.2f}x "
                f"(step by step {m['steps'] / m['hf']:.2f}x); first call with recording "
                f"{first:.2f} s for 4 tokens"
            )
        del ours, theirs
        torch.cuda.empty_cache()


def bf16_peak(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    return 2 * n**3 * repeats / timed(lambda: [a @ b for _ in range(repeats)], CUDA)


def tlm_command(args: str) -> list[str]:
    return [sys.executable, "-m", "tlm", *args.split()]


def prepared(work: Path, name: str, command: str) -> None:
    if not (work / "data" / name / "meta.json").is_file():
        shutil.rmtree(work / "data" / name, ignore_errors=True)
        args = [*tlm_command(command), "--out", f"data/{name}", "--quiet"]
        subprocess.run(args, cwd=work, check=True)


def prepared_char(work: Path) -> None:
    prepared(
        work, "shakespeare_char", "prepare tinyshakespeare --tokenizer char --val-fraction 0.1"
    )


def prepared_code(work: Path) -> None:
    """A BPE vocabulary of GPT-2's padded size, from the installed transformers' sources."""
    import transformers

    models = Path(transformers.__file__).parent / "models" / "**" / "*.py"
    prepared(work, "code50k", f"prepare {models} --vocab-size 50304")


GPT2_SHAPE = (
    "--n-layers 12 --n-heads 12 --d-model 768 --context-length 1024 "
    "--batch-size 16 --dropout 0 --max-steps 80 --eval-interval 80 --eval-tokens 16384 "
    "--log-interval 10 --device cuda --precision auto"
)


def part_mfu(work: Path) -> None:
    prepared_code(work)
    peak = bf16_peak()
    print(f"{torch.cuda.get_device_name()}: bf16 matmul peak (8192^3) {peak / 1e12:.0f} TFLOP/s")
    for compiled in ("true", "false"):
        run = work / "runs" / f"gpu_mfu_{compiled}"
        shutil.rmtree(run, ignore_errors=True)
        args = f"train --data data/code50k --out {run} --quiet --compile {compiled} "
        started = time.perf_counter()
        subprocess.run(tlm_command(args + GPT2_SHAPE), cwd=work, check=True)
        wall = time.perf_counter() - started
        config = ModelConfig.from_dict(json.loads((run / "config.json").read_text())["model"])
        flops = TransformerLM(config, init=False).flops_per_token(training=True)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
        steps = {r["step"]: r for r in rows if "train_loss" in r}
        a, b = steps[30], steps[80]
        rate = (b["tokens"] - a["tokens"]) / (b["time"] - a["time"])
        print(
            f"  compile {compiled}: {rate:,.0f} tok/s (steps 30-80) x {flops / 1e9:.2f} GFLOP/token"
            f" = {rate * flops / 1e12:.0f} TFLOP/s, MFU {rate * flops / peak:.0%}; first 30 steps "
            f"{a['time']:.1f} s, whole command {wall:.1f} s, train loss {b['train_loss']:.3f}"
        )


GPU_RECIPE = (
    "--n-layers 6 --n-heads 6 --d-model 384 --context-length 256 --batch-size 64 "
    "--lr 1e-3 --min-lr 1e-4 --warmup-steps 100 --beta2 0.99 --max-steps 5000 "
    "--eval-interval 250 --eval-tokens 0 --device cuda --precision auto --dropout 0.2"
)
RECIPES = {
    "nanoGPT's settings (AdamW, learned positions)": "",
    "budget flags (rope, Muon, QK-norm, ReLU², lr 6e-3 -> 6e-4)": (
        "--position rope --optimizer muon --qk-norm --activation relu2 --lr 6e-3 --min-lr 6e-4"
    ),
    "nanoGPT's settings with rotary positions": "--position rope",
}


def time_to(target: float, args: str, run: Path, work: Path, limit: float = 170) -> str:
    """Launch `tlm train`, watch its metrics, stop it at the first validation <= target."""
    shutil.rmtree(run, ignore_errors=True)
    started = time.perf_counter()
    process = subprocess.Popen(tlm_command(args), cwd=work)
    metrics, seen = run / "metrics.jsonl", []
    try:
        while process.poll() is None and time.perf_counter() - started < limit:
            time.sleep(0.2)
            rows = [json.loads(line) for line in metrics.open()] if metrics.is_file() else []
            for r in [r for r in rows if "val_loss" in r][len(seen) :]:  # new validations
                wall = time.perf_counter() - started
                print(
                    f"    step {r['step']}: val {r['val_loss']:.4f}, {r['time']:.1f} s of "
                    f"training, {wall:.1f} s from launch",
                    flush=True,
                )
                seen.append(r)
            if seen and seen[-1]["val_loss"] <= target:
                wall = time.perf_counter() - started
                r = seen[-1]
                return (
                    f"val {r['val_loss']:.4f} at step {r['step']}: {wall:.1f} s from launch, "
                    f"{r['time']:.1f} s of training"
                )
    finally:
        process.terminate()
        process.wait()
    best = min((r["val_loss"] for r in seen), default=float("nan"))
    return f"not reached in {time.perf_counter() - started:.0f} s (best val {best:.4f})"


def part_recipe(work: Path, limit: float, target: float = 1.47) -> None:
    prepared_char(work)
    for i, (what, flags) in enumerate(RECIPES.items()):
        for compiled in ("true", "false"):
            run = work / "runs" / f"gpu_recipe_{i}_{compiled}"
            args = f"train --data data/shakespeare_char --out {run} --quiet {GPU_RECIPE} {flags}"
            reached = time_to(target, f"{args} --compile {compiled}", run, work, limit)
            print(f"  {what}, compile {compiled}: {reached}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=["all", "decode", "mfu", "recipe"])
    parser.add_argument("--work", default=str(ROOT / "out" / "bench"))
    parser.add_argument("--limit", type=float, default=170, help="seconds a recipe may run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    parts = {
        "decode": part_decode,
        "mfu": partial(part_mfu, work),
        "recipe": partial(part_recipe, work, args.limit),
    }
    for name in parts if args.part == "all" else [args.part]:
        print(f"== {name}", flush=True)
        parts[name]()


if __name__ == "__main__":
    main()
