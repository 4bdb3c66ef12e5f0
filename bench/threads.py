"""Decoding beside busy processes (not a test): the thread count chosen per step
(`tlm/inference/threads.py`) against torch's fixed setting.

    python bench/threads.py            # int8 GPT-2 124M shape, batch 1, about 3 minutes

Random weights of the GPT-2 124M shape in int8 (`load_model(path, dtype="int8")`, the
checkpoint of bench/generate.py), greedy `generate` of 64 tokens from a 32-token prompt on
the main thread. Each setting, alternating, runs `--calls` generations (their tok/s
printed), first on a quiet machine, then with as many busy processes beside it as torch
has threads (`python -c "while True: pass"`, stopped after). Figures on a shared host move
from run to run: compare the settings within one phase.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from _decoding import ROOT, saved_gpt2, tlm_rate
from _peers import host

from tlm import load_model
from tlm.inference import Decoder


def phase(model, calls: int, rounds: int) -> tuple[dict[str, list[float]], list[int]]:
    """tok/s of each setting's calls, the settings taking turns for `rounds` rounds, and
    the thread count kept at the end of each round of the chosen setting. Each setting
    has its decoder for the whole phase, as a program that generates again and again."""
    decoders = {"chosen per step": Decoder(model), "fixed": Decoder(model, fixed_threads=True)}
    rates: dict[str, list[float]] = {setting: [] for setting in decoders}
    kept = []
    for _ in range(rounds):
        for setting, decoder in decoders.items():
            rates[setting] += [tlm_rate(model, 1, 64, decoder=decoder) for _ in range(calls)]
            if not decoder.fixed_threads:
                kept.append(decoder.threads.count)
    return rates, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4, help="generations per setting")
    parser.add_argument("--rounds", type=int, default=2, help="turns of the two settings")
    parser.add_argument("--work", default=str(ROOT / "out" / "bench"))
    args = parser.parse_args()
    threads = torch.get_num_threads()
    print(f"{host()}, {threads} threads")
    model = load_model(saved_gpt2(Path(args.work)), dtype="int8")
    tlm_rate(model, 1, 4)
    print("int8 GPT-2 124M shape, batch 1, 64 new tokens; tok/s of each call")
    for busy in (0, threads):
        others = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(1 if busy else 0)
            rates, kept = phase(model, args.calls, args.rounds)
        finally:
            for other in others:
                other.kill()
        print(f"{busy} busy processes beside it (the chosen count kept: {kept}):")
        for setting, values in rates.items():
            listed = " ".join(f"{v:.1f}" for v in values)
            print(f"  {setting:16s} {min(values):7.1f}-{max(values):.1f}  ({listed})")


if __name__ == "__main__":
    main()
