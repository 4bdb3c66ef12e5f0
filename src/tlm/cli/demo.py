"""`tlm demo`: the main job end to end: prepare a corpus, train, generate, evaluate, plot."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from tlm.checkpoint import FILES as RUN
from tlm.checkpoint import check_unlocked, lock_run
from tlm.cli.args import add_command, add_device_flag, fail
from tlm.cli.demo_align import STEPS as ALIGN_STEPS
from tlm.cli.demo_align import align_demo
from tlm.cli.demo_chat import STEPS, chat_demo
from tlm.cli.demo_encoder import STEPS as ENCODER_STEPS
from tlm.cli.demo_encoder import encoder_demo
from tlm.data import TokenData, prepare
from tlm.data.prepare import FILES as PREPARED
from tlm.evaluate import evaluate_tokens
from tlm.generate import GenerationConfig, complete
from tlm.inference import for_inference
from tlm.interpret import attention_patterns, plot_attention
from tlm.io import check_replaceable
from tlm.tokenizer import document_ids, load_tokenizer
from tlm.train import new_run_configs, open_run

EXAMPLE = """examples:
  tlm demo                                  # python-stdlib, about two minutes on a laptop CPU
  tlm demo python-docs --data data/demo-docs --out runs/demo-docs
  tlm demo tinyshakespeare --data data/demo-shakespeare --out runs/demo-shakespeare
  tlm demo chat        # fine-tune runs/demo on python-qa into an assistant: runs/demo-chat
  tlm demo encoder     # a masked-LM encoder, fine-tuned to classify and to tag: runs/demo-encoder
"""

MODEL = {"n_layers": 4, "d_model": 128, "n_heads": 4, "context_length": 128, "position": "rope"}
TRAIN = {"batch_size": 16, "lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 50, "eval_interval": 100}
PROMPTS = ["The for statement", "Return True if", "This function"]
MARKER = ".tlm-demo"  # the demo replaces only folders it made itself


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "demo", "prepare a corpus, train a small model, generate, plot", EXAMPLE
    )
    parser.add_argument(
        "inputs",
        nargs="*",
        default=["python-stdlib"],
        help="corpus (python-stdlib), or chat, align, encoder",
    )
    parser.add_argument("--data", help="prepared data folder (data/demo; chat: data/demo-chat)")
    parser.add_argument("--out", help="run directory (runs/demo; chat: runs/demo-chat)")
    parser.add_argument("--max-steps", type=int, help="training steps (800; chat: 1000)")
    parser.add_argument("--base", default="runs/demo", help="chat: the base run (runs/demo)")
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary (1024)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    align = parser.add_argument_group("align (tlm demo align)")
    align.add_argument(
        "--assistant", default="runs/demo-chat", help="the chat run it starts from (runs/demo-chat)"
    )
    for phase, steps in ALIGN_STEPS.items():
        align.add_argument(f"--{phase}-steps", type=int, help=f"{phase} steps ({steps})")
    encoder = parser.add_argument_group("encoder (tlm demo encoder)")
    for phase, steps in ENCODER_STEPS.items():
        encoder.add_argument(f"--{phase}-steps", type=int, help=f"{phase} steps ({steps})")
    add_device_flag(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.inputs == ["align"]:
        args.base_chat = args.assistant
        return align_demo(args, lambda run: _chat_for(run, args))
    if args.inputs == ["encoder"]:
        return encoder_demo(args, _claim, MARKER)
    if args.inputs == ["chat"]:
        args.max_steps = args.max_steps or STEPS
        return chat_demo(args, _claim, lambda base: pretrain(base, args.quiet, args.device))
    args.max_steps = args.max_steps or 800
    started = time.perf_counter()
    data_dir, out = Path(args.data or "data/demo"), Path(args.out or "runs/demo")
    _claim([(data_dir, PREPARED, "meta.json"), (out, RUN, "config.json")])
    corpus = " ".join(args.inputs)
    print(f"[1/4] prepare {corpus} -> {data_dir} (byte-level BPE, {args.vocab_size})")
    meta = prepare(
        args.inputs,
        data_dir,
        vocab_size=args.vocab_size,
        val_fraction=0.1,
        progress=not args.quiet,
    )
    (data_dir / MARKER).touch()
    splits = meta["splits"]
    print(
        f"      {meta['documents']:,} documents, {splits['train']['tokens']:,} train tokens, "
        f"{splits['val']['tokens']:,} validation tokens"
    )

    train_values = {**TRAIN, "data": str(data_dir), "out": str(out), "max_steps": args.max_steps}
    train_values["device"] = args.device
    model_config, train_config, data = new_run_configs(MODEL, train_values)
    tokenizer = load_tokenizer(data_dir)
    with lock_run(out):
        trainer = open_run(
            model_config, train_config, data, tokenizer.to_json(), progress_bar=not args.quiet
        )
        (out / MARKER).touch()
        print(
            f"[2/4] train {trainer.model.num_parameters():,} parameters for {args.max_steps} "
            f"steps on {trainer.device} -> {out}"
        )
        results = trainer.fit()
    print(
        f"      {results['tokens']:,} tokens in {results['elapsed']:.0f} s: "
        f"train loss {results['train_loss']:.3f}, validation loss {results['val_loss']:.3f}"
    )

    model = trainer.model.eval()
    print("[3/4] generate (temperature 0.8, top-k 40)")
    sampling = GenerationConfig.of(
        max_new_tokens=80,
        do_sample=True,
        temperature=0.8,
        top_k=40,
        seed=0,
        eos_token_id=tokenizer.eot_id,
    )
    for c in complete(for_inference(model, "float32"), tokenizer, PROMPTS, sampling):
        print("      " + "\n      ".join(f">>> {c.prompt}{c.text}".splitlines()[:8]))

    print("[4/4] evaluate and plot")
    scores = evaluate_tokens(model, TokenData(data_dir).split("val"), tokenizer.token_bytes())
    print(
        f"      validation: {scores['loss']:.3f} nats/token, "
        f"perplexity {scores['perplexity']:.1f}, {scores['bits_per_byte']:.3f} bits/byte"
    )
    _plot_attention(model, tokenizer, out / "plots" / "attention.png")
    print(
        f"\nDone in {time.perf_counter() - started:.0f} s. Look at:\n"
        f"  {out / 'plots' / 'loss.png'}        loss against tokens and time\n"
        f"  {out / 'plots' / 'attention.png'}   what each head attends to\n"
        f"  {out / 'MODEL_CARD.md'}          data, sizes, results, limits\n"
        f'  tlm generate {out} --prompt "The while statement" --do-sample --temperature 0.8'
    )
    return 0


def _chat_for(out: Path, args: argparse.Namespace) -> None:
    """The chat demo's assistant at `out` (align's starting point), made now."""
    values = {"inputs": ["chat"], "data": None, "max_steps": None, "base": "runs/demo"}
    run(
        argparse.Namespace(
            **values, out=str(out), vocab_size=1024, quiet=args.quiet, device=args.device
        )
    )


def pretrain(out: Path, quiet: bool, device: str) -> None:
    """The main demo's run at `out` (the chat demo's base), on `device`."""
    defaults = {"inputs": ["python-stdlib"], "data": "data/demo", "max_steps": 800}
    run(argparse.Namespace(**defaults, out=str(out), vocab_size=1024, quiet=quiet, device=device))


def _claim(folders: list[tuple[Path, tuple[str, ...], str]]) -> None:
    """The demo may replace folders it made before, holding nothing else, and no others.

    Every folder is checked before any is removed."""
    for folder, files, signature in folders:
        check_unlocked(folder)  # a run being trained right now is not replaced
        if folder.exists() and not (folder / MARKER).is_file():
            fail(f"{folder} exists and was not made by tlm demo; choose another --data/--out")
        check_replaceable(folder, files, signature, "a folder made by tlm demo")
    for folder, _, _ in folders:
        if folder.exists():
            shutil.rmtree(folder)


def _plot_attention(model, tokenizer, path: Path) -> None:
    ids = document_ids(tokenizer, "for item in items:\n    print(item)")[:24]
    patterns = attention_patterns(model, torch.tensor([ids]))  # moved to the model's device
    tokens = [tokenizer.decode([i]) for i in ids]
    plot_attention(patterns, tokens, path)
