"""Looking inside a model (§9.5): activations by name, interventions, attention, logit lens."""

from tlm.interpret.attention import attention_patterns, plot_attention
from tlm.interpret.hooks import HookError, ablate_head, hooks, run_with_cache

__all__ = [
    "HookError",
    "ablate_head",
    "attention_patterns",
    "hooks",
    "plot_attention",
    "run_with_cache",
]
