"""`tlm info`: the parameter breakdown and FLOPs of a model configuration."""

from __future__ import annotations

import argparse
import json

from tlm.cli.args import add_command, add_config_flags, config_overrides
from tlm.config import ModelConfig
from tlm.load import model_config
from tlm.model.counts import flops_per_token, parameter_counts

EXAMPLE = """examples:
  tlm info --d-model 512 --n-layers 6 --n-heads 8 --vocab-size 50257 --context-length 1024
  tlm info runs/shakespeare_char       # the model of a run, or of a Hugging Face GPT-2 folder
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "info", "parameter counts and FLOPs of a model configuration", EXAMPLE
    )
    parser.add_argument("model", nargs="?", help="a run or Hugging Face GPT-2 directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_flags(parser, ModelConfig, "model")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    overrides = config_overrides(args, ModelConfig)
    if args.model:  # the saved shape, with any flag given on top
        config = model_config(args.model).replace(**overrides)
    else:
        config = ModelConfig(**overrides)
    counts = parameter_counts(config)
    flops = {
        "forward_flops_per_token": flops_per_token(config),
        "training_flops_per_token": flops_per_token(config, training=True),
    }
    if args.json:
        print(json.dumps({"config": config.to_dict(), "parameters": counts, **flops}))
        return 0
    print(describe(config, counts, flops))
    return 0


def describe(config: ModelConfig, counts: dict[str, int], flops: dict[str, int]) -> str:
    c = config
    head = "0 (tied to E)" if c.tie_embeddings else f"{counts['head']:,}"
    rows = [
        ("token embedding E [V, d]", f"{counts['embedding']:,}"),
        (f"positions ({c.position})", f"{counts['positions']:,}"),
        ("attention W_Q W_K W_V W_O", f"{counts['attention']:,}"),
        ("feed-forward W_1 W_2", f"{counts['ffn']:,}"),
        ("layer norms gamma beta", f"{counts['norms']:,}"),
        ("LM head W_U", head),
        ("total", f"{counts['total']:,}"),
        ("non-embedding N", f"{counts['non_embedding']:,}"),
        ("12·L·d² (eq. 10.55)", f"{counts['estimate_12Ld2']:,}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"{_layers(c)}, d_model {c.d_model}, {c.n_heads} heads x "
        f"d_head {c.d_head}, d_ff {c.d_ff}, vocab {c.vocab_size}, context {c.context_length}, "
        f"{c.norm}-norm, {c.position} positions, {c.activation}",
        "parameters:",
        *(f"  {name:<{width}}  {value:>14}" for name, value in rows),
        f"FLOPs per {'source and target token' if c.n_encoder_layers else 'token'} at "
        f"context {c.context_length}: "
        f"forward {flops['forward_flops_per_token']:,}, "
        f"training {flops['training_flops_per_token']:,}",
    ]
    return "\n".join(lines)


def _layers(c: ModelConfig) -> str:
    if c.model_type == "encoder-decoder":  # decoder blocks also hold cross-attention
        return f"EncoderDecoder: {c.n_encoder_layers} encoder + {c.n_layers} decoder layers"
    return f"TransformerLM: {c.n_layers} layers"
