"""nanoGPT's own `train.py` beside `tlm train` (issue 33, part 3; `bench/train.py --part nanogpt`).

nanoGPT runs from a checkout as a subprocess, never imported or copied, on data its own
`prepare.py` makes from tlm's copy of the same text. Two comparisons:

- throughput: tokens/s of both on the recipe's shape (4L d128 ctx64 batch 12) and on
  nanoGPT's full Shakespeare-char shape (6L d384 ctx256 batch 16), runs alternating;
- time to quality: nanoGPT's CPU recipe from its README, launch to the first eval with val
  loss <= 1.874, against tlm's `budget25` (the two alternating, `--rounds` times: the host's
  speed moves between minutes) and `budget4` recipes.

What a reader of the figures must know about nanoGPT's train.py (checked at commit 3adf61e):

- On a CPU it trains in fp32 on every host: its `dtype` default is 'float16' when CUDA is
  absent, but its autocast context is `nullcontext()` for device 'cpu', and its GradScaler
  (CUDA's) disables itself with a warning. tlm's `--precision auto` takes bf16 where the CPU has
  bf16 units; each tlm figure names its precision.
- Optimizer: both AdamW, betas (0.9, 0.99), weight decay 0.1, clip 1.0, lr 1e-3 to 1e-4 by a
  cosine after 100 warm-up steps. nanoGPT's is the foreach AdamW (fused only on CUDA) and
  decays every 2-D tensor, embeddings included; tlm decays no embedding, norm or bias.
- Batches: windows at uniform random offsets of train.bin, gathered by a Python loop from a
  fresh memmap every step, inside the timed iteration (tlm: seeded windows of the same split).
- Its "val loss" is an estimate from `eval_iters` random batches (20 x 12 x 64 = 15,360
  tokens in the recipe) and it scores the train split too at every eval; tlm's final losses
  here are `tlm eval` on the whole validation split.
- Its per-iteration "time" runs from the end of one iteration to the end of the next: the
  next batch, the previous log line and, at an eval step, the eval are inside (iteration 0
  always evaluates). Both sides leave their first SKIP steps out of tokens/s.
- Its time to 1.874 is wall time from launch: Python and torch imports, evals and checkpoint
  saves included, nothing subtracted. tlm's is its training seconds from metrics.jsonl (no
  start-up, no evaluation); tlm's whole command is printed beside it.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from _peers import matmul_peak as measure_peak

from tlm import ModelConfig
from tlm.model.counts import flops_per_token
from tlm.train.precision import bf16_units

matmul_peak = functools.cache(measure_peak)  # measured once a dtype, for the header and MFU
NANOGPT = "train.py config/train_shakespeare_char.py --device=cpu --compile=False"
# the README's CPU command, then two of the config's own values, named so that quick shrinks them
RECIPE = (
    "--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 "
    "--n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 "
    "--eval_interval=250 --warmup_iters=100"
)
TARGET = 1.874  # nanoGPT's recipe's loss, the one its time to quality is taken at
SKIP = 5  # steps each side leaves out of tokens/s: warm-up, and nanoGPT's iteration 0 evaluates
QUICK = 20  # --quick divides every step count by this, down to SKIP + 3
ITER_LINE = re.compile(r"iter (\d+): loss \S+, time ([\d.]+)ms")
EVAL_LINE = re.compile(r"step (\d+): train loss \S+, val loss (\S+)")
# a flag of either side that counts steps, and its value
STEP_COUNTS = re.compile(
    r"(--(?:max-steps|max_iters|warmup-steps|warmup_iters|lr_decay_iters|eval[-_]interval)"
    r"[= ])(\d+)"
)


@dataclass(frozen=True)
class Shape:
    """A model and batch shape trained for `steps` steps by both sides; `goal` is tlm's
    tokens/s ratio to reach on a host with bf16 units (1x on every other host)."""

    name: str
    n_layers: int
    n_heads: int
    d_model: int
    context: int
    batch: int
    steps: int
    goal: float

    def nanogpt(self) -> str:
        """nanoGPT's flags: one eval, at iteration 0 (it always makes that one), of 1 batch."""
        return (
            f"--n_layer={self.n_layers} --n_head={self.n_heads} --n_embd={self.d_model} "
            f"--block_size={self.context} --batch_size={self.batch} --dropout=0.0 --bias=False "
            f"--max_iters={self.steps} --lr_decay_iters={self.steps} --eval_interval=1000000 "
            "--eval_iters=1 --log_interval=1 --always_save_checkpoint=False"
        )

    def tlm(self, dtype: str = "auto") -> str:
        """tlm's flags for the same model, batch and learning rates, a row a step."""
        return (
            f"--n-layers {self.n_layers} --n-heads {self.n_heads} --d-model {self.d_model} "
            f"--context-length {self.context} --batch-size {self.batch} --dropout 0 --bias false "
            f"--max-steps {self.steps} --lr 1e-3 --min-lr 1e-4 --warmup-steps 100 "
            f"--eval-interval {self.steps} --eval-tokens 4096 --log-interval 1 --precision {dtype}"
        )


SHAPES = (
    Shape("recipe shape (4L d128 ctx64 b12)", 4, 4, 128, 64, 12, steps=200, goal=1.0),
    Shape("nanoGPT shape (6L d384 ctx256 b16)", 6, 6, 384, 256, 16, steps=30, goal=2.0),
)


@dataclass(frozen=True)
class TlmSide:
    """What bench/train.py knows of tlm: `run(command)` runs `tlm <command>` in `work` and
    returns (stdout, wall seconds); `train` and `evaluate` are its command templates ({run});
    `recipes` maps a recipe's name to its settings."""

    run: Callable[[str], tuple[str, float]]
    work: Path
    train: str
    evaluate: str
    recipes: dict[str, str]
    dtype: str = "auto"  # every tlm run's --precision (float32: what a host without bf16 runs)


def shrink(flags: str, factor: int) -> str:
    """`flags` with every step count (steps, warm-up, decay, eval interval) divided by
    `factor`, down to SKIP + 3 steps; unchanged for factor 1."""
    if factor == 1:
        return flags
    return re.sub(STEP_COUNTS, lambda m: f"{m[1]}{max(int(m[2]) // factor, SKIP + 3)}", flags)


def prepare(checkout: Path) -> None:
    """nanoGPT's train.bin, val.bin and meta.pkl, made by its own prepare.py from tlm's copy
    of Tiny Shakespeare (byte for byte the file prepare.py would download)."""
    data = checkout / "data" / "shakespeare_char"
    if (data / "train.bin").is_file():
        return
    text = resources.files("tlm.data") / "corpora" / "tinyshakespeare.txt.gz"
    (data / "input.txt").write_bytes(gzip.decompress(text.read_bytes()))
    with tempfile.TemporaryDirectory() as stub:  # prepare.py imports requests, for the download
        Path(stub, "requests.py").write_text("")
        env = {**os.environ, "PYTHONPATH": stub}
        command = [sys.executable, "prepare.py"]
        subprocess.run(command, cwd=data, env=env, check=True, stdout=subprocess.DEVNULL)


def run_nanogpt(checkout: Path, flags: str, out: Path) -> tuple[list[tuple[float, str]], float]:
    """Run nanoGPT's train.py with `flags`; returns its stdout lines, each with the seconds
    from launch at which it came, and the whole run's seconds. A failure prints its stderr
    tail and exits."""
    command = [sys.executable, *NANOGPT.split(), *flags.split(), f"--out_dir={out.resolve()}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as printed, so its time is true
    lines = []
    with tempfile.TemporaryFile("w+") as errors:
        started = time.perf_counter()
        process = subprocess.Popen(
            command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=errors, text=True
        )
        for line in process.stdout:
            lines.append((time.perf_counter() - started, line.rstrip()))
        seconds = time.perf_counter() - started
        if process.wait() != 0:
            errors.seek(0)
            print(errors.read()[-3000:], file=sys.stderr)
            sys.exit(f"nanoGPT's train.py failed (exit {process.returncode}): {' '.join(command)}")
    return lines, seconds


def nanogpt_rate(lines: list[tuple[float, str]], tokens_per_step: int) -> float:
    """Tokens/s from nanoGPT's "iter N: ..., time T ms" lines, iterations SKIP on."""
    times = [float(m[2]) / 1000 for _, line in lines if (m := ITER_LINE.match(line))]
    return tokens_per_step * len(times[SKIP:]) / sum(times[SKIP:])


def tlm_rows(run: Path) -> list[dict]:
    """The training rows of a tlm run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return [row for row in rows if "train_loss" in row]


def tlm_rate(run: Path) -> float:
    """Tokens/s of a tlm run from its rows, steps SKIP + 1 on (evaluation is not in `time`)."""
    rows = tlm_rows(run)
    first, last = next(r for r in rows if r["step"] == SKIP), rows[-1]
    return (last["tokens"] - first["tokens"]) / (last["time"] - first["time"])


def precision(run: Path) -> str:
    """The precision `--precision auto` chose for a tlm run."""
    return json.loads((run / "config.json").read_text())["precision"]["dtype"]


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def throughput(shape: Shape, tlm: TlmSide, checkout: Path, rounds: int, factor: int) -> None:
    """Alternate nanoGPT and tlm `rounds` times on `shape`; print median tokens/s, each
    round's ratio (the two runs of a round are a minute apart, the rounds further) and the
    median of those ratios, which the goal is judged by."""
    run = tlm.work / "runs" / "nanogpt_peer"
    rates: dict[str, list[float]] = {"nanoGPT": [], "tlm": []}
    for _ in range(rounds):
        lines, _ = run_nanogpt(checkout, shrink(shape.nanogpt(), factor), tlm.work / "nanogpt_out")
        rates["nanoGPT"].append(nanogpt_rate(lines, shape.batch * shape.context))
        shutil.rmtree(run, ignore_errors=True)
        tlm.run(tlm.train.format(run=run.name) + shrink(shape.tlm(tlm.dtype), factor))
        rates["tlm"].append(tlm_rate(run))
    theirs, ours = (statistics.median(rates[side]) for side in ("nanoGPT", "tlm"))
    ratios = [a / b for a, b in zip(rates["tlm"], rates["nanoGPT"], strict=True)]
    ratio = statistics.median(ratios)
    goal = shape.goal if bf16_units() and tlm.dtype != "float32" else 1.0
    met = verdict(ratio >= goal)
    dtype = precision(run)
    print(
        f"  {shape.name}: nanoGPT {theirs:7,.0f} (float32, {mfu(shape, theirs, 'float32')}), "
        f"tlm {ours:7,.0f} ({dtype}, {mfu(shape, ours, dtype)}); rounds "
        f"{', '.join(f'{r:.2f}x' for r in ratios)}: median {ratio:.2f}x, goal >= {goal:g}x {met}"
    )


def mfu(shape: Shape, rate: float, dtype: str) -> str:
    """Model FLOPs utilization: tokens/s × the shape's training FLOPs a token (6N plus
    attention; the same model on both sides) over this host's GEMM peak in `dtype`."""
    config = ModelConfig(
        vocab_size=65,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        d_model=shape.d_model,
        context_length=shape.context,
        bias=False,
    )
    flops = flops_per_token(config, training=True)
    return f"MFU {rate * flops / matmul_peak(dtype=getattr(torch, dtype)):.0%}"


def nanogpt_recipe(checkout: Path, work: Path, factor: int) -> tuple[float, float, float]:
    """nanoGPT's CPU recipe: (seconds from launch to its first val loss <= TARGET, or to its
    last eval where it never gets there; that eval's val loss; its whole run's seconds)."""
    lines, whole = run_nanogpt(checkout, shrink(RECIPE, factor), work / "nanogpt_out")
    evals = [(t, int(m[1]), float(m[2])) for t, line in lines if (m := EVAL_LINE.match(line))]
    reached = next(((t, step, val) for t, step, val in evals if val <= TARGET), None)
    seconds, step, val = reached or evals[-1]
    when = "first" if reached else f"never reached {TARGET}; its last"
    print(
        f"  nanoGPT recipe: {when} eval at step {step}, val {val:.4f}, {seconds:.1f} s from "
        f"launch; whole run {whole:.1f} s"
    )
    return seconds, val, whole


def tlm_recipe(tlm: TlmSide, name: str, factor: int) -> tuple[float, float, float]:
    """Train tlm's recipe `name`, score the whole validation split; returns (val loss,
    training seconds, the whole command's seconds) and prints them."""
    run = f"nanogpt_{name}"
    shutil.rmtree(tlm.work / "runs" / run, ignore_errors=True)
    flags = shrink(tlm.recipes[name], factor) + f" --precision {tlm.dtype}"
    _, wall = tlm.run(tlm.train.format(run=run) + flags)
    val = json.loads(tlm.run(tlm.evaluate.format(run=run))[0])["loss"]
    seconds = max(row["time"] for row in tlm_rows(tlm.work / "runs" / run))
    dtype = precision(tlm.work / "runs" / run)
    print(
        f"  tlm {name} ({dtype}): val {val:.4f}, training {seconds:.1f} s "
        f"(whole command {wall:.1f} s)"
    )
    return val, seconds, wall


def time_to_quality(tlm: TlmSide, checkout: Path, factor: int, rounds: int = 2) -> None:
    """nanoGPT's recipe and tlm's budget25, alternating `rounds` times (the host's speed
    moves between minutes), then budget4, against the issue's goals: budget25 <= 1.87 in 1/9
    of nanoGPT's time to its recipe's loss (1.874, or its final one where its estimate ends
    above), budget4 <= 1.50 within 3x nanoGPT's whole run."""
    by_training, by_command, wholes, vals = [], [], [], []
    for _ in range(rounds):
        reached, theirs, whole = nanogpt_recipe(checkout, tlm.work, factor)
        val, seconds, wall = tlm_recipe(tlm, "budget25", factor)
        by_training.append(reached / seconds)
        by_command.append(reached / wall)
        wholes.append(whole)
        vals.append(val)
        print(
            f"    nanoGPT's time to {theirs:.4f} / tlm's to {val:.4f}: {reached / seconds:.2f}x "
            f"(whole command: {reached / wall:.2f}x)"
        )
    ratio, command = statistics.median(by_training), statistics.median(by_command)
    met = ratio >= 9 and max(vals) <= 1.87
    print(
        f"    median of {rounds}: {ratio:.2f}x (whole command {command:.2f}x), goal >= 9x "
        f"with val <= 1.87: {verdict(met)}"
    )
    whole = statistics.median(wholes)
    val, seconds, _ = tlm_recipe(tlm, "budget4", factor)
    met = val <= 1.50 and seconds <= 3 * whole
    print(
        f"    3 x nanoGPT's whole run: {3 * whole:.1f} s, goal val <= 1.50 within it {verdict(met)}"
    )


def peaks() -> str:
    """The GEMM peaks of this host: fp32, and bf16 where it has bf16 units."""
    units = bf16_units()
    found = f"fp32 {matmul_peak(dtype=torch.float32) / 1e9:.0f}"
    if units:
        found += f", bf16 {matmul_peak(dtype=torch.bfloat16) / 1e9:.0f}"
    threads = torch.get_num_threads()
    return f"GEMM peak (4096^3, {threads} threads) {found} GFLOP/s; bf16 units: {units or 'none'}"


def compare(checkout: Path, tlm: TlmSide, rounds: int = 2, quick: bool = False) -> None:
    """The whole part: GEMM peaks, throughput on both shapes, time to quality."""
    factor = QUICK if quick else 1
    prepare(checkout)
    print(f"nanoGPT ({checkout}) against tlm{', QUICK: step counts / 20' if quick else ''}")
    print(f"  {peaks()}")  # (the host's line is bench/train.py's first)
    print(f"throughput, tokens/s, {rounds} alternating rounds, steps {SKIP + 1} on:")
    for shape in SHAPES:
        throughput(shape, tlm, checkout, rounds, factor)
    print(
        f"time to quality, {rounds} alternating rounds "
        "(nanoGPT: wall from launch; tlm: training seconds):"
    )
    time_to_quality(tlm, checkout, factor, rounds)
