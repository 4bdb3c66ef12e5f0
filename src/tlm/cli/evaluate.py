"""`tlm eval`: loss, perplexity and bits per byte of a model on a split or on text files."""

from __future__ import annotations

import argparse
import json

from tlm.chat import chat_tokenizer, speaks
from tlm.checkpoint import CheckpointError, read_config
from tlm.cli.args import (
    add_command,
    add_long_context_flags,
    add_model_flags,
    fail,
    long_context_flags,
    model_device,
)
from tlm.data import (
    ChatData,
    PreferenceData,
    PromptData,
    TokenData,
    documents,
    open_data,
    resolve_sources,
)
from tlm.data.labeled import labeled_examples
from tlm.evaluate import evaluate_text, evaluate_tokens
from tlm.inference import FORMATS
from tlm.load import (
    load_encoder,
    load_language_model,
    load_tokenizer,
    load_translation_model,
    model_config,
    source_of,
)
from tlm.model.transformer import TransformerLM
from tlm.tasks.chat import evaluate_chat
from tlm.tasks.labels import evaluate_labeled
from tlm.tasks.preference import evaluate_preference
from tlm.tasks.translation import evaluate_translation
from tlm.tasks.verify import evaluate_verify
from tlm.train.opening import initial_weights
from tlm.train.rewards import reward_of

EXAMPLE = """examples:
  tlm eval runs/shakespeare_char --data data/shakespeare_char --split val --json
  tlm eval runs/shakespeare_char --text some.txt other.txt
  tlm eval runs/shakespeare_char --data data/shakespeare_char --stride 16   # more context
  tlm eval runs/shakespeare_char --data data/shakespeare_char --weights best  # --keep-best
  tlm eval runs/multi30k --task translate --src test.en.gz --ref test.de.gz   # BLEU, chrF
  tlm eval --task chat runs/demo-chat --data data/python-qa   # loss, stop rate, chrF
  tlm eval --task preference runs/dpo --data data/pairs --json   # DPO loss, reward accuracy
  tlm eval --task verify runs/demo-chat --data data/prompts --reward number   # pass@1, pass@8
  tlm eval runs/classifier --data test.jsonl --json   # a fine-tuned encoder: accuracy, F1

--text reads files as `tlm prepare` does (a .txt file is one document, --line-docs one per
line, .jsonl a "text" field per line; folders, globs and built-in corpora too), and puts
<|endoftext|> before every document. An encoder fine-tuned for a task (tlm train --task)
is scored on labeled examples: every one of a --data file, or of a folder's --split file.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "eval", "loss, perplexity and bits per byte", EXAMPLE)
    parser.add_argument("run", help="run directory (or model directory)")
    parser.add_argument("--data", help="prepared data folder (an encoder run: labeled examples)")
    parser.add_argument("--split", default="val", help="train or val (default val)")
    parser.add_argument("--text", nargs="+", metavar="FILE", help="raw UTF-8 text files")
    parser.add_argument("--line-docs", action="store_true", help="with --text: one per line")
    parser.add_argument(
        "--stride",
        type=int,
        help="rolling windows: each new window scores S tokens, with T - S of context before",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--dtype", choices=FORMATS, help="weights (as trained: float32; --task lm, verify, chat)"
    )
    add_model_flags(parser)
    add_long_context_flags(parser)
    pairs = parser.add_argument_group("translation (--task translate): BLEU and chrF")
    pairs.add_argument(
        "--task",
        choices=("lm", "translate", "chat", "preference", "verify"),
        default="lm",
        help="lm (default)",
    )
    pairs.add_argument("--src", help="source sentences, one a line (.txt or .gz)")
    pairs.add_argument("--ref", help="their reference translations, line for line")
    pairs.add_argument("--beams", type=int, default=4, help="beam size (4; 1 is greedy)")
    pairs.add_argument("--alpha", type=float, default=0.6, help="length penalty α (0.6)")
    pairs.add_argument(
        "--examples", type=int, default=0, help="print the first N translations (or replies)"
    )
    chat = parser.add_argument_group("chat (--task chat): held-out conversations of --data")
    chat.add_argument("--max-new-tokens", type=int, default=64, help="per reply (64)")
    chat.add_argument("--limit", type=int, help="the first N conversations only")
    preference = parser.add_argument_group("preference (--task preference): pairs of --data")
    preference.add_argument(
        "--reference",
        help="the reference run (default: the run's --init-from), or none: log π_ref = 0",
    )
    preference.add_argument("--beta", type=float, default=0.1, help="the rewards' β (0.1)")
    verify = parser.add_argument_group("verify (--task verify): prompts of --data, a verifier")
    verify.add_argument("--reward", help="number, regex, json-schema, or module:function")
    verify.add_argument("--samples", type=int, default=8, help="replies a prompt for pass@k (8)")
    verify.add_argument("--seed", type=int, default=0, help="the samples' seed (0)")
    parser.set_defaults(handler=run)


def run_chat(args: argparse.Namespace) -> int:
    if not args.data or args.text or args.src:
        fail("--task chat needs --data DIR, conversations prepared with tlm prepare --task chat")
    data = open_data(args.data)
    if not isinstance(data, ChatData):
        fail(f"{args.data} holds no conversations; prepare them with tlm prepare --task chat")
    model = load_language_model(
        args.run,
        model_device(args, args.dtype),
        args.weights,
        args.dtype,
        **long_context_flags(args),
    )
    tokenizer = load_tokenizer(args.run)
    theirs = load_tokenizer(data.folder)
    if speaks(tokenizer) and tokenizer.to_json() != theirs.to_json():
        fail(f"{args.data} was not tokenized with the tokenizer of {args.run}")
    if not speaks(tokenizer) and chat_tokenizer(tokenizer).to_json() != theirs.to_json():
        fail(f"{args.data} was not prepared with the tokenizer of {args.run} (--tokenizer RUN)")
    results = evaluate_chat(
        model, tokenizer, data, args.split, args.max_new_tokens, args.limit, args.batch_size,
        args.examples,
    )  # fmt: skip
    if args.json:
        print(json.dumps(results, ensure_ascii=False))
        return 0
    loss = f"loss {results['loss']:.4f} nats per learned token, " if "loss" in results else ""
    print(
        f"{loss}stop rate {results['stop_rate']:.1%}, chrF {results['chrf']:.2f} on "
        f"{results['conversations']:,} conversations ({results['template']} template; "
        f"{results['seconds']:.1f} s)"
        + (
            f"; {results['skipped']:,} skipped: a question longer than the context"
            if results["skipped"]
            else ""
        )  # noqa: E501
    )
    for example in results["examples"]:
        print(f"  question:  {example['question']}")
        print(f"  reply:     {example['reply']}")
        print(f"  reference: {example['reference']}")
    return 0


def run_translation(args: argparse.Namespace) -> int:
    if not (args.src and args.ref):
        fail("--task translate needs --src FILE and --ref FILE (the test set)")
    if args.data or args.text:
        fail("--task translate reads --src and --ref, not --data or --text")
    source = source_of(args.run)
    model = load_translation_model(source, model_device(args), args.weights)
    tokenizer = load_tokenizer(source)
    results = evaluate_translation(
        model, tokenizer, args.src, args.ref, args.beams, args.alpha, args.batch_size, args.examples
    )
    if args.json:
        print(json.dumps(results, ensure_ascii=False))
        return 0
    print(
        f"BLEU {results['bleu']:.2f}, chrF {results['chrf']:.2f} on {results['pairs']:,} pairs "
        f"(beam {args.beams}, α {args.alpha}; {results['seconds']:.1f} s); "
        f"{results['bleu_signature']}"
    )
    for example in results["examples"]:
        print(f"  source:      {example['source']}")
        print(f"  translation: {example['translation']}")
        print(f"  reference:   {example['reference']}")
    return 0


def run_preference(args: argparse.Namespace) -> int:
    """DPO's figures of a run on held-out preference pairs (`tasks/preference.py`)."""
    if not args.data or args.text or args.src:
        fail(
            "--task preference needs --data DIR, pairs prepared with tlm prepare --task preference"
        )
    data = open_data(args.data)
    if not isinstance(data, PreferenceData):
        fail(f"{args.data} holds no preference pairs; prepare them with --task preference")
    if not args.beta > 0:
        fail(f"--beta must be > 0, got {args.beta}")
    source, device = source_of(args.run), model_device(args)
    if load_tokenizer(source).to_json() != load_tokenizer(data.folder).to_json():
        fail(f"{args.data} was not prepared with the tokenizer of {args.run} (--tokenizer RUN)")
    reference = args.reference
    if reference is None:  # the run's own reference: the run it was trained from, if any
        try:
            reference = read_config(source.path).get("train", {}).get("init_from") or "none"
        except CheckpointError:  # a Hugging Face directory or a GGUF file: no record
            reference = "none"
    model = load_language_model(source, device, args.weights)
    base = None
    if reference != "none":  # its vocabulary grown to the run's, as training grew it
        base = TransformerLM(model.config, init=False)
        base.load_state_dict(initial_weights(reference, model.config), assign=True)
        base = base.eval().to(device)
    results = evaluate_preference(model, data, args.split, base, args.beta)
    results["reference"] = None if reference == "none" else str(reference)
    if args.json:
        print(json.dumps(results))
        return 0
    print(
        f"DPO loss {results['loss']:.4f}, reward accuracy {results['accuracy']:.1%}, margin "
        f"{results['margin']:.4f} on {results['pairs']:,} {args.split} pairs (reference: "
        f"{results['reference'] or 'none'}, beta {args.beta})"
    )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """pass@1, pass@8 and the greedy pass rate of a run on prompts (`tasks/verify.py`)."""
    if not args.data or args.text or args.src or not args.reward:
        fail("--task verify needs --data DIR (tlm prepare --task prompts) and --reward NAME")
    data = open_data(args.data)
    if not isinstance(data, PromptData):
        fail(f"{args.data} holds no prompts; prepare them with tlm prepare --task prompts")
    if args.samples < 1:
        fail(f"--samples must be >= 1, got {args.samples}")
    reward = reward_of(args.reward)
    source = source_of(args.run)
    tokenizer = load_tokenizer(source)
    if tokenizer.to_json() != load_tokenizer(data.folder).to_json():
        fail(f"{args.data} was not prepared with the tokenizer of {args.run} (--tokenizer RUN)")
    model = load_language_model(source, model_device(args, args.dtype), args.weights, args.dtype)
    results = evaluate_verify(
        model, tokenizer, data, reward, args.split, args.samples, args.max_new_tokens, args.seed
    )
    results["reward"] = args.reward
    if args.json:
        print(json.dumps(results))
        return 0
    pass8 = "" if results["pass8"] is None else f", pass@8 {results['pass8']:.1%}"
    print(
        f"pass@1 {results['pass1']:.1%}{pass8}, greedy {results['greedy']:.1%} on "
        f"{results['prompts']:,} {args.split} prompts ({args.samples} samples each, reward "
        f"{args.reward}; mean reward {results['mean_reward']:.3f}, {results['length']:.1f} tokens)"
    )
    return 0


def run_labeled(args: argparse.Namespace, source) -> int:
    """A fine-tuned encoder's accuracy and F1 on labeled examples."""
    if not args.data or args.text or args.dtype:
        fail("an encoder run is scored on labeled examples: --data FILE (or a folder)")
    model = load_encoder(source, model_device(args), args.weights)
    if model.config.task is None:
        fail(f"{args.run} is a masked-LM encoder: its loss and masked-token accuracy on "
             "validation are in its metrics.jsonl; tlm eval scores a fine-tuned one")  # fmt: skip
    examples = labeled_examples(args.data, model.config.task, model.config.labels, args.split)
    results = evaluate_labeled(model, load_tokenizer(source), examples)
    if args.json:
        print(json.dumps(results))
    else:
        print(f"accuracy {results['accuracy']:.4f}, F1 {results['f1']:.4f} over {results['n']:,}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.task in ("preference", "translate") and args.dtype is not None:
        fail(f"--dtype goes with --task lm, verify and chat (--task {args.task} reads float32)")
    if args.task == "verify":
        return run_verify(args)
    if args.task == "preference":
        return run_preference(args)
    if args.task == "translate":
        return run_translation(args)
    if args.task == "chat":
        return run_chat(args)
    if args.src or args.ref:
        fail("--src and --ref go with --task translate")
    source = source_of(args.run)
    if model_config(source).model_type == "encoder":
        return run_labeled(args, source)
    if bool(args.data) == bool(args.text):
        fail("give either --data DIR (with --split) or --text FILE...")
    device = model_device(args, args.dtype)
    model = load_language_model(
        source, device, args.weights, args.dtype, **long_context_flags(args)
    )
    tokenizer = load_tokenizer(source)
    if args.data:
        data = TokenData(args.data)
        if load_tokenizer(data.folder).to_json() != tokenizer.to_json():
            fail(f"{args.data} was not tokenized with the tokenizer of {args.run}")
        tokens = data.split(args.split)
        scores = evaluate_tokens(
            model, tokens, tokenizer.token_bytes(), args.batch_size, None, True, args.stride
        )
        results = {"split": args.split, **scores}
    else:
        texts = list(documents(resolve_sources(args.text, args.line_docs)))
        if not texts:
            fail(f"{' '.join(args.text)}: no text to evaluate")
        scores = evaluate_text(model, tokenizer, texts, args.batch_size, True, args.stride)
        results = {"text": args.text, **scores}
    if args.stride is not None:
        results["stride"] = args.stride
    if args.json:
        print(json.dumps(results))
    else:
        print(
            f"loss {results['loss']:.4f} nats/token, perplexity {results['perplexity']:.2f}, "
            f"{results['bits_per_byte']:.4f} bits/byte over {results['tokens']:,} tokens "
            f"({results['bytes']:,} bytes)"
        )
    return 0
