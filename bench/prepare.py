"""Corpus preparation benchmark (not a test): `tlm prepare` against `tokenizers` alone.

    python bench/prepare.py                 # 10 MB and 100 MB, about 8 minutes on 2 cores
    python bench/prepare.py --sizes 10      # one size

Each side runs --repeat times (2), the sides in turns, and its fastest run counts (peak
memory is that run's).

Each corpus is Tiny Shakespeare (../shared/data) repeated to the size, in one text file.
Both sides train a byte-level BPE of 8,192 tokens on it and encode all of it to token ids
on disk, each in a process of its own, timed from start to exit; peak memory is that
process's maximum resident set (`os.wait4`).

- tlm: `python -m tlm prepare FILE --out DIR --vocab-size 8192` (which also checks the
  input, hashes the sources, writes train/val splits and counts bytes per split), and the
  same with `--workers 2` (encoding in two processes instead of this one's threads);
- tokenizers alone: the same tokenizer setup trained from the file (read by the Rust
  side, `Tokenizer.train`) and `encode_batch` over texts of 64 lines, 1,024 texts a call,
  ids written with numpy: about the fastest a Python tool on `tokenizers` can be.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

ALONE = r"""
import sys
from itertools import islice
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

path, out = sys.argv[1], sys.argv[2]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
)
tok.train([path], trainer=trainer)  # the file read by the Rust side
with open(path, encoding="utf-8") as f, open(out, "wb") as dst:
    while lines := list(islice(f, 65536)):  # 1,024 texts of 64 lines per call
        texts = ["".join(lines[i : i + 64]) for i in range(0, len(lines), 64)]
        for e in tok.encode_batch(texts, add_special_tokens=False):
            np.array(e.ids, dtype=np.uint16).tofile(dst)
"""


def corpus(folder: Path, mb: int) -> Path:
    text = SHAKESPEARE.read_bytes()
    path = folder / f"corpus-{mb}mb.txt"
    with open(path, "wb") as f:
        while f.tell() < mb * 1_000_000:
            f.write(text)
    return path


def measure(command: list[str]) -> tuple[float, float]:
    """Seconds and peak resident MB of one child process."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{proc.stderr.read().decode()}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100], help="MB")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each side, best kept")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    print("   size   side                 seconds    MB/s   peak MB")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for mb in args.sizes:
            path = corpus(folder, mb)
            size = path.stat().st_size / 1e6
            out = folder / f"tlm-{mb}"
            tlm = [sys.executable, "-m", "tlm", "prepare", str(path), "--vocab-size", "8192"]
            tlm += ["--quiet", "--out"]
            alone = [sys.executable, "-c", ALONE, str(path), str(folder / f"alone-{mb}.bin")]
            two = [*tlm, f"{out}-w2", "--workers", "2"]
            tlm = [*tlm, str(out)]
            sides = {"tlm prepare": tlm, "tlm --workers 2": two, "tokenizers alone": alone}
            runs = {side: [] for side in sides}
            for _ in range(args.repeat):  # in turns, so that load from elsewhere hits all
                for side, command in sides.items():
                    shutil.rmtree(f"{out}-w2", ignore_errors=True)
                    shutil.rmtree(out, ignore_errors=True)
                    runs[side].append(measure(command))
            results = {side: min(times) for side, times in runs.items()}  # the best run
            for side, (seconds, peak) in results.items():
                print(
                    f"  {size:5.1f}   {side:18s} {seconds:8.1f} {size / seconds:7.2f} {peak:9.0f}"
                )
            for side in ("tlm prepare", "tlm --workers 2"):
                ratio = results["tokenizers alone"][0] / results[side][0]
                print(f"          {side} throughput / tokenizers alone: {ratio:.2f}x")


if __name__ == "__main__":
    main()
