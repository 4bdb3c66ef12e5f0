"""`tlm prepare`: corpus -> tokenizer + packed token files."""

from __future__ import annotations

import argparse

from tlm.cli.args import add_command, fail
from tlm.data import prepare, prepare_chat, prepare_pairs, prepare_preference, prepare_prompts
from tlm.data.canaries import parse_repeats
from tlm.data.chat import BUILTIN_CHAT
from tlm.data.clean import REASONS, CleanConfig
from tlm.data.corpus import BUILTIN

EXAMPLE = """examples:
  tlm prepare python-docs --tokenizer bpe --vocab-size 2048 --out data/python-docs
  tlm prepare python-stdlib --tokenizer bpe --vocab-size 2048 --out data/python-stdlib
  tlm prepare tinyshakespeare --tokenizer char --val-fraction 0.1 --out data/shakespeare_char
  tlm prepare names --line-docs --tokenizer char --out data/names   # one document per name
  tlm prepare more.txt --tokenizer runs/my_model --out data/finetune   # reuse a tokenizer
  tlm prepare web/ --dedup --min-chars 200 --max-non-text 0.2 --blocklist bad.txt --out data/web
  tlm prepare --task chat python-qa --tokenizer runs/demo --out data/python-qa   # chat
  tlm prepare --task chat chats.jsonl --tokenizer runs/base --out data/chats  # messages or ShareGPT
  tlm prepare --task translate --src train.en.gz --tgt train.de.gz --val-src val.en.gz \\
      --val-tgt val.de.gz --vocab-size 8000 --out data/multi30k   # one BPE, both languages
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "prepare", "train a tokenizer and pack a corpus into token files", EXAMPLE
    )
    parser.add_argument(
        "inputs",
        nargs="*",
        help=f"files, folders, globs, or a built-in corpus: {', '.join(BUILTIN)} "
        f"(--task chat: .jsonl/.parquet/.arrow conversations, or {', '.join(BUILTIN_CHAT)})",
    )
    pairs = parser.add_argument_group("translation (--task translate): two aligned files")
    pairs.add_argument(
        "--task",
        choices=("lm", "chat", "preference", "prompts", "translate"),
        default="lm",
        help="lm (default), chat (conversations for instruction tuning), preference (pairs "
        "for DPO: prompt, chosen, rejected), prompts (prompt, answer: for verifiers), translate",
    )
    pairs.add_argument("--src", help="source sentences, one a line (.txt or .gz)")
    pairs.add_argument("--tgt", help="their translations, line for line")
    pairs.add_argument("--val-src", help="validation sources (else the last --val-fraction)")
    pairs.add_argument("--val-tgt", help="validation targets")
    parser.add_argument("--out", required=True, help="folder to create")
    parser.add_argument(
        "--tokenizer",
        default="bpe",
        help="bpe (default), char, or an existing tokenizer.json / run / data folder to reuse",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (4096)")
    parser.add_argument("--val-fraction", type=float, help="held-out share (0.1; translation 0.05)")
    parser.add_argument("--line-docs", action="store_true", help="one document per line")
    parser.add_argument(
        "--text-field", default="text", help="the text's field or column (.jsonl, .parquet, .arrow)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace --out if tlm prepare wrote it (and nothing else is in it)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--workers", type=int, default=1, help="processes that encode the text (1: this one)"
    )
    parser.add_argument(
        "--shard-tokens", type=int, help="write each split as files of at most this many tokens"
    )
    audit = parser.add_argument_group("privacy (J&M §10.10): canaries for tlm audit, personal data")
    audit.add_argument(
        "--canary-repeats", metavar="N,N,...", help="plant one random secret per count, that often"
    )
    audit.add_argument("--canary-seed", type=int, default=0, help="seed of the secrets (0)")
    audit.add_argument(
        "--pii", choices=("report", "mask"), help="count personal data, or mask it as <EMAIL>..."
    )
    audit.add_argument("--pii-region", default="US", help="phone numbers' default region (US)")
    clean = parser.add_argument_group("cleaning (J&M §10.9.2; any of these turns it on)")
    clean.add_argument(
        "--dedup", action="store_true", help="drop exact and near duplicate documents"
    )
    clean.add_argument("--near-threshold", type=float, help="Jaccard of a near duplicate (0.8)")
    clean.add_argument("--num-perm", type=int, help="MinHash permutations (128)")
    clean.add_argument("--shingle", type=int, help="words per shingle (5)")
    clean.add_argument("--minhash-seed", type=int, help="seed of the MinHash permutations (1)")
    clean.add_argument("--min-chars", type=int, help="drop shorter documents")
    clean.add_argument("--max-non-text", type=float, help="drop documents with more non-text")
    clean.add_argument("--blocklist", help="drop documents with a word or phrase of this file")
    parser.set_defaults(handler=run)


CLEANING = {  # flag attribute -> CleanConfig field
    "near_threshold": "threshold",
    "num_perm": "num_perm",
    "shingle": "shingle",
    "minhash_seed": "seed",
    "min_chars": "min_chars",
    "max_non_text": "max_non_text",
    "blocklist": "blocklist",
}


def clean_config(args: argparse.Namespace) -> CleanConfig | None:
    """The cleaning asked for: None without any cleaning flag; dedup only with --dedup."""
    given = {field: getattr(args, flag) for flag, field in CLEANING.items()}
    given = {field: value for field, value in given.items() if value is not None}
    if not args.dedup and not given:
        return None
    return CleanConfig(exact=args.dedup, near=args.dedup, **given)


def run(args: argparse.Namespace) -> int:
    if args.task == "translate":
        return run_pairs(args)
    if args.task in ("chat", "preference", "prompts"):
        return run_chat(args)
    if args.src or args.tgt:
        fail("--src and --tgt go with --task translate")
    if not args.inputs:
        fail("give the corpus to prepare: files, folders, globs or a built-in name")
    meta = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=0.1 if args.val_fraction is None else args.val_fraction,
        line_docs=args.line_docs,
        force=args.force,
        text_field=args.text_field,
        progress=not args.quiet,
        clean=clean_config(args),
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        canary_repeats=None if args.canary_repeats is None else parse_repeats(args.canary_repeats),
        canary_seed=args.canary_seed,
        pii=args.pii,
        pii_region=args.pii_region,
    )
    splits = meta["splits"]
    print(
        f"{args.out}: {meta['tokenizer']} tokenizer, vocabulary {meta['vocab_size']}, "
        f"{meta['documents']:,} documents, {splits['train']['tokens']:,} train + "
        f"{splits['val']['tokens']:,} val tokens ({meta['id_dtype']})"
    )
    if "cleaning" in meta:
        counts = meta["cleaning"]["counts"]
        removed = [f"{n:,} {k.replace('_', ' ')}" for k, n in counts.items() if k in REASONS and n]
        kept = f"{counts['kept']:,} of {counts['documents']:,} documents kept"
        print(f"cleaning: {kept}; removed: {', '.join(removed) or 'none'}")
    if "pii" in meta:
        found = ", ".join(f"{n:,} {kind}" for kind, n in meta["pii"]["counts"].items())
        done = "masked" if meta["pii"]["mode"] == "mask" else "left in"
        print(f"personal data: {found} ({done})")
    if "canaries" in meta:
        repeats = ", ".join(str(c["repeats"]) for c in meta["canaries"])
        n = len(meta["canaries"])
        print(f"canaries: {n} secret{'s' * (n > 1)} planted {repeats} times (meta.json)")
    return 0


def run_pairs(args: argparse.Namespace) -> int:
    if args.pii or args.canary_repeats:
        fail("--pii and --canary-repeats apply to one text stream (--task lm)")
    if args.inputs:
        fail("--task translate reads --src and --tgt, not positional inputs")
    if not (args.src and args.tgt):
        fail("--task translate needs --src FILE and --tgt FILE")
    fraction = 0.05 if args.val_fraction is None else args.val_fraction
    meta = prepare_pairs(
        args.src,
        args.tgt,
        args.out,
        val_src=args.val_src,
        val_tgt=args.val_tgt,
        val_fraction=fraction,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        force=args.force,
    )
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    skipped = train["skipped_empty"] + val["skipped_empty"]
    print(
        f"{args.out}: {meta['tokenizer']} tokenizer shared by both languages, vocabulary "
        f"{meta['vocab_size']}, {train['pairs']:,} train + {val['pairs']:,} val pairs "
        f"({train['src_tokens']:,} + {train['tgt_tokens']:,} train tokens); "
        f"{skipped:,} pairs skipped for an empty side"
    )
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """--task chat (conversations) and --task preference (pairs of answers to prefer)."""
    if args.src or args.tgt or args.pii or args.canary_repeats or clean_config(args):
        fail(
            f"--task {args.task} reads its files as they are: no --src/--tgt, cleaning or canaries"
        )
    tasks = {"chat": prepare_chat, "preference": prepare_preference, "prompts": prepare_prompts}
    prepare_task = tasks[args.task]
    meta = prepare_task(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=0.1 if args.val_fraction is None else args.val_fraction,
        force=args.force,
    )
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    unit = {"chat": "conversations", "preference": "pairs", "prompts": "prompts"}[args.task]
    print(
        f"{args.out}: {meta['tokenizer']} tokenizer with the chat template's tokens, vocabulary "
        f"{meta['vocab_size']}, {train[unit]:,} train + {val[unit]:,} val {unit} "
        f"({train['tokens']:,} + {val['tokens']:,} tokens, "
        f"{train['supervised']:,} + {val['supervised']:,} learned)"
    )
    return 0
