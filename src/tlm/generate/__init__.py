"""Decoding (J&M §10.8): pure functions on logits, the decoding loop, beam search, text.

The model never sees text: `generate` takes token ids and yields token ids, step by step.
One core serves every entry point: `GenerationConfig.of` builds the settings,
`choose_rows` picks every row's next token (its steps composed by `sampling.choose`),
`window_start` slides the context, `StopText` holds back stop strings, and `beam.search`
is the one beam search (language model and translation).
"""

from tlm.generate.beam import BeamResult, beam_search
from tlm.generate.config import GenerationConfig
from tlm.generate.decode import DecodeState, Step, best_rows, generate
from tlm.generate.errors import GenerationError
from tlm.generate.sampling import (
    adjust_logits,
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
    apply_temperature,
    choose,
    greedy,
    process_logits,
    sample,
    top_k_filter,
    top_p_filter,
)
from tlm.generate.slots import window_start
from tlm.generate.stops import StopText, first_stop
from tlm.generate.text import (
    Completion,
    complete,
    encode_prompts,
    score_prompts,
    stream_completion,
)

__all__ = [
    "BeamResult",
    "Completion",
    "DecodeState",
    "GenerationConfig",
    "GenerationError",
    "Step",
    "StopText",
    "adjust_logits",
    "apply_frequency_presence",
    "apply_logit_bias",
    "apply_repetition_penalty",
    "apply_temperature",
    "beam_search",
    "best_rows",
    "choose",
    "complete",
    "encode_prompts",
    "first_stop",
    "generate",
    "greedy",
    "process_logits",
    "sample",
    "score_prompts",
    "stream_completion",
    "top_k_filter",
    "top_p_filter",
    "window_start",
]
