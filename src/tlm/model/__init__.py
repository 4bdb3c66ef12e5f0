"""The transformer of J&M ch. 9: attention, layers, the LM, hook points."""

from tlm.model.transformer import TransformerLM

__all__ = ["TransformerLM"]
