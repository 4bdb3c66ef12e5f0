"""`TransformerLM.generate`: whole sequences out, as Hugging Face's `generate` gives them.

The decoding loop (`decode.generate`) yields the tokens step by step; this collects them
into [B*n, T + new], rows that end early padded with their end token, and with `best_of`
keeps each prompt's n likeliest candidates (`GenerationConfig.candidates`, `best_rows`).
Beam search returns its own sequences. The model's method reaches this function without
importing it: the package's root provides it (`tlm/upcalls.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tlm.device import placement
from tlm.generate.beam import beam_search
from tlm.generate.config import GenerationConfig
from tlm.generate.decode import best_rows, generate
from tlm.inference import Decoder


def generate_sequences(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    decoder: Decoder | None = None,
    **settings,
) -> Tensor:
    """input_ids [B,T] -> [B*n, T + new]; `settings` are `GenerationConfig`'s (None: the
    default); `decoder` as `decode.generate` takes it. The sequences are on the model's
    device, wherever the ids came from (as Hugging Face's are)."""
    config = GenerationConfig.of(**settings)
    input_ids = input_ids.to(placement(model)[0])
    if config.num_beams > 1:
        return beam_search(model, input_ids, config, attention_mask).sequences
    config, n = config.candidates()
    drawn = config.num_return_sequences
    steps = list(generate(model, input_ids, config, attention_mask, decoder))
    if not steps:  # max_new_tokens 0: every candidate is its prompt
        return input_ids.repeat_interleave(n, dim=0)
    prompts = input_ids.repeat_interleave(drawn, dim=0)
    out = torch.cat([prompts, torch.stack([s.tokens for s in steps], dim=1)], dim=1)
    if drawn > n:  # a row's log-probabilities are 0 once it has ended
        totals = torch.stack([s.logprobs for s in steps], dim=1).sum(dim=1)
        out = out[best_rows(totals, drawn, n)]
    return out
