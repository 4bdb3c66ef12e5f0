"""Decoding (J&M §10.8): pure functions on logits, the cached decoding loop, beam search, text.

The model never sees text: `generate` takes token ids and yields token ids, step by step.
"""

from tlm.generate.beam import BeamResult, beam_search
from tlm.generate.decode import Context, GenerationConfig, Step, generate
from tlm.generate.sampling import (
    GenerationError,
    apply_repetition_penalty,
    apply_temperature,
    greedy,
    process_logits,
    sample,
    top_k_filter,
    top_p_filter,
)
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
    "Context",
    "GenerationConfig",
    "GenerationError",
    "Step",
    "apply_repetition_penalty",
    "apply_temperature",
    "beam_search",
    "complete",
    "encode_prompts",
    "generate",
    "greedy",
    "process_logits",
    "sample",
    "score_prompts",
    "stream_completion",
    "top_k_filter",
    "top_p_filter",
]
