"""Exchanging models with other tools: Hugging Face's GPT-2, GPT-NeoX and Marian layouts,
and llama.cpp's GGUF. Which one a path holds is decided by `tlm.kinds`."""

from tlm.interop.gpt2 import HFFormatError

__all__ = ["HFFormatError"]
