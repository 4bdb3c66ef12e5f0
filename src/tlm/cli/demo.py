"""`tlm demo`: the model of ch. 9 on random weights (the training demo comes with `tlm train`)."""

from __future__ import annotations

import argparse

import torch

from tlm.cli.info import describe
from tlm.config import ModelConfig
from tlm.model import TransformerLM
from tlm.model.counts import flops_per_token, parameter_counts
from tlm.model.hooks import run_with_cache


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="show the model's shapes, sizes and an attention pattern")
    parser.add_argument("--text", default="Thanks for all the fish", help="text to run")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, context_length=64)
    torch.manual_seed(0)
    model = TransformerLM(config.replace(attention_impl="reference")).eval()
    counts = parameter_counts(config)
    flops = {
        "forward_flops_per_token": flops_per_token(config),
        "training_flops_per_token": flops_per_token(config, training=True),
    }
    print(describe(config, counts, flops))
    ids = torch.tensor([list(args.text.encode("utf-8"))[: config.context_length]])
    logits, cache = run_with_cache(model, ids)
    print(f"\ninput_ids {tuple(ids.shape)} -> logits {tuple(logits.shape)} (random weights)")
    for name in ("embed", "blocks.0.attn.q", "blocks.0.attn.pattern", "final"):
        print(f"  {name:<24} {tuple(cache[name].shape)}")
    pattern = cache["blocks.0.attn.pattern"][0, 0, :6, :6]
    print("\nattention pattern α of layer 0, head 0 (first 6 bytes; zero above the diagonal):")
    for row in pattern.tolist():
        print("  " + " ".join(f"{a:.2f}" for a in row))
    return 0
