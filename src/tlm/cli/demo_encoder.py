"""`tlm demo encoder`: the book's bidirectional encoder from nothing (J&M ch. 11).

Pretrains an encoder by masked language modeling on `python-stdlib`, fine-tunes it to
classify docstrings by their module's family (`stdlib-family`) and to tag the words that
name Python identifiers (`stdlib-identifiers`), and measures both heads on held-out
examples against bag-of-words logistic regression on the same split (`tasks/baselines.py`).
Writes `runs/demo-encoder/encoder_eval.json`. The encoder takes rotary positions and
pre-norm blocks: at this size they learn the masked tokens several times faster than BERT's
learned positions and post-norm (docs/encoder.md), which `--objective mlm` keeps as its
default.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tlm.checkpoint import lock_run
from tlm.data import prepare
from tlm.data.prepare import FILES as PREPARED
from tlm.io import write_text_atomic
from tlm.tasks.baselines import bag_of_words
from tlm.train import new_run_configs, open_run, run_tokenizer

MODEL = {"n_layers": 4, "d_model": 128, "n_heads": 4, "context_length": 128}
MODEL |= {"position": "rope", "norm": "pre"}
PRETRAIN = {"objective": "mlm", "batch_size": 32, "lr": 2e-3, "min_lr": 2e-4}
PRETRAIN |= {"warmup_steps": 50, "eval_interval": 200, "eval_tokens": 1 << 14}
FINETUNE = {"batch_size": 32, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 30}
STEPS = {"mlm": 450, "classify": 900, "tag": 300}
VOCAB = 4096  # docstrings in fewer tokens than the decoder demo's 1,024: faster, and
# better classified (on this task, 60% -> 74% held-out accuracy)
SETS = {"classify": "stdlib-family", "tag": "stdlib-identifiers"}


FILES = ("mlm/*", "classify/*", "tag/*", "encoder_eval.json")  # what the demo writes in --out


def encoder_demo(args: argparse.Namespace, claim, marker: str) -> int:
    """The four steps; `claim(folders)` checks and clears folders a demo made before."""
    started = time.perf_counter()
    data, out = Path(args.data or "data/demo-encoder"), Path(args.out or "runs/demo-encoder")
    claim([(data, PREPARED, "meta.json"), (out, (*FILES, marker), "mlm/config.json")])
    steps = {phase: getattr(args, f"{phase}_steps") or n for phase, n in STEPS.items()}
    print(f"[1/4] prepare python-stdlib -> {data} (byte-level BPE, {VOCAB})")
    prepare(["python-stdlib"], data, vocab_size=VOCAB, progress=False)
    out.mkdir(parents=True)
    (data / marker).touch(), (out / marker).touch()
    print(f"[2/4] pretrain by masked language modeling for {steps['mlm']} steps")
    values = PRETRAIN | {"data": str(data), "out": str(out / "mlm")}
    results, _ = _train(MODEL, values, steps["mlm"], args)
    figures = {"mlm": {k: round(results[k], 4) for k in ("val_loss", "val_accuracy")}}
    figures["mlm"]["minutes"] = round(results["elapsed"] / 60, 2)
    print(
        f"      masked tokens right: {results['val_accuracy']:.1%} (loss {results['val_loss']:.3f})"
    )
    for n, (task, name) in enumerate(SETS.items(), start=3):
        print(f"[{n}/4] fine-tune to {task} ({name}) for {steps[task]} steps")
        values = FINETUNE | {"init_from": str(out / "mlm"), "data": name, "out": str(out / task)}
        results, labeled = _train({"task": task}, values, steps[task], args)
        baseline = bag_of_words(labeled)
        figures[task] = {
            "accuracy": round(results["val_accuracy"], 4),
            "f1": round(results["val_f1"], 4),
            "baseline": {k: round(v, 4) for k, v in baseline.items()},
            "held_out": len(labeled.val),
        }
        print(f"      {_line(figures[task])}")
    write_text_atomic(out / "encoder_eval.json", json.dumps(figures, indent=2) + "\n")
    print(f"\nDone in {time.perf_counter() - started:.0f} s: {out / 'encoder_eval.json'}")
    print(f'  tlm fill-mask {out / "mlm"} "Return the [MASK] of the file."')
    print(f'  tlm classify {out / "classify"} "Open a socket and send the request."')
    print(f'  tlm tag {out / "tag"} "Call os.path.join() on the parts."')
    return 0


def _train(model_values: dict, values: dict, steps: int, args: argparse.Namespace):
    """Train a run: (its final results with the last validation's figures, the data it
    read: the labeled examples the baseline is fitted and scored on)."""
    values = values | {"max_steps": steps, "device": args.device, "eval_interval": steps}
    model_config, train_config, data = new_run_configs(model_values, values)
    run = Path(train_config.out)
    with lock_run(run):
        trainer = open_run(
            model_config, train_config, data, run_tokenizer(train_config, data).to_json(),
            progress_bar=not args.quiet,
        )  # fmt: skip
        results = trainer.fit()
    return results | trainer.batches.logged("val"), trainer.batches.data


def _line(figures: dict) -> str:
    base = figures["baseline"]
    return (
        f"encoder accuracy {figures['accuracy']:.1%}, F1 {figures['f1']:.3f}; bag-of-words "
        f"logistic regression {base['accuracy']:.1%}, F1 {base['f1']:.3f} "
        f"({figures['held_out']} held out)"
    )
