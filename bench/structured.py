"""Structured outputs: llguidance (through tlm's `Grammar`) beside xgrammar and outlines-core,
the measurement that chose the library of `generate/constrain.py` (not a test).

    make demo && python bench/structured.py       # about a minute on 2 quiet cores
    python bench/structured.py --quick            # 20 walks, 16 steps, a 2-layer model

Vocabularies: the demo's (1,024 BPE) and a 50,257-token byte-level BPE that tlm's own
`BPETokenizer.train` makes of this Python's standard library and Tiny Shakespeare (cached
under --work). Peers: xgrammar 0.2.8 and outlines-core 0.2.14, installed under --work the
first time without their dependencies (torch, pydantic, transformers, numpy: tlm's own); if
they cannot be, llguidance alone. Each is asked for compact JSON (llguidance:
whitespace_flexible False, tlm's default; xgrammar: any_whitespace=False, separators ","
":"; outlines-core: whitespace_pattern ""). llguidance goes through `Grammar` and `Matcher`.

1. Per library x vocabulary x schema (bounded: maxLength, minimum/maximum, enum, maxItems,
   a nested object; formats: number bounds, pattern, minLength, format date, mixed enum):
   compile ms, the tokenizer's bridge and the grammar the first time (a fresh tokenizer);
   mask ms, one step's [B,V] bool of allowed tokens for every row (what tlm's `choose`
   takes), batch 1 and 8, the mean over random walks' steps (the first not counted); and
   --walks random walks at batch 1 (each token uniformly among the allowed, until the end
   token or 400 tokens): how many parse and validate (`jsonschema_rs`, formats checked),
   are invalid, did not end, got stuck (no token allowed, or a token the mask allowed
   refused), are compact (no whitespace outside strings); below, what the failures broke.
2. End to end: `tlm.generate.complete`, greedy, random GPT-2 124M-shape weights on the
   50,257 vocabulary, batch 1 and 8, the bounded schema with up to 48 new tokens against
   no grammar for as many steps (the prompt's pass in both), alternating, best of
   --rounds: ms per step and what the grammar adds to one.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import jsonschema_rs
import numpy as np
import torch
from _grammars import Llguidance, OutlinesCore, XGrammar, stderr_into
from _peers import host

from tlm import ModelConfig, TransformerLM
from tlm.generate import GenerationConfig, GenerationError, complete
from tlm.generate.constrain import Grammar
from tlm.inference import for_inference
from tlm.tokenizer import BPETokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("xgrammar==0.2.8", "apache-tvm-ffi", "outlines-core==0.2.14")
GPT2 = {"vocab_size": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "context_length": 1024}
LONGEST = 400  # tokens of a random walk that has not ended

ADDRESS = {
    "type": "object", "required": ["city", "zip"], "additionalProperties": False,
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
    },
}  # fmt: skip
BOUNDED = {
    "type": "object", "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": ADDRESS,
    },
}  # fmt: skip
FORMATS = {
    "type": "object", "required": ["x", "word", "day", "pick"], "additionalProperties": False,
    "properties": {
        "x": {"type": "number", "minimum": -5.5, "maximum": 10},
        "word": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 8},
        "day": {"type": "string", "format": "date"},
        "pick": {"enum": ["x", 1, None, True]},
    },
}  # fmt: skip
SCHEMAS = {"bounded": BOUNDED, "formats": FORMATS}
PROMPTS = [
    "A person, as JSON:", "Customer record", "{", "The user's profile in JSON is",
    "Output:", "Here is the data you asked for.", "JSON", "Name, age, color, tags, address:",
]  # fmt: skip


def bpe_50k(work: Path) -> Path:
    """The 50,257-token BPE's file: trained once on the standard library's .py files (not
    its site-packages, which differ from host to host) and Tiny Shakespeare."""
    path = work / "structured-bpe50257.json"
    if not path.is_file():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
        files.append(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")
        print(f"training a 50,257-token BPE on {len(files):,} files (once)", flush=True)
        texts = (p.read_text(encoding="utf-8", errors="replace") for p in files)
        work.mkdir(parents=True, exist_ok=True)
        BPETokenizer.train(texts, 50257).save(path)
    return path


def install_peers(work: Path) -> bool:
    """Whether xgrammar and outlines-core import, from work/structured-peers (pip's, once)."""
    target = work / "structured-peers"
    if not all((target / name).is_dir() for name in ("xgrammar", "outlines_core", "tvm_ffi")):
        print(f"installing {' '.join(PEERS)} into {target} (once)", flush=True)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target)]
        done = subprocess.run([*pip, "--no-deps", *PEERS], capture_output=True, text=True)
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["no message"])[-1]
            print(f"peers not installed ({why}): llguidance alone")
            return False
    sys.path.insert(0, str(target))
    try:
        importlib.import_module("xgrammar"), importlib.import_module("outlines_core")
    except Exception as exc:  # a wheel for another platform, a missing dependency, ...
        print(f"peers not importable ({type(exc).__name__}: {exc}): llguidance alone")
        return False
    return True


def walks(side, tokenizer, batch: int, seed: int, count: int = 0, steps: int = 0):
    """Random walks on `batch` rows at once, a row starting again when its walk ends, until
    `count` walks have ended or `steps` masks have been computed -> (ms per mask, ended walks
    as (tokens, how): how "end", "long" (LONGEST tokens) or "stuck"). The choice is numpy's,
    on one thread: a torch op this large waits for torch's pool, on a busy host for ms."""
    rng = np.random.default_rng(seed)
    rows = [side.start() for _ in range(batch)]
    tokens: list[list[int]] = [[] for _ in range(batch)]
    ended, spent, masks = [], 0.0, 0
    while (count and len(ended) < count) or (steps and masks < steps):
        started = time.perf_counter()
        allowed = side.allowed(rows).numpy()  # [B,V] bool
        spent += (time.perf_counter() - started) if masks else 0.0  # not the first (warm-up)
        masks += 1
        for r in range(batch):
            how = advance(side, rows[r], tokens[r], np.flatnonzero(allowed[r]), rng, tokenizer)
            if how is not None:
                ended.append((tokens[r], how))
                rows[r], tokens[r] = side.start(), []
    return spent / max(masks - 1, 1) * 1e3, ended[:count] if count else ended


def advance(side, row, tokens: list[int], ids: np.ndarray, rng, tokenizer) -> str | None:
    """One step of a walk, its token uniformly among `ids` -> how the walk ended, or None."""
    if ids.size == 0:
        return "stuck"
    token = int(rng.choice(ids))
    if token == tokenizer.eot_id:
        return "end"
    try:
        side.accept(row, token)
    except (GenerationError, ValueError):  # the library refused what its mask allowed
        return "stuck"
    tokens.append(token)
    return "long" if len(tokens) >= LONGEST else None


def compact(text: str) -> bool:
    """No whitespace outside strings (JSON's insignificant whitespace, RFC 8259 §2)."""
    inside = escaped = False
    for ch in text:
        if inside:
            escaped, inside = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            inside = True
        elif ch in " \t\n\r":
            return False
    return True


def verdicts(schema: dict, tokenizer, ended) -> tuple[Counter, Counter, str]:
    """Each walk's verdict (valid, invalid, unended, stuck; compact among those that ended),
    what the invalid ones broke (a JSON error, or a property and the schema keyword it
    fails), and the start of the first walk that did not end."""
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    tally, broken, example = Counter(), Counter(), ""
    for ids, how in ended:
        text = tokenizer.decode(ids)
        if how != "end":
            tally["unended" if how == "long" else "stuck"] += 1
            example = example or f"{how}: {text[:48]!r}"
            continue
        tally["compact"] += compact(text)
        try:
            errors = validator.iter_errors(json.loads(text))
            why = {".".join(map(str, e.instance_path)) + " " + e.schema_path[-1] for e in errors}
        except json.JSONDecodeError as exc:
            why = {f"not JSON ({exc.msg})"}
        tally["invalid" if why else "valid"] += 1
        broken.update(why)
    return tally, broken, example


def part_libraries(libraries, vocabularies: dict[str, Path], walks_n: int, steps: int) -> None:
    print(
        f"\n1. compile; mask ms per step (random walks); {walks_n} random walks at batch 1, "
        f"up to {LONGEST} tokens"
    )
    head = "vocabulary  schema   library         compile ms  mask B=1  mask B=8  B=8 vs llg"
    print(f"{head}  valid  invalid  unended  stuck  compact")
    failures = []
    for vocab, path in vocabularies.items():
        for label, schema in SCHEMAS.items():
            first = None
            for library in libraries:
                tokenizer = load_tokenizer(path)  # a fresh one: no bridge cached
                started, notes = time.perf_counter(), []
                with stderr_into(notes):
                    side = library(schema, tokenizer)
                compiled = (time.perf_counter() - started) * 1e3
                one, ended = walks(side, tokenizer, 1, seed=0, count=walks_n)
                eight, _ = walks(side, tokenizer, 8, seed=1, steps=steps)
                first = first or eight
                tally, broken, example = verdicts(schema, tokenizer, ended)
                print(
                    f"{vocab:11s} {label:8s} {side.name:14s} {compiled:11.1f} {one:9.3f} "
                    f"{eight:9.3f} {eight / first:10.2f}x {tally['valid']:6d} "
                    f"{tally['invalid']:8d} {tally['unended']:8d} {tally['stuck']:6d} "
                    f"{tally['compact']:8d}"
                )
                why = [f"{what} x{n}" for what, n in broken.most_common()] + [example]
                why += [f"{side.name} said: {note}" for note in dict.fromkeys(notes)]
                if any(why):
                    failures.append(f"{vocab} {label} {side.name}: {'; '.join(filter(None, why))}")
    print("\nwhat the walks that failed broke:" if failures else "\nno walk failed")
    for line in failures:
        print(f"  {line}")


def step_ms(model, tokenizer, prompts: list[str], config: GenerationConfig) -> tuple[float, int]:
    """ms per step of one `complete` call (its prompt pass included), and its steps."""
    started = time.perf_counter()
    done = complete(model, tokenizer, prompts, config)
    spent = time.perf_counter() - started
    steps = max(len(c.tokens) + (c.finish_reason == "eos") for c in done)  # the end token's
    return spent / steps * 1e3, steps


def part_end_to_end(tokenizer, shape: dict, rounds: int, new: int = 48) -> None:
    torch.manual_seed(0)
    model = for_inference(TransformerLM(ModelConfig(**shape, activation="gelu_tanh")), "float32")
    grammar = Grammar.json_schema(BOUNDED, tokenizer)
    print(
        f"\n2. end to end: `complete`, greedy, random weights ({shape['n_layers']} layers, "
        f"d {shape['d_model']}, V {shape['vocab_size']:,}), the bounded schema, up to {new} "
        f"new tokens; without it: as many steps; best of {rounds}"
    )
    print("batch  steps  without ms/step  with ms/step  grammar ms/step  with/without  tok/s")
    for batch in (1, 8):
        prompts = PROMPTS[:batch]
        constrained = GenerationConfig(max_new_tokens=new, grammar=grammar)
        _, steps = step_ms(model, tokenizer, prompts, constrained)
        free = GenerationConfig(max_new_tokens=steps)
        step_ms(model, tokenizer, prompts, free)
        without, with_ = [], []
        for _ in range(rounds):
            without.append(step_ms(model, tokenizer, prompts, free)[0])
            with_.append(step_ms(model, tokenizer, prompts, constrained)[0])
        a, b = min(without), min(with_)
        print(
            f"{batch:5d} {steps:6d} {a:16.2f} {b:13.2f} {b - a:16.2f} {b / a:12.2f}x "
            f"{batch * 1e3 / b:6.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--walks", type=int, default=100, help="random walks at batch 1")
    parser.add_argument("--steps", type=int, default=200, help="masked steps at batch 8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="20 walks, 16 steps, 2 layers")
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "bench")
    args = parser.parse_args()
    if not (args.run / "tokenizer.json").is_file():
        raise SystemExit(f"no run at {args.run}: run `make demo` first, or give --run")
    shape = GPT2
    if args.quick:
        args.walks, args.steps, args.rounds = min(args.walks, 20), min(args.steps, 16), 1
        shape = {**GPT2, "d_model": 64, "n_layers": 2, "n_heads": 2}
    started = time.perf_counter()
    vocabularies = {
        f"{load_tokenizer(args.run).vocab_size:,}": args.run / "tokenizer.json",
        "50,257": bpe_50k(args.work),
    }
    libraries = [Llguidance]
    if install_peers(args.work):
        libraries += [XGrammar, OutlinesCore]
    versions = ", ".join(f"{s.name} {importlib.metadata.version(s.name)}" for s in libraries)
    print(f"{host()}, {torch.get_num_threads()} threads; {versions}")
    print(f"load average {os.getloadavg()[0]:.1f} at the start (a busy host slows every figure)")
    part_libraries(libraries, vocabularies, args.walks, args.steps)
    part_end_to_end(load_tokenizer(vocabularies["50,257"]), shape, args.rounds)
    print(f"\n{time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
