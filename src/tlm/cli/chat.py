"""`tlm chat`: talk to an assistant (a run fine-tuned on conversations) in the terminal."""

from __future__ import annotations

import argparse
import sys

from tlm.chat import ChatError, speaks
from tlm.cli.args import (
    add_command,
    add_long_context_flags,
    add_model_flags,
    fail,
    long_context_flags,
    model_device,
)
from tlm.generate import GenerationConfig
from tlm.generate.chat import chat_prompt, reply_room, stream_reply
from tlm.inference import FORMATS, Decoder
from tlm.inference.prefix_cache import PrefixCache, position_bytes
from tlm.load import load_language_model, load_tokenizer

EXAMPLE = """examples:
  tlm chat runs/demo-chat                          # type, Enter; /reset forgets; Ctrl-D quits
  tlm chat runs/demo-chat --message "What does json.dumps do?"   # one reply on stdout
  tlm chat runs/demo-chat --system "You answer questions about Python." --do-sample
"""
COMMANDS = "/reset forgets the conversation, /exit (or Ctrl-D) quits"


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "chat", "talk to a run fine-tuned on conversations", EXAMPLE)
    parser.add_argument("run", help="run directory (made with tlm train --data CHATDIR)")
    parser.add_argument("--message", help="one user message: print the reply and exit")
    parser.add_argument("--system", help="a system message that opens the conversation")
    defaults = GenerationConfig()
    parser.add_argument("--max-new-tokens", type=int, help=f"per reply ({defaults.max_new_tokens})")
    parser.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=float, help="with --do-sample (1.0)")
    parser.add_argument("--top-k", type=int, help="with --do-sample: keep the k likeliest")
    parser.add_argument("--top-p", type=float, help="with --do-sample: nucleus of mass p")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--dtype", default="float32", choices=FORMATS, help="weights (float32)")
    add_model_flags(parser)
    add_long_context_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for name in ("temperature", "top_k", "top_p"):
        if getattr(args, name) is not None and not args.do_sample:
            fail(f"--{name.replace('_', '-')} applies to sampling: add --do-sample")
    tokenizer = load_tokenizer(args.run)
    if not speaks(tokenizer):
        fail(
            f"{args.run} has no chat template (a base model continues text): fine-tune it with "
            f"tlm train --init-from {args.run} --data CHATDIR, or use tlm generate"
        )
    device = model_device(args, args.dtype)
    model = load_language_model(
        args.run, device, args.weights, args.dtype, **long_context_flags(args)
    )
    config = GenerationConfig.of(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    opening = [{"role": "system", "content": args.system}] if args.system else []
    decoder = conversation_decoder(model)
    if args.message is not None:
        asked = [*opening, {"role": "user", "content": args.message}]
        say(model, tokenizer, asked, config, decoder)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.run}; {COMMANDS}", file=sys.stderr)
    history = list(opening)
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        message = line.rstrip("\n")
        if message.strip() == "/reset":
            history = list(opening)
            print("(the conversation is forgotten)", file=sys.stderr)
            continue
        if not message.strip():
            continue
        asked = [*history, {"role": "user", "content": message}]
        try:
            reply, kept = say(model, tokenizer, asked, config, decoder)
        except ChatError as exc:  # a message too long for the context: say so, go on
            print(f"tlm: {exc}", file=sys.stderr)
            continue
        if not reply.strip():  # an empty turn cannot be rendered: the exchange is forgotten
            print("(no reply)", file=sys.stderr)
            continue
        history = [*kept, {"role": "assistant", "content": reply}]  # the turns that fit go on


def conversation_decoder(model) -> Decoder:
    """The decoder every turn runs on, with a prefix cache of four contexts' keys and values:
    a turn prefills only what it adds to the conversation (the last reply's end, the new
    message); once the oldest turns are dropped the text begins anew, and is prefilled
    once more."""
    decoder = Decoder(model)
    per_position = position_bytes(model.config, decoder.dtype)
    decoder.prefix = PrefixCache(4 * model.config.context_length * per_position)
    return decoder


def say(model, tokenizer, messages: list[dict[str, str]], config: GenerationConfig, decoder=None):
    """Stream the reply to `messages` to stdout (on the conversation's `decoder`); returns
    (its text, the messages its prompt kept: `chat_prompt` drops the oldest turns that do
    not fit)."""
    T = model.config.context_length
    prompt = chat_prompt(messages, tokenizer, T, reply_room(config.max_new_tokens, T))
    if prompt.dropped:
        print(
            f"(the context of {T} tokens is full: the oldest {prompt.dropped} turns are dropped)",
            file=sys.stderr,
        )
    pieces = []
    for piece in stream_reply(model, tokenizer, prompt, config, decoder):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces), prompt.messages
