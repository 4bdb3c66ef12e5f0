"""Training benchmark (not a test): Tiny Shakespeare, and tlm against Hugging Face side by side.

    python bench/train.py                      # all parts
    python bench/train.py --part recipe        # the well-known CPU recipe, exactly as issued
    python bench/train.py --part fast          # time to the recipe's loss with our settings
    python bench/train.py --part best          # best validation loss in ~5 minutes
    python bench/train.py --part throughput    # tokens/s vs GPT2LMHeadModel, FLOP/s vs peak

Runs the `tlm` commands as a user would (in --work, default out/bench) and prints what they
measured. The throughput part times both models in one process, in alternating blocks of
steps, so that a noisy machine affects both alike; it reports medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

PREPARE = "prepare {text} --tokenizer char --val-fraction 0.1 --out data/shakespeare_char"
SHAPE = "--n-layers 4 --n-heads 4 --d-model 128 --context-length 64"
RECIPE = (
    f"train --data data/shakespeare_char --out runs/{{run}} {SHAPE} --batch-size 12 "
    "--max-steps 2000 --lr 1e-3 --min-lr 1e-4 --warmup-steps 100 --dropout 0 "
    "--eval-interval 500 --seed 1337"
)
# Same model; a higher peak learning rate, so fewer steps reach the recipe's loss.
FAST = (
    f"train --data data/shakespeare_char --out runs/{{run}} {SHAPE} --batch-size 12 "
    "--max-steps 900 --lr 3e-3 --min-lr 3e-4 --warmup-steps 50 --dropout 0 "
    "--eval-interval 900 --seed 1337"
)
# Our choice for ~5 minutes of CPU: wider, deeper, longer context (see docs/benchmarks.md).
BEST = (
    "train --data data/shakespeare_char --out runs/{run} --n-layers 6 --n-heads 6 "
    "--d-model 192 --context-length 128 --batch-size 16 --max-steps 2400 --lr 2e-3 "
    "--min-lr 2e-4 --warmup-steps 100 --dropout 0.1 --eval-interval 600 --seed 1337"
)
EVAL = "eval runs/{run} --data data/shakespeare_char --split val --json"


def tlm(command: str, work: Path) -> tuple[str, float]:
    """Run `tlm <command>` in `work`; returns (stdout, wall seconds)."""
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "tlm", *command.split(), "--quiet"]
        if command.startswith("train")
        else [sys.executable, "-m", "tlm", *command.split()],
        cwd=work,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        sys.exit(f"tlm {command} failed:\n{result.stderr}")
    return result.stdout, time.perf_counter() - started


def prepared(work: Path) -> None:
    if not (work / "data" / "shakespeare_char" / "meta.json").is_file():
        shutil.rmtree(work / "data" / "shakespeare_char", ignore_errors=True)
        tlm(PREPARE.format(text=SHAKESPEARE), work)


def train_and_eval(template: str, run: str, work: Path) -> dict:
    shutil.rmtree(work / "runs" / run, ignore_errors=True)
    _, wall = tlm(template.format(run=run), work)
    scores = json.loads(tlm(EVAL.format(run=run), work)[0])
    rows = [json.loads(line) for line in (work / "runs" / run / "metrics.jsonl").open()]
    train_time = max(r["time"] for r in rows)
    return {"val_loss": scores["loss"], "wall_s": wall, "train_s": train_time}


def part_recipe(work: Path) -> None:
    prepared(work)
    r = train_and_eval(RECIPE, "shakespeare_char", work)
    print(
        f"recipe (4L d128 ctx64, 2000 steps): val loss {r['val_loss']:.4f}, "
        f"train {r['train_s']:.1f} s, whole command {r['wall_s']:.1f} s "
        f"(reference: 1.87 in 94 s)"
    )


def part_fast(work: Path) -> None:
    prepared(work)
    r = train_and_eval(FAST, "shakespeare_char_fast", work)
    print(
        f"fast (same model, lr 3e-3, 900 steps): val loss {r['val_loss']:.4f}, "
        f"train {r['train_s']:.1f} s, whole command {r['wall_s']:.1f} s "
        f"(target: <= 1.87 in <= 47 s)"
    )


def part_best(work: Path) -> None:
    prepared(work)
    r = train_and_eval(BEST, "shakespeare_char_best", work)
    print(
        f"best in ~5 min (6L d192 ctx128, 2400 steps): val loss {r['val_loss']:.4f}, "
        f"train {r['train_s']:.1f} s, whole command {r['wall_s']:.1f} s (target: <= 1.65)"
    )


def part_throughput(work: Path, blocks: int = 8, steps: int = 15) -> None:
    from peers import build_pair, matmul_peak

    prepared(work)
    tokens = np.fromfile(work / "data" / "shakespeare_char" / "train.bin", dtype=np.uint16)
    peak = matmul_peak()
    print(f"fp32 matmul peak (4096^3, {torch.get_num_threads()} threads): {peak / 1e9:.1f} GFLOP/s")
    for activation in ("gelu_tanh", "gelu"):
        pair = build_pair(activation, vocab_size=66)
        times = {name: [] for name in pair}
        for runner in pair.values():
            runner.steps(tokens, 5)  # warm up
        for block in range(blocks):
            for name, runner in pair.items():
                times[name].append(runner.steps(tokens, steps, first_step=block * steps))
        rates = {
            name: steps * runner.tokens_per_step / statistics.median(times[name])
            for name, runner in pair.items()
        }
        ours, theirs = rates["tlm"], rates["transformers"]
        flops = pair["tlm"].flops_per_token * ours
        print(
            f"{activation:9s}: tlm {ours:8,.0f} tok/s, transformers {theirs:8,.0f} tok/s, "
            f"ratio {ours / theirs:.2f}x; tlm {flops / 1e9:.1f} GFLOP/s = "
            f"{flops / peak:.0%} of peak"
        )


PARTS = {"recipe": part_recipe, "fast": part_fast, "best": part_best, "throughput": part_throughput}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=["all", *PARTS])
    parser.add_argument("--work", default=str(ROOT / "out" / "bench"))
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        sys.exit(
            f"{SHAKESPEARE} is missing: this benchmark needs ../shared/data beside the checkout"
        )
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for part in PARTS if args.part == "all" else [args.part]:
        PARTS[part](work)


if __name__ == "__main__":
    main()
