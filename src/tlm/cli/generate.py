"""`tlm generate`: continue prompts with a trained model (greedy, sampling or beam search)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from tlm.cli.args import (
    add_command,
    add_long_context_flags,
    add_model_flags,
    fail,
    long_context_flags,
    model_device,
    read_text_file,
)
from tlm.generate import GenerationConfig, complete, stream_completion
from tlm.generate.constrain import Grammar
from tlm.inference import FORMATS
from tlm.load import Source, load_language_model, load_tokenizer, source_of

EXAMPLE = """examples:
  tlm generate runs/shakespeare_char --prompt "ROMEO:" --do-sample --temperature 0.8 --stream
  tlm generate runs/demo --prompt "The for statement" --num-beams 4 --max-new-tokens 40
  tlm generate runs/demo --prompt "A list" --prompt "A dict" --do-sample -n 3 --seed 1 --json
  tlm generate runs/demo --prompt-file question.txt --stop "\\n\\n" --dtype int8
  tlm generate runs/shakespeare_char --weights best   # a run trained with --keep-best
  tlm generate runs/demo --prompt "A person:" --json-schema person.json   # JSON, valid
  tlm generate runs/demo --prompt "Call " --regex "[0-9]{3}-[0-9]{4}" --do-sample
"""
SAMPLING = ("temperature", "top_k", "top_p")
SETTINGS = (  # the flags that are GenerationConfig's fields, by the same names
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
    "num_beams", "length_penalty", "num_return_sequences", "seed", "frequency_penalty",
    "presence_penalty", "best_of", "prompt_lookup", "draft_tokens",
)  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "generate", "generate text from prompts", EXAMPLE)
    parser.add_argument("run", help="run directory")
    parser.add_argument("--prompt", action="append", default=[], help="text to continue (repeat)")
    parser.add_argument("--prompt-file", action="append", default=[], help="a file, one prompt")
    defaults = GenerationConfig()  # the one set of defaults (tlm.generate.config)
    parser.add_argument("--max-new-tokens", type=int, help=f"({defaults.max_new_tokens})")
    parser.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument(
        "--temperature", type=float, help=f"with --do-sample; 0 is greedy ({defaults.temperature})"
    )
    parser.add_argument("--top-k", type=int, help="with --do-sample: keep the k likeliest")
    parser.add_argument("--top-p", type=float, help="with --do-sample: nucleus of mass p")
    parser.add_argument("--repetition-penalty", type=float, help="(1.0: none)")
    parser.add_argument(
        "--frequency-penalty", type=float, help="OpenAI's: minus count × this, in [-2, 2] (0)"
    )
    parser.add_argument(
        "--presence-penalty", type=float, help="OpenAI's: minus this once a token appeared (0)"
    )
    parser.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID:BIAS",
        help="add BIAS in [-100, 100] to token ID's logit (repeat; 100 selects it)",
    )
    parser.add_argument(
        "--best-of", type=int, help="draw this many per prompt, print the -n most likely"
    )
    shape = parser.add_mutually_exclusive_group()  # structured outputs (the structured extra)
    shape.add_argument("--json-schema", metavar="FILE", help="write JSON valid against FILE")
    shape.add_argument("--regex", metavar="R", help="write text that matches R whole")
    shape.add_argument("--grammar", metavar="FILE", help="write text of FILE's Lark grammar")
    parser.add_argument(
        "--prompt-lookup",
        type=int,
        metavar="N",
        help="speculative decoding: draft from the text's own n-grams, n <= N (same tokens)",
    )
    parser.add_argument(
        "--draft",
        metavar="RUN|int8",
        help="speculative decoding: a smaller model with the same tokenizer proposes, or int8 "
        "(this model's own weights in int8); the same tokens",
    )
    parser.add_argument(
        "--draft-tokens", type=int, help=f"most tokens a draft proposes ({defaults.draft_tokens})"
    )
    parser.add_argument("--num-beams", type=int, help="beam search with this many (1: none)")
    parser.add_argument("--length-penalty", type=float, help="for beam search (1.0)")
    parser.add_argument("-n", "--num-return-sequences", type=int, help="per prompt (1)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeat)")
    parser.add_argument("--no-eos", action="store_true", help="do not stop at <|endoftext|>")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--prompt-logprobs", action="store_true", help="with --json: score the prompt tokens too"
    )
    parser.add_argument("--dtype", default="float32", choices=FORMATS, help="weights (float32)")
    parser.add_argument("--no-cache", action="store_true", help="recompute every step (slow)")
    add_model_flags(parser)
    add_long_context_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for name in SAMPLING:
        if getattr(args, name) is not None and not args.do_sample:
            fail(f"--{name.replace('_', '-')} applies to sampling: add --do-sample")
    prompts = args.prompt + [read_text_file(path) for path in args.prompt_file] or [""]
    if args.prompt_logprobs and not args.json:
        fail("--prompt-logprobs adds to the --json output: add --json")
    flags = {name: getattr(args, name) for name in SETTINGS}  # named as GenerationConfig's
    config = GenerationConfig.of(
        **flags, use_cache=not args.no_cache, logit_bias=_logit_bias(args.logit_bias)
    )
    if args.stream and (
        len(prompts) > 1
        or config.num_return_sequences > 1
        or config.num_beams > 1
        or (config.best_of or 1) > 1
    ):
        fail("--stream shows one completion: one prompt, -n 1, --num-beams 1, --best-of 1")
    run = source_of(args.run)  # its kind decided once; the model and tokenizer read it
    device = model_device(args, args.dtype)
    model = load_language_model(run, device, args.weights, args.dtype, **long_context_flags(args))
    tokenizer = load_tokenizer(run)
    if not args.no_eos:
        config = replace(config, eos_token_id=tokenizer.eot_id)
    grammar = _grammar(args, tokenizer)
    if grammar is not None:
        config = replace(config, grammar=grammar)
    if args.draft is not None:
        draft = load_draft(
            args.draft, run, args.dtype, args.weights, tokenizer, device, **long_context_flags(args)
        )
        config = replace(config, draft=draft)
    stop = tuple(_unescape(s) for s in args.stop)
    if args.stream:
        sys.stdout.write(prompts[0])
        for text in stream_completion(model, tokenizer, prompts[0], config, stop):
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    completions = complete(model, tokenizer, prompts, config, stop, args.prompt_logprobs)
    if args.json:
        print(json.dumps({"completions": [vars(c) for c in completions]}))
    else:
        for i, c in enumerate(completions):
            if len(completions) > 1:
                print(f"--- {i + 1}/{len(completions)} ({c.finish_reason})")
            print(c.prompt + c.text)
    return 0


def load_draft(draft: str, run: Source, dtype: str, weights: str, tokenizer, device, **rope):
    """--draft: "int8" (packed from the model's own parameters, or read from its `run` in
    int8 where --dtype has packed them already, with the model's `rope` scaling), or a run
    or directory with the same tokenizer (read in int8 when the model is), on the model's
    `device`. Each path's kind is decided once (`source_of`), and its tokenizer and model
    read through it."""
    if draft == "int8" and dtype == "float32":
        return "int8"
    if draft == "int8":
        return load_language_model(run, device, weights, "int8", **rope)
    source = source_of(draft)
    if load_tokenizer(source).pieces() != tokenizer.pieces():
        fail(f"--draft {draft} has another tokenizer: a draft must share this model's")
    return load_language_model(source, device, dtype="int8" if dtype == "int8" else None)


def _grammar(args: argparse.Namespace, tokenizer) -> Grammar | None:
    """--json-schema FILE, --regex R or --grammar FILE (Lark) -> the grammar, if one."""
    if args.json_schema:
        try:
            schema = json.loads(read_text_file(args.json_schema))
        except json.JSONDecodeError as error:
            fail(f"--json-schema {args.json_schema}: not JSON ({error})")
        return Grammar.json_schema(schema, tokenizer)
    if args.regex:
        return Grammar.regex(args.regex, tokenizer)
    if args.grammar:
        return Grammar.lark(read_text_file(args.grammar), tokenizer)
    return None


def _logit_bias(pairs: list[str]) -> dict[int, float] | None:
    """--logit-bias ID:BIAS, repeated -> {id: bias}."""
    bias = {}
    for pair in pairs:
        token, _, value = pair.partition(":")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            fail(f"--logit-bias takes ID:BIAS (such as 50256:-100), got {pair!r}")
    return bias or None


def _unescape(text: str) -> str:
    """`--stop '\n'` as typed means a newline; other characters (é, 中) stay as they are."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
