"""Looking inside a model (§9.5): activations by name, interventions, attention patterns,
the logit lens, direct logit attribution, activation patching, contextual embeddings."""

from tlm.interpret.attention import attention_patterns, cross_attention_patterns
from tlm.interpret.attribution import Attribution, direct_logit_attribution
from tlm.interpret.embeddings import cosine_across_contexts, word_vectors
from tlm.interpret.hooks import HookError, ablate_head, hooks, run_with_cache
from tlm.interpret.lens import LogitLens, logit_lens, residual_stream
from tlm.interpret.patching import Patch, Sweep, patching_sweep, run_patched
from tlm.interpret.plots import (
    plot_attention,
    plot_attention_grid,
    plot_logit_lens,
    plot_patching,
    plot_residual_norms,
)

__all__ = [
    "Attribution",
    "HookError",
    "LogitLens",
    "Patch",
    "Sweep",
    "ablate_head",
    "attention_patterns",
    "cosine_across_contexts",
    "cross_attention_patterns",
    "direct_logit_attribution",
    "hooks",
    "logit_lens",
    "patching_sweep",
    "plot_attention",
    "plot_attention_grid",
    "plot_logit_lens",
    "plot_patching",
    "plot_residual_norms",
    "residual_stream",
    "run_patched",
    "run_with_cache",
    "word_vectors",
]
