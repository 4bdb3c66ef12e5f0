"""The bidirectional encoder beside transformers' BertForMaskedLM (issue 66).

    python bench/encoder.py --part speed         # MLM training tokens/s, same data and masks
    python bench/encoder.py --part pretraining   # fine-tuned from the MLM run vs from random

speed: both models BERT-shaped (post-norm, learned positions, exact GELU; 4 layers, d 128,
4 heads, 128 positions) on python-stdlib (BPE 4,096, prepared once into --work), the same
batches and the same masks (tlm's `mask_tokens`: transformers gets them as `labels`, -100
where unselected), the same AdamW; each step a forward, a backward and an optimizer step.
Both start from the same weights (tlm's initial ones, written into BertForMaskedLM by
`interop/bert.py`), so the same steps must end at the same validation loss: the check that
the two compute the same function and the same updates. The two alternate in rounds;
tokens/s is the median round's.

pretraining: `tlm train --task classify|tag` on the built-in sets from a masked-LM run
(--mlm, default runs/demo-encoder/mlm: run `tlm demo encoder` first) and with --reinit
(the same shape and tokenizer from random weights), the same steps, over 3 seeds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _peers import host  # noqa: E402

from tlm import ModelConfig  # noqa: E402
from tlm.cli import main as tlm_main  # noqa: E402
from tlm.cli.demo_encoder import FINETUNE, SETS, STEPS  # noqa: E402
from tlm.data import TokenData, prepare  # noqa: E402
from tlm.interop.bert import state_to_bert  # noqa: E402
from tlm.model import Encoder  # noqa: E402
from tlm.tokenizer import encoder_tokenizer, load_tokenizer  # noqa: E402
from tlm.train.mlm import Specials, mask_tokens, mlm_loss  # noqa: E402

SHAPE = {"d_model": 128, "n_layers": 4, "n_heads": 4, "context_length": 128}
BATCH, LR = 32, 1e-3


def batches(tokens: np.ndarray, specials: Specials, steps: int, seed: int):
    """`steps` masked batches [BATCH, T] at random offsets: (inputs, targets, selected)."""
    rng, inner = np.random.default_rng(seed), SHAPE["context_length"] - 2
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - inner, BATCH)
        windows = torch.from_numpy(tokens[starts[:, None] + np.arange(inner)].astype(np.int64))
        targets = specials.wrap(windows)
        inputs, selected = mask_tokens(targets, specials, 0.15, generator, False)
        yield inputs, targets, selected


def hf_model(vocab: int):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=vocab, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=512, max_position_embeddings=128, hidden_act="gelu",
        layer_norm_eps=1e-5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"  # its fused attention, as tlm's
    return BertForMaskedLM(config)


def tlm_step(model, inputs, targets, selected):
    return mlm_loss(model, inputs, targets, selected)


def hf_step(model, inputs, targets, selected):
    return model(input_ids=inputs, labels=targets.masked_fill(~selected, -100)).loss


def part_speed(work: Path, rounds: int, steps: int, seed: int = 0) -> None:
    data = work / "stdlib-4096"
    if not (data / "meta.json").is_file():
        prepare(["python-stdlib"], data, vocab_size=4096, progress=False)
    specials = Specials(encoder_tokenizer(load_tokenizer(data)))
    train, val = TokenData(data).split("train"), TokenData(data).split("val")
    config = ModelConfig(model_type="encoder", norm="post", position="learned", activation="gelu",
                         vocab_size=specials.vocab_size, **SHAPE)  # fmt: skip
    torch.manual_seed(seed)
    ours, theirs = Encoder(config), hf_model(specials.vocab_size)
    theirs.load_state_dict(state_to_bert(ours.state_dict(), config), strict=False)  # (tied head)
    sides = {"tlm": (ours, tlm_step), "transformers": (theirs, hf_step)}
    optimizers = {
        n: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)
        for n, (m, _) in sides.items()
    }
    rates = {name: [] for name in sides}
    for r in range(rounds):
        for name, (model, step) in sides.items():
            model.train()
            started = time.perf_counter()
            for inputs, targets, selected in batches(train, specials, steps, seed=seed * 100 + r):
                loss = step(model, inputs, targets, selected)
                loss.backward()
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
            rates[name].append(
                steps * BATCH * SHAPE["context_length"] / (time.perf_counter() - started)
            )
    held = list(batches(val, specials, 8, seed=1234))
    losses = {}
    with torch.no_grad():
        for name, (model, step) in sides.items():
            model.eval()
            losses[name] = statistics.mean(step(model, *b).item() for b in held)
    print(f"host: {host()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"BERT shape {SHAPE}, vocabulary {specials.vocab_size}, batch {BATCH}, masks 15% "
          f"(80/10/10), AdamW lr {LR}; {rounds} rounds of {steps} steps, alternating; "
          f"seed {seed}")  # fmt: skip
    for name in sides:
        print(f"{name:13s} {statistics.median(rates[name]):9,.0f} tokens/s   validation loss "
              f"after {rounds * steps} steps {losses[name]:.3f}")  # fmt: skip
    ratio = statistics.median(rates["tlm"]) / statistics.median(rates["transformers"])
    print(f"tlm / transformers: {ratio:.2f}x")


def part_pretraining(work: Path, mlm: Path, seeds: int) -> None:
    if not (mlm / "config.json").is_file():
        raise SystemExit(f"no masked-LM run at {mlm}: run tlm demo encoder first (or --mlm RUN)")
    steps = {task: STEPS[task] for task in SETS}  # the demo's steps, rate and batch
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FINETUNE.items()]
    print(f"host: {host()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for task, name in SETS.items():
        scores = {"pretrained": [], "random": []}
        for seed in range(seeds):
            for start, extra in (("pretrained", []), ("random", ["--reinit"])):
                out = work / f"ft-{task}-{start}-{seed}"
                shutil.rmtree(out, ignore_errors=True)
                args = ["train", "--task", task, "--init-from", str(mlm), "--data", name]
                args += ["--out", str(out), "--max-steps", str(steps[task]), *flags]
                args += ["--seed", str(seed), "--quiet"]
                assert tlm_main([*args, "--eval-interval", str(steps[task]), *extra]) == 0
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                scores[start].append([r for r in rows if "val_f1" in r][-1]["val_f1"])
        mean = {k: statistics.mean(v) for k, v in scores.items()}
        spread = {k: statistics.pstdev(v) for k, v in scores.items()}
        print(f"{name} ({task}, {steps[task]} steps, {seeds} seeds): F1 from the MLM run "
              f"{mean['pretrained']:.3f} ± {spread['pretrained']:.3f}, from random weights "
              f"{mean['random']:.3f} ± {spread['random']:.3f}; margin "
              f"{mean['pretrained'] - mean['random']:+.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("speed", "pretraining"), default="speed")
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="speed: steps a round (20)")
    parser.add_argument("--mlm", type=Path, default=ROOT / "runs" / "demo-encoder" / "mlm")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="speed: initial weights and batches")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.part == "speed":
        part_speed(args.work, args.rounds, args.steps, args.seed)
    else:
        part_pretraining(args.work, args.mlm, args.seeds)


if __name__ == "__main__":
    main()
