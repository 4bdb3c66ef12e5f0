"""`tlm export-hf`: write a run as a Hugging Face GPT-2, GPT-NeoX or MarianMTModel directory;
`tlm export-gguf`: as one GGUF file for llama.cpp."""

from __future__ import annotations

import argparse
from pathlib import Path

from tlm.cli.args import (
    add_command,
    add_long_context_flags,
    add_model_flags,
    long_context_flags,
)
from tlm.interop.gguf import TYPES
from tlm.kinds import writer_of
from tlm.load import load_model, load_tokenizer, source_of

EXAMPLE = """example:
  tlm export-hf runs/shakespeare_char out/shakespeare_hf
  tlm export-hf runs/shakespeare_char out/shakespeare_best --weights best   # --keep-best
  tlm export-hf runs/demo out/demo_hf        # a rotary run: GPTNeoXForCausalLM
  then, in Python: AutoModelForCausalLM.from_pretrained("out/shakespeare_hf")

Learned or sinusoidal positions are written as GPT-2 (sinusoidal as GPT-2's position
table), rotary ones as GPT-NeoX (full rotary, sequential block). Both are pre-norm with
d_head = d_model / n_heads and no query/key norm; a run with no positions, post-norm,
another d_head or qk_norm is refused, naming the field. Missing biases become zeros.

A translation run (encoder-decoder) is written as MarianMTModel, the paper's post-norm
model: pre-norm, learned positions or another d_head are refused. Give the source's
attention_mask when calling it: <|endoftext|> is also Marian's pad token.
"""


GGUF_EXAMPLE = """example:
  tlm export-gguf runs/demo out/demo.gguf                 # f32
  tlm export-gguf runs/demo out/demo-q8_0.gguf --type q8_0
  then: llama-cli -m out/demo-q8_0.gguf -p "The" -n 64, or tlm generate out/demo-q8_0.gguf

Learned or sinusoidal positions are written as llama.cpp's gpt2 architecture, rotary ones
as gptneox (full rotary, sequential block); the vocabulary (BPE or characters) as its gpt2
tokenizer. Vectors stay f32; --type sets the matrices: f32, f16, q8_0, q4_0 and q4_k as
tlm's --dtype of the same name runs them (the 4-bit types' embeddings and head in Q8_0),
q4_k_m as llama.cpp's Q4_K_M mix (Q6_K for the head and, in three layers of eight, for
attn_qkv and ffn_down; Q4_K elsewhere). llama.cpp computes GELU with the tanh
approximation; a ReLU run, post-norm, another d_head or qk_norm is refused, naming the field.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "export-hf", "write a run as a Hugging Face model directory", EXAMPLE)
    parser.add_argument("run", help="run directory (or a Hugging Face directory)")
    parser.add_argument("out", help="the folder to create (must not exist or be empty)")
    add_model_flags(parser, device=False)  # written, never run: read on the CPU
    add_long_context_flags(parser)
    parser.set_defaults(handler=run)
    parser = add_command(sub, "export-gguf", "write a run as a GGUF file (llama.cpp)", GGUF_EXAMPLE)
    parser.add_argument("run", help="run directory (or a Hugging Face directory)")
    parser.add_argument("out", help="the .gguf file to write (must not exist)")
    parser.add_argument("--type", choices=TYPES, default="f32", help="the matrices' type")
    add_model_flags(parser, device=False)  # written, never run: read on the CPU
    add_long_context_flags(parser)
    parser.set_defaults(handler=run_gguf)


def run(args: argparse.Namespace) -> int:
    card = Path(args.run) / "MODEL_CARD.md"
    source = source_of(args.run)
    model = load_model(source, weights=args.weights, **long_context_flags(args))
    writer = writer_of(model.config, "export-hf").writer  # GPT-2, GPT-NeoX or Marian
    out = writer.write(model, load_tokenizer(source), args.out, card=card)
    print(f"wrote {out}: load it with {writer.opens_with}.from_pretrained({str(out)!r})")
    return 0


def run_gguf(args: argparse.Namespace) -> int:
    source = source_of(args.run)
    model = load_model(source, weights=args.weights, **long_context_flags(args))
    writer = writer_of(model.config, "export-gguf").writer
    out = writer.write(model, load_tokenizer(source), args.out, args.type)
    size = out.stat().st_size / 2**20
    print(
        f"wrote {out} ({args.type}, {size:.1f} MiB): run it with {writer.opens_with}, "
        f"or tlm generate {out}"
    )
    return 0
