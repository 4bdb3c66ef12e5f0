"""Translation benchmark (not a test): Multi30k En->De, BLEU against minutes of training.

    python bench/translate.py --out runs/bench-translate            # train 60 min, then score
    python bench/translate.py --out runs/bench-translate --score    # score the marks again

1. `tlm prepare --task translate` on ../shared/data/multi30k (train, val), one BPE of 8,000.
2. `tlm train` on it, the model and schedule below, for the longest mark's minutes of
   training time (the run's own clock, validation excluded). A watcher copies the weights
   of the last checkpoint at or before each mark (--marks, default 30 and 60 minutes) into
   OUT/at-{mark}min, a run folder `tlm translate` and `tlm eval` read, then stops the run
   with SIGINT (it saves and exits).
3. Each mark is scored on test_2016_flickr (1,000 pairs) with beam 4 and length penalty
   0.6, BLEU and chrF by sacrebleu's defaults, after training (so decoding does not
   compete with it for the two cores); a few translations are printed beside references.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
MODEL = ["--d-model", "256", "--n-heads", "4", "--n-layers", "3", "--d-ff", "1024"]
MODEL += ["--context-length", "96", "--dropout", "0.1"]
TRAIN = ["--batch-tokens", "4096", "--lr", "0.35", "--warmup-steps", "500"]
TRAIN += ["--max-steps", "1000000", "--eval-interval", "200", "--checkpoint-interval", "40"]
TRAIN += ["--log-interval", "20", "--seed", "1"]


def tlm(*args: str) -> list[str]:
    return [sys.executable, "-m", "tlm", *args]


def prepare(data: Path) -> None:
    if (data / "meta.json").is_file():
        return
    d = MULTI30K
    subprocess.run(
        tlm("prepare", "--task", "translate", "--src", str(d / "train.en.gz"), "--tgt",
            str(d / "train.de.gz"), "--val-src", str(d / "val.en.gz"), "--val-tgt",
            str(d / "val.de.gz"), "--vocab-size", "8000", "--out", str(data)),
        check=True,
    )  # fmt: skip


def train(data: Path, run: Path, out: Path, marks: list[int]) -> None:
    """Train until the last mark, copying the weights at each mark as a run folder."""
    proc = subprocess.Popen(tlm("train", "--data", str(data), "--out", str(run), "--quiet",
                                *MODEL, *TRAIN))  # fmt: skip
    pending, seen, candidate = sorted(marks), None, None
    try:
        while pending and proc.poll() is None:
            time.sleep(2)
            pointer = run / "train_state" / "latest"
            if not pointer.is_file() or pointer.read_text() == seen:
                continue
            seen = pointer.read_text()
            state = json.loads((run / "train_state" / seen.strip() / "state.json").read_text())
            while pending and state["elapsed"] > pending[0] * 60:  # crossed: keep the last
                mark = out / f"at-{pending.pop(0)}min"  # checkpoint before the mark
                if candidate is not None:
                    shutil.rmtree(mark, ignore_errors=True)
                    shutil.copytree(candidate, mark)
                    print(f"mark {mark.name}: {json.loads((mark / 'state.json').read_text())}")
            candidate = out / "candidate"
            shutil.rmtree(candidate, ignore_errors=True)
            candidate.mkdir()
            for name in ("config.json", "tokenizer.json", "model.safetensors"):
                shutil.copy(run / name, candidate / name)
            kept = {k: state[k] for k in ("step", "tokens", "elapsed")}
            (candidate / "state.json").write_text(json.dumps(kept))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-translate")
    parser.add_argument("--marks", type=int, nargs="+", default=[30, 60], help="minutes")
    parser.add_argument("--score", action="store_true", help="only score the marks")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    if not args.score:
        prepare(out / "data")
        shutil.rmtree(out / "run", ignore_errors=True)
        train(out / "data", out / "run", out, args.marks)
    for mark in sorted(args.marks):
        folder = out / f"at-{mark}min"
        if not folder.is_dir():
            print(f"{folder.name}: not reached")
            continue
        state = json.loads((folder / "state.json").read_text())
        test = ["--src", str(MULTI30K / "test_2016_flickr.en.gz")]
        test += ["--ref", str(MULTI30K / "test_2016_flickr.de.gz")]
        command = tlm("eval", str(folder), "--task", "translate", *test, "--examples", "5")
        result = subprocess.run(command, capture_output=True, text=True)
        print(f"{folder.name}: step {state['step']}, {state['elapsed'] / 60:.1f} min of training")
        print(result.stdout or result.stderr)


if __name__ == "__main__":
    main()
