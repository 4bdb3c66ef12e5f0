"""The cost of each sampling option per decoding step (not a test), batch 1 and 8.

    python bench/sampling.py                  # GPT-2 124M shape, fp32 prepared, 2 threads
    python bench/sampling.py --quick          # a 2-layer, d=64 model with a 50,257 vocabulary

Random weights, random 32-token prompts, 32 new tokens with no early stop, through
`tlm.generate.generate` (the one decoding core `tlm generate`, `model.generate` and the
server share). Each option is timed against the same mode without it (greedy or sampled at
temperature 1), alternating, median of --rounds; the figure is milliseconds per step
(one token for every row). Plain greedy takes the C step's own argmax; any option that
changes the logits (logit_bias, the penalties) takes `sampling.choose` over the [B, V]
logits, so its cost is that path's, whatever the option.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _peers import host

from tlm import ModelConfig, TransformerLM
from tlm.generate import GenerationConfig, generate
from tlm.inference import for_inference

GPT2 = {"vocab_size": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "context_length": 1024}
OPTIONS = {
    "logit_bias": {"logit_bias": {i: 1.0 for i in range(0, 50257, 997)}},  # 51 tokens
    "frequency + presence": {"frequency_penalty": 0.5, "presence_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "top_k 40 + top_p 0.9": {"top_k": 40, "top_p": 0.9},
}
MODES = {"greedy": {}, "sampled": {"do_sample": True, "temperature": 1.0, "seed": 0}}


def step_ms(model, batch: int, settings: dict, new: int = 32) -> float:
    ids = torch.randint(
        0, GPT2["vocab_size"], (batch, 32), generator=torch.Generator().manual_seed(1)
    )
    config = GenerationConfig(max_new_tokens=new, **settings)
    stamps = [time.perf_counter() for _ in generate(model, ids, config)]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3  # after the prompt's pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shape = {**GPT2, "d_model": 64, "n_layers": 2, "n_heads": 2} if args.quick else GPT2
    torch.manual_seed(0)
    model = for_inference(TransformerLM(ModelConfig(**shape, activation="gelu_tanh")), "float32")
    layers, d = shape["n_layers"], shape["d_model"]
    print(f"{host()}, {torch.get_num_threads()} threads; {layers} layers, d {d}")
    print("mode     option                 batch   without ms/step   with ms/step   cost ms/step")
    for mode, base in MODES.items():
        for name, option in OPTIONS.items():
            if mode == "greedy" and name.startswith("top_k"):
                continue  # a filter of the sampled distribution: greedy ignores it
            for batch in (1, 8):
                step_ms(model, batch, base), step_ms(model, batch, {**base, **option})
                without, with_ = [], []
                for _ in range(args.rounds):
                    without.append(step_ms(model, batch, base))
                    with_.append(step_ms(model, batch, {**base, **option}))
                a, b = statistics.median(without), statistics.median(with_)
                print(f"{mode:8s} {name:22s} {batch:5d} {a:17.2f} {b:14.2f} {b - a:14.2f}")


if __name__ == "__main__":
    main()
