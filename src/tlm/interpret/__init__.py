"""Looking inside a model: attention patterns (more of §9's residual-stream view comes later)."""

from tlm.interpret.attention import attention_patterns, plot_attention

__all__ = ["attention_patterns", "plot_attention"]
