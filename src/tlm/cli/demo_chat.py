"""`tlm demo chat`: from nothing to a chatting assistant (J&M ch. 12) in a few minutes.

The demo model (`runs/demo`, pretrained by `tlm demo` on python-stdlib; trained first when it
is not there) is fine-tuned on the built-in python-qa conversations (`data/python_qa.py`),
then the base model (the plain template and three examples) and the assistant (its
template) answer the held-out questions: stop rate, chrF and the assistant's loss, printed
and written to `runs/demo-chat/chat_eval.json`. Small, and it says so: a 4-layer model of
0.9 M parameters recalls docstrings it read in pretraining, not much more.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tlm.checkpoint import FILES as RUN
from tlm.checkpoint import lock_run
from tlm.data import ChatData, prepare_chat
from tlm.data.chat import FILES as PREPARED
from tlm.io import write_text_atomic
from tlm.load import load_language_model, load_tokenizer
from tlm.tasks.chat import evaluate_chat
from tlm.train import new_run_configs, open_run

STEPS = 1000  # a pass and a half over python-qa's ~2,000 windows, batches of 16
SHOWN = 4  # held-out questions printed with both answers
MEASURED = None  # held-out conversations both models answer (None: all of them)
GOALS = {"stop_rate": 0.95, "chrf_gain": 10.0, "seconds": 600}


def chat_demo(args: argparse.Namespace, claim, pretrain) -> int:
    """Pretrain (or reuse) the base, fine-tune it on python-qa, measure both; `claim` and
    `pretrain` are the demo's own (`cli/demo.py`)."""
    started = time.perf_counter()
    base = Path(args.base)
    data_dir, out = Path(args.data or "data/demo-chat"), Path(args.out or "runs/demo-chat")
    claim([(data_dir, PREPARED, "meta.json"), (out, RUN, "config.json")])
    if (base / "model.safetensors").is_file():
        print(f"[1/4] base model: {base} (made by tlm demo; delete it to pretrain again)")
    else:
        print(f"[1/4] base model: none at {base}; pretrain it with tlm demo")
        pretrain(base)
    print(f"[2/4] prepare python-qa -> {data_dir} (the base's tokenizer + the chat template)")
    meta = prepare_chat(["python-qa"], data_dir, tokenizer=str(base))
    (data_dir / ".tlm-demo").touch()
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    print(
        f"      {train['conversations']:,} conversations to learn from, {val['conversations']:,} "
        f"held out (questions about other functions, classes, modules and topics)"
    )
    values = {"data": str(data_dir), "out": str(out), "init_from": str(base), "device": args.device}
    model_config, train_config, data = new_run_configs({}, values | {"max_steps": args.max_steps})
    with lock_run(out):
        trainer = open_run(
            model_config, train_config, data, load_tokenizer(data_dir).to_json(),
            progress_bar=not args.quiet,
        )  # fmt: skip
        (out / ".tlm-demo").touch()
        print(f"[3/4] fine-tune on the answers only for {args.max_steps} steps -> {out}")
        print(f"      {trainer.batches.summary()}")
        results = trainer.fit()
    print(f"      {results['elapsed']:.0f} s: validation loss {results['val_loss']:.3f}")
    print("[4/4] answer the held-out questions (greedy): the base model, then the assistant")
    figures, shown = measure(base, out, ChatData(data_dir), trainer.device)
    for item in shown:
        print(f"      Q: {item['question']}")
        print(f"         base:      {item['base'][:100]!r}")
        print(f"         assistant: {item['assistant']!r}")
        print(f"         reference: {item['reference']!r}")
    write_text_atomic(out / "chat_eval.json", json.dumps(figures, indent=2) + "\n")
    seconds = time.perf_counter() - started
    report(figures, seconds, out)
    return 0


def measure(base: Path, assistant: Path, data: ChatData, device) -> tuple[dict, list[dict]]:
    """chat_eval.json's figures for both models (on `device`, where the assistant trained),
    and the first held-out answers of each."""
    figures, answers = {}, {}
    for name, run in (("base", base), ("assistant", assistant)):
        model, tokenizer = load_language_model(run, device), load_tokenizer(run)
        got = evaluate_chat(model.eval(), tokenizer, data, limit=MEASURED, examples=SHOWN)
        keys = ("stop_rate", "chrf") + (("loss",) if name == "assistant" else ())
        figures[name] = {key: round(got[key], 4) for key in keys}
        answers[name] = got["examples"]
    shown = [
        {"question": b["question"], "base": b["reply"], "assistant": a["reply"]}
        | {"reference": a["reference"]}
        for b, a in zip(answers["base"], answers["assistant"], strict=True)
    ]
    return figures, shown


def report(figures: dict, seconds: float, out: Path) -> None:
    base, assistant = figures["base"], figures["assistant"]
    gain = assistant["chrf"] - base["chrf"]
    print(
        f"\n      base      stop rate {base['stop_rate']:6.1%}  chrF {base['chrf']:5.1f}\n"
        f"      assistant stop rate {assistant['stop_rate']:6.1%}  chrF {assistant['chrf']:5.1f}"
        f"  loss {assistant['loss']:.3f} nats per answer token\n"
        f"      goals: stop rate >= {GOALS['stop_rate']:.0%} "
        f"({'met' if assistant['stop_rate'] >= GOALS['stop_rate'] else 'NOT met'}), chrF >= "
        f"base + {GOALS['chrf_gain']:.0f} (+{gain:.1f}: "
        f"{'met' if gain >= GOALS['chrf_gain'] else 'NOT met'}), <= {GOALS['seconds'] // 60} "
        f"minutes ({seconds:.0f} s: {'met' if seconds <= GOALS['seconds'] else 'NOT met'})"
    )
    print(
        f"\nDone in {seconds:.0f} s. Talk to it:\n"
        f"  tlm chat {out}\n"
        f'  tlm chat {out} --message "What does json.dumps do?"\n'
        f"  tlm serve {out}      # /v1/chat/completions, and the page's chat mode"
    )
